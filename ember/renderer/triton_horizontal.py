"""Stage `renderer` (GPU): a horizontal kernel's parts -> one Triton module (Note: horizontal fusion,
schedule/horizontal.py).

Takes each part's pointwise block program (codegen/block_lowering.py; its own parameters p0, p1, ...)
with the names its parameters have in the kernel, and gives one `@triton.jit` function whose
programs are split into consecutive ranges, one per part: a part of n elements takes
cdiv(n, XBLOCK) programs, and the launch's grid is the sum of the parts' (runtime/triton.py, launch
fact `parts`). Each program branches on its id to its part, whose program id is its offset into
the range; the parts share XBLOCK, so one launch configuration (tuned as any pointwise kernel's)
serves them all. A part's names carry its prefix (`h3_t7`): Triton merges the names assigned in
the branches of an `if`, and one part's value must never meet another's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.renderer.common import RenderedKernel, kernel_errors
from ember.renderer.triton import PartNaming, render_body, tl_type
from ember.renderer.triton_module import argument_kinds, parameter_names
from ember.renderer.triton_prelude import PRELUDE
from ember.uop.dtypes import DType
from ember.uop.ops import UOp


@dataclass(frozen=True)
class HorizontalPart:
    """One part: its linearized pointwise program, its index width and element count, its
    parameters' names in the kernel, and which of its own parameters it takes by value."""

    program: list[UOp]
    index_bits: int
    numel: int
    rename: dict[str, str]
    scalars: frozenset[str]


def render_triton_horizontal(name: str, parts: list[HorizontalPart], params: list[tuple[str, DType, bool]],
                             scalars: frozenset[str]) -> RenderedKernel:  # fmt: skip
    """`params`: the kernel's parameters (name, dtype, written); `scalars`: those passed by value."""
    for _, dtype, _ in params:
        tl_type(dtype)
    errors = kernel_errors([u for part in parts for u in part.program])
    names = parameter_names(params, scalars)
    signature = ", ".join(names + (["ember_error"] if errors else []))
    by_value = sorted(scalars & {p for p, _, _ in params})
    jit = f"@triton.jit(do_not_specialize={by_value!r})" if by_value else "@triton.jit"
    lines = ["    pid = tl.program_id(0)", "    end_0 = 0"]
    for i, part in enumerate(parts):
        lines.append(f"    end_{i + 1} = end_{i} + ({part.numel} + XBLOCK - 1) // XBLOCK")
    for i, part in enumerate(parts):
        lines.append(f"    {'if' if i == 0 else 'elif'} pid < end_{i + 1}:")
        naming = PartNaming(part.rename, f"h{i}_", f"(pid - end_{i})")
        lines += ["    " + line for line in render_body(part.program, errors, part.index_bits, part.scalars, naming)]
    function = f"{jit}\ndef {name}_pointwise({signature}, XBLOCK: tl.constexpr):\n" + "\n".join(lines) + "\n"
    source = PRELUDE + "\n\n" + function
    numels = [part.numel for part in parts]
    launch = {"variants": ["pointwise"], "xnumel": max(numels), "rnumel": 0, "xextent": sum(numels), "parts": numels,
              "arguments": argument_kinds(params, scalars, errors)}  # fmt: skip
    return RenderedKernel(name, source, params, errors, launch=launch)
