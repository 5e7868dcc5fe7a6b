"""The kernel-search path of compile_graph (`config.kernel_search`, off by default).

codegen  `plan_search`: a C++ kernel of enough work is also rendered with each choice of
         renderer/choices.py's `search_space`; identical sources are kept once
runtime  `compile_candidates`: a winner recorded for this machine is compiled alone (and used
         as the kernel); otherwise every candidate is compiled, in parallel, and the wrapper
         binds a search that times them at the first call (Note: kernel search,
         runtime/search.py)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ember
from ember.codegen.tiling import trip_count
from ember.config import Config
from ember.debug.log import DebugDump
from ember.metrics import metrics
from ember.renderer.choices import KernelChoices, search_space
from ember.renderer.common import RenderedKernel
from ember.renderer.cpp import MATH_CALLS, UNARY_CALLS
from ember.renderer.vector_math import vector_math_call
from ember.runtime.cache import open_root, relative_to_root
from ember.runtime.cpu import compile_cpp, simd_math_functions
from ember.runtime.search import read_winner, wide_default_vectors, winner_record
from ember.uop.dtypes import DType
from ember.uop.ops import Ops, UOp
from ember.wrapper.python import KernelBinary

MIN_SEARCH_WORK = 1 << 14  # loop iterations below which no choice can pay for its compile
MAX_EXTENT = 1 << 40  # bytes: an index bound past this is not a real extent


@dataclass(frozen=True)
class SearchPlan:
    candidates: tuple[tuple[KernelChoices, str], ...]  # (choices, source), distinct sources, the default first
    extents: tuple[int, ...]  # per parameter: the bytes the kernel may write from its pointer (0: read only)
    rereads: bool  # the kernel loads a buffer it writes: scratch copies are refilled before each run


def plan_search(program: list[UOp], kernel: RenderedKernel,
                render_with: Callable[[KernelChoices], str]) -> SearchPlan | None:  # fmt: skip
    """The renderings of `kernel` to time, or None when it is not worth a search (one
    distinct rendering, little work) or cannot be timed on copies (an unbounded store index)."""
    if loop_iterations(program) < MIN_SEARCH_WORK:
        return None
    narrower = wide_default_vectors() and not calls_vector_math(program)
    sources: dict[str, KernelChoices] = {kernel.source: KernelChoices()}
    for choices in search_space(program, narrower)[1:]:
        sources.setdefault(render_with(choices), choices)
    extents = written_extents(program, kernel.params)
    if len(sources) == 1 or extents is None:
        return None
    written = {name for name, _, w in kernel.params if w}
    rereads = any(u.op is Ops.LOAD and u.src[0].src[0].arg.name in written for u in program)
    return SearchPlan(tuple((c, s) for s, c in sources.items()), extents, rereads)


def calls_vector_math(program: list[UOp]) -> bool:
    """Whether the kernel calls a libm function the host has vector versions of (ember's own
    inline ones, Note: vector math, round alike at every width)."""
    vector = {name for name, _ in simd_math_functions()}
    binary = {Ops.POW: "pow", Ops.ATAN2: "atan2"}
    return any((UNARY_CALLS.get(u.op) or MATH_CALLS.get(u.op) or binary.get(u.op)) in vector
               and vector_math_call(u.op, u.src[0].dtype) is None for u in program)  # fmt: skip


def written_extents(program: list[UOp], params: list[tuple[str, DType, bool]]) -> tuple[int, ...] | None:
    """Bytes from each written parameter's pointer that the kernel may touch, from the
    bounds of its indices (0 for read-only parameters); None when a bound is not finite
    (Scratch in runtime/search.py copies exactly these bytes)."""
    if [name for name, _, _ in params] != [f"p{i}" for i in range(len(params))]:
        return None
    written = {name for name, _, w in params if w}
    ends: dict[str, int | float] = {}
    for u in program:
        if u.op is Ops.INDEX and (name := u.src[0].arg.name) in written:
            if u.src[1].vmin < 0:
                return None
            ends[name] = max(ends.get(name, 0), u.src[1].vmax + 1)
    extents = []
    for name, dtype, _ in params:
        end = ends.get(name, 0) * dtype.itemsize
        if not isinstance(end, int) or end > MAX_EXTENT:
            return None
        extents.append(end)
    return tuple(extents)


def loop_iterations(program: list[UOp]) -> int:
    """Iterations of every loop of the kernel, a nested loop's counted once per enclosing iteration."""
    total, nest = 0, [1]
    for u in program:
        if u.op is Ops.RANGE:
            nest.append(nest[-1] * trip_count(u))
            total += nest[-1]
        elif u.op is Ops.ENDRANGE:
            nest.pop()
    return total


def compile_candidates(binaries: dict[int, KernelBinary], rendered: dict, config: Config,
                       debug: DebugDump) -> dict[int, KernelBinary]:  # fmt: skip
    """`binaries` with each searched kernel replaced: by its recorded winner, or by the
    same kernel with a search over its compiled candidates (KernelBinary.search)."""
    cache_dir = Path(config.cache_dir)
    plans = {i: kernel.search for i, (kernel, _) in rendered.items() if kernel.search is not None}
    chosen: dict[int, list[int]] = {}
    records: dict[int, tuple[Path, str]] = {}
    for i, plan in plans.items():
        records[i] = winner_record(cache_dir, plan.candidates[0][1], ember.__version__)
        found = read_winner(*records[i], [dataclasses.asdict(c) for c, _ in plan.candidates])
        metrics.add(search_winners_loaded=found is not None)
        chosen[i] = list(range(len(plan.candidates))) if found is None else [found]
        for j, (choices, source) in enumerate(plan.candidates[1:], 1):
            debug.write(f"kernels/{rendered[i][0].name}.candidate{j}.cpp", f"// {choices}\n{source}")
    jobs = [(i, j) for i, js in chosen.items() for j in js]

    def build(job: tuple[int, int]):
        i, j = job
        return compile_cpp(plans[i].candidates[j][1], rendered[i][0].name, cache_dir, config.cxx, ember.__version__)

    with ThreadPoolExecutor(max_workers=max(1, config.compile_threads)) as pool:
        compiled = dict(zip(jobs, pool.map(build, jobs)))
    result = dict(binaries)
    for i, js in chosen.items():
        if len(js) == 1:  # the recorded winner
            winner = compiled[(i, js[0])]
            result[i] = dataclasses.replace(binaries[i], path=winner.relative, sha256=winner.sha256)
            continue
        candidates = [[dataclasses.asdict(plans[i].candidates[j][0]), compiled[(i, j)].relative,
                       compiled[(i, j)].sha256, compiled[(i, j)].symbol] for j in js]  # fmt: skip
        debug_file = str(debug.folder / "search" / f"{rendered[i][0].name}.txt") if debug.enabled else ""
        plan = plans[i]
        record, record_key = records[i]
        search = {"candidates": candidates, "record": relative_to_root(open_root(cache_dir), record),
                  "record_key": record_key, "extents": list(plan.extents),
                  "rereads": plan.rereads, "errors": bool(binaries[i].errors), "debug_file": debug_file}  # fmt: skip
        result[i] = dataclasses.replace(binaries[i], search=search)
    return result
