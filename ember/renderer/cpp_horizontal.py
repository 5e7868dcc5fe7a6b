"""Stage `renderer` (C++): a horizontal kernel's parts -> one C++ function (Note: horizontal fusion,
schedule/horizontal.py).

Takes each part's linearized program (its own parameters p0, p1, ... as codegen named them) with
the names those parameters have in the kernel, and gives one `RenderedKernel` whose function opens
one OpenMP parallel region: one fork and join for every part, not one per part. Inside it each
part is a block of its own (its local names cannot clash with another's):
  - a part whose one loop nest is large enough for threads (renderer/cpp.py `loop_pragma`) is
    work-shared, `#pragma omp for nowait` (`for simd` where it is also the innermost loop): the
    parts are independent, so a thread done with its share of one goes on to the next at once
    (a part that also stores outside its loop waits for the loop's end first: `part_shape`);
  - any other part (a small loop, a 0-d update) runs whole on one thread, `#pragma omp single
    nowait`: the small parts of an optimizer step spread over the threads.
The region's end is the one barrier. Its values (index math, scalar loads) are computed by every
thread that reaches them; only loops and singles store.
"""

from __future__ import annotations

import sys

from ember.codegen.tiling import is_tile_loop
from ember.renderer.common import RenderedKernel, kernel_errors
from ember.renderer.cpp import PRELUDE, kernel_declarations, loop_pragma, render_body
from ember.uop.dtypes import DType
from ember.uop.ops import Ops, ScatterArg, UOp

Part = tuple[list[UOp], dict[str, str]]  # a part's program, and its parameters' names in the kernel


def render_horizontal(name: str, parts: list[Part], params: list[tuple[str, DType, bool]], parallel_threshold: int,
                      simd_math: tuple[tuple[str, int], ...] = ()) -> RenderedKernel:  # fmt: skip
    """`params`: the kernel's parameters, (name, dtype, written), every part's renamed ones."""
    every = [u for program, _ in parts for u in program]
    signature = ", ".join(f"{'' if w else 'const '}{d.ctype}* __restrict__ {n}" for n, d, w in params)
    errors = kernel_errors(every)
    if errors:  # Note: kernel errors (renderer/cpp.py)
        signature += ", int64_t* ember_error"
    blocks = [_part_block(program, rename, parallel_threshold, errors) for program, rename in parts]
    body = "#pragma omp parallel\n  {\n" + "".join(blocks) + "  }\n"
    declarations = kernel_declarations(every, body, simd_math)
    source = f'{PRELUDE}{declarations}\nextern "C" void {name}({signature}) {{\n  {body}}}\n'
    return RenderedKernel(name, source, params, errors, tiled=any(is_tile_loop(u) for u in every))


def _part_block(program: list[UOp], rename: dict[str, str], parallel_threshold: int, errors: list) -> str:
    shape = part_shape(program, parallel_threshold)
    if shape is None:  # one thread runs it all: no loop of it may open a parallel region of its own
        inner = render_body(program, sys.maxsize, errors, rename=rename, depth=3)
        return "    #pragma omp single nowait\n    {\n" + inner + "    }\n"
    if shape == "nowait":
        inner = render_body(program, parallel_threshold, errors, region="nowait", rename=rename, depth=3)
        return "    {\n" + inner + "    }\n"
    deferred: list[str] = []  # the stores outside the loop: after it, once every thread has read what they overwrite
    inner = render_body(program, parallel_threshold, errors, region="", rename=rename, depth=3, deferred=deferred)
    after = "    #pragma omp single nowait\n    {\n" + "\n".join(deferred) + "\n    }\n"
    return "    {\n" + inner + after + "    }\n"


def part_shape(program: list[UOp], parallel_threshold: int) -> str | None:
    """How a part's threads share it: "nowait", one loop nest and nothing stored outside it; "wait",
    one loop nest and stores outside it (a fused 0-d update: an optimizer's step count), which
    every thread computes from what it read before the loop, so one thread stores them once the
    loop's barrier says that every thread has read; None, run whole by one thread (a small loop,
    or stores outside whose buffers the loop reads)."""
    depth, loops, outside, inside = 0, [], set(), set()
    for i, u in enumerate(program):
        if u.op is Ops.RANGE:
            loops += [i] if depth == 0 else []
            depth += 1
        elif u.op is Ops.ENDRANGE:
            depth -= 1
        elif u.op is Ops.DEFINE_ACC or (depth == 0 and u.op is Ops.STORE and isinstance(u.arg, ScatterArg)):
            return None
        elif u.op is Ops.STORE and depth == 0:
            outside.add(u.src[0].src[0].arg.name)
        elif u.op is Ops.INDEX and depth > 0:
            inside.add(u.src[0].arg.name)
    if len(loops) != 1 or outside & inside:
        return None
    pragma = loop_pragma(program, loops[0], True, parallel_threshold, region="")
    if pragma is None or not pragma.startswith("#pragma omp for"):
        return None
    return "wait" if outside else "nowait"
