"""The C++ backend (Note: backends, backend.py): each kernel through the shared codegen steps
plus loop lowering (codegen/phases.full_rewrite), the linearizer and renderer/cpp.py, then gcc
while the next kernels are generated (Note: compiling while generating).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import ember
from ember.backend import Capabilities, GeneratedKernels, has_work
from ember.codegen.horizontal import HorizontalAST, build_horizontal_ast
from ember.codegen.kernel import KernelAST, build_kernel_ast
from ember.codegen.linearize import linearize
from ember.codegen.phases import full_rewrite, number_ranges
from ember.codegen.shared_loops import reduce_loop_count
from ember.compile_search import compile_candidates, plan_search
from ember.config import Config
from ember.debug.log import DebugDump
from ember.debug.progress import CompileProgress
from ember.errors import EmberError, stage
from ember.ir import LoweredGraph
from ember.metrics import metrics
from ember.renderer.common import RenderedKernel, kernel_params
from ember.renderer.cpp import render
from ember.renderer.cpp_horizontal import render_horizontal
from ember.runtime.cache import content_hash
from ember.runtime.cpu import (
    DRAWS_PER_BATCH,
    CompiledKernel,
    batchable,
    compile_cpp_batch,
    float_lanes,
    random_draws,
    simd_math_functions,
    source_flags,
)
from ember.schedule import KernelStep, dying_buffers
from ember.uop.ops import Ops, UOp
from ember.wrapper.python import KernelBinary


class CppBackend:
    """C++ kernels with OpenMP loops, compiled by gcc and called through ctypes."""

    name = "cpp"
    source_suffix = "cpp"
    capabilities = Capabilities()

    def prepare(self, graph: LoweredGraph, lowering, config: Config) -> None:
        """Nothing: OpenMP already splits long reductions over threads (renderer/cpp.py)."""

    def generate(self, graph: LoweredGraph, steps: list, config: Config, debug: DebugDump,
                 timings: dict[str, float]) -> GeneratedKernels:  # fmt: skip
        progress: CompileProgress | None = getattr(timings, "progress", None)
        with KernelBuilder(config, progress) as builder:
            with stage("codegen", timings):
                dying = dying_buffers(graph, steps)
            rendered: dict[int, tuple[RenderedKernel, KernelAST | HorizontalAST]] = {}
            generated: dict[tuple, RenderedKernel] = {}  # Note: kernels generated once
            if progress is not None:
                progress.kernels(total=sum(1 for s in steps if has_work(s)))
            for kernels in codegen_order(steps):
                for i in kernels:
                    with stage("codegen", timings):
                        rendered[i] = codegen_kernel(steps[i], config, dying[i], timings, generated)
                    builder.submit(rendered[i][0])
                    if progress is not None:
                        progress.kernels(generated=1)
                builder.start_pending()
            with stage("runtime", timings):  # what is left of gcc once every kernel is rendered
                binaries = builder.binaries(dict(sorted(rendered.items())))
        for kernel, _ in rendered.values():
            debug.write(f"kernels/{kernel.name}.{self.source_suffix}", kernel.source)
        if config.kernel_search:
            binaries = compile_candidates(binaries, rendered, config, debug)
        metrics.add(kernels_codegen=len(generated))
        return GeneratedKernels(
            binaries, len(rendered), sum(kernel.reduce_loops for kernel, _ in rendered.values()),
            sum(kernel.tiled for kernel, _ in rendered.values()),
        )  # fmt: skip


def codegen_order(steps: list) -> tuple[list[int], list[int]]:
    """The kernels of `steps` (their indices) in the order codegen takes them: those with random
    draws first, most draws first, as gcc takes longest over them (Note: gcc's effort on random
    draws, runtime/cpu.py), so their compiles start first and overlap the generation of the rest."""
    kernels = [i for i, step in enumerate(steps) if has_work(step)]
    draws = {i: random_draws_of(steps[i]) for i in kernels}
    drawing = sorted((i for i in kernels if draws[i]), key=lambda i: -draws[i])
    return drawing, [i for i in kernels if not draws[i]]


def random_draws_of(step: KernelStep) -> int:
    return sum(1 for member in step.group for u in member.body.toposort if u.op is Ops.PHILOX)


def codegen_kernel(
    step: KernelStep,
    config: Config,
    dying: dict | None = None,
    timings: dict[str, float] | None = None,
    generated: dict[tuple, RenderedKernel] | None = None,
) -> tuple[RenderedKernel, KernelAST | HorizontalAST]:
    """One kernel: AST, rewrite phases, linearize, render. Names the op when it fails.
    `dying`: the buffers whose last use is this kernel (it may write over one of them).
    `timings` gets the rendering's share under "render" (it is part of "codegen").
    `generated`: the kernels already generated for this graph by AST (Note: kernels generated once)."""
    try:
        if step.parts:  # Note: horizontal fusion (schedule/horizontal.py)
            return codegen_horizontal(step, config, dying, generated)
        ast = build_kernel_ast(step.group, step.stored, dying, step.alignment, step.bodies)
        sink = number_ranges(ast.sink)
        key = (sink, ast.outputs)
        if generated is not None and key in generated:
            return generated[key], ast
        kernel = _generate(sink, ast, config, timings)
        if generated is not None:
            generated[key] = kernel
        return kernel, ast
    except Exception as e:
        origins = ", ".join(o for c in step.group for o in c.origins)
        raise EmberError("codegen", f"{type(e).__name__}: {e}", origins) from e


def codegen_horizontal(
    step: KernelStep, config: Config, dying: dict | None, generated: dict[tuple, RenderedKernel] | None
) -> tuple[RenderedKernel, HorizontalAST]:
    """A horizontal kernel: each part through the phases and the linearizer (once per distinct
    part AST of the graph), then one function with one parallel region (renderer/cpp_horizontal.py)."""
    ast = build_horizontal_ast(step, dying)
    generated = generated if generated is not None else {}
    parts = []
    for part, rename in zip(ast.parts, ast.renames):
        sink = number_ranges(part.sink)
        key = ("horizontal part", sink, part.outputs)
        if key not in generated:
            lowered = full_rewrite(sink, check=config.check_ir, float_lanes=float_lanes())
            generated[key] = (lowered.key, linearize(lowered))  # type: ignore[assignment]
        lowered_key, program = generated[key]  # type: ignore[misc]
        parts.append((lowered_key, program, rename))
    params = {}
    for _, program, rename in parts:
        params |= {rename[n]: (rename[n], d, w) for n, d, w in kernel_params(program, frozenset())}
    ordered = sorted(params.values(), key=lambda p: int(p[0][1:]))
    ordered = [(n, d, n in ast.outputs) for n, d, _ in ordered]
    name = "kernel_h" + content_hash(*(f"{k}:{sorted(r.items())}" for k, _, r in parts))[:16]
    programs = [(program, rename) for _, program, rename in parts]
    return render_horizontal(name, programs, ordered, config.parallel_threshold, simd_math_functions()), ast


def _generate(sink: UOp, ast: KernelAST, config: Config, timings: dict[str, float] | None) -> RenderedKernel:
    """Note: kernels generated once
    Identical layers give identical kernels. Every buffer of a kernel AST is a positional
    parameter (codegen/kernel.py) and its ranges are numbered 0, 1, ... per nesting rank
    (`number_ranges`, order kept: no decision compares more than the order), so two kernels
    that compute the same thing have one AST; everything after it (the rewrite phases, the
    linearizer, the renderer, the search plan) is a function of that AST and the config, and
    runs once per distinct AST of a graph; gcc sees each distinct source once (KernelBuilder)."""
    lowered = full_rewrite(sink, check=config.check_ir, float_lanes=float_lanes())
    program = linearize(lowered)
    name = f"kernel_{lowered.key[:16]}"
    start = time.perf_counter()
    kernel = render(name, program, ast.outputs, config.parallel_threshold, simd_math_functions())
    kernel.reduce_loops = reduce_loop_count(program)
    if timings is not None:
        timings["render"] = timings.get("render", 0.0) + time.perf_counter() - start
    if config.kernel_search:
        kernel.search = plan_search(program, kernel, lambda c: render(
            name, program, ast.outputs, config.parallel_threshold, simd_math_functions(), c).source)  # fmt: skip
    return kernel


class KernelBuilder:
    """gcc for the rendered kernels, in batches started as soon as they fill.

    Note: compiling while generating
        Code generation is Python (one core, the GIL); gcc runs in subprocesses. Submitting
        kernels to a thread pool as soon as a batch of them is rendered lets gcc work on the
        other cores while the next kernels are generated, instead of waiting for all of them.
        Each compile is a subprocess, so threads are enough; identical sources are compiled
        once. A batch (Note: kernels compiled together, runtime/cpu.py) holds BATCH_KERNELS
        distinct sources, of one set of gcc flags, and at most DRAWS_PER_BATCH random draws
        (Note: gcc's effort on random draws); what is left when the last kernel is rendered is
        split over the workers. The pool has one thread per usable core (`config.compile_threads`), so a cold
        compile does not start more gcc processes than the machine runs at once.
    """

    def __init__(self, config: Config, progress: CompileProgress | None = None):
        self.config = config
        self.progress = progress
        self.workers = compile_workers(config.compile_threads)
        self.pool = ThreadPoolExecutor(max_workers=self.workers)
        # source -> (its batch's compile, its position in the batch)
        self.futures: dict[str, tuple[Future[list[CompiledKernel]], int]] = {}
        # rendered, not yet submitted, by the gcc flags they need (a batch shares its flags)
        self.pending: dict[tuple[str, ...], dict[str, RenderedKernel]] = {}

    def __enter__(self) -> KernelBuilder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, kernel: RenderedKernel) -> None:
        flags = source_flags(kernel.source)
        pending = self.pending.setdefault(flags, {})
        if kernel.source in self.futures or kernel.source in pending:
            return
        if not batchable(kernel.source):
            self._start([kernel])
            return
        pending[kernel.source] = kernel
        draws = sum(random_draws(source) for source in pending)
        if len(pending) >= BATCH_KERNELS or draws >= DRAWS_PER_BATCH:
            self._flush(pending, 1)

    def start_pending(self) -> None:
        """Every kernel submitted so far to gcc now, over the workers."""
        for pending in self.pending.values():
            self._flush(pending, self.workers)

    def _flush(self, pending: dict[str, RenderedKernel], parts: int) -> None:
        """Every kernel of `pending` into `parts` batches of about equal size, none with more than
        DRAWS_PER_BATCH random draws unless one kernel has them (Note: gcc's effort on random draws)."""
        kernels = list(pending.values())
        pending.clear()
        size = max(1, -(-len(kernels) // max(1, parts)))
        batch: list[RenderedKernel] = []
        draws = 0
        for kernel in kernels:
            more = random_draws(kernel.source)
            if batch and (len(batch) == size or draws + more > DRAWS_PER_BATCH):
                self._start(batch)
                batch, draws = [], 0
            batch.append(kernel)
            draws += more
        if batch:
            self._start(batch)

    def _start(self, kernels: list[RenderedKernel]) -> None:
        cache_dir, cxx = Path(self.config.cache_dir), self.config.cxx
        batch = [(k.name, k.source) for k in kernels]
        future = self.pool.submit(compile_cpp_batch, batch, cache_dir, cxx, ember.__version__)
        for i, kernel in enumerate(kernels):
            self.futures[kernel.source] = (future, i)
        if (progress := self.progress) is not None:
            future.add_done_callback(lambda _: progress.kernels(compiled=len(batch)))

    def binaries(
        self, rendered: dict[int, tuple[RenderedKernel, KernelAST | HorizontalAST]]
    ) -> dict[int, KernelBinary]:
        self.start_pending()
        binaries = {}
        for i, (kernel, ast) in rendered.items():
            future, position = self.futures[kernel.source]
            result = future.result()[position]
            metrics.add(code_cache_hits=result.cache_hit, code_cache_misses=not result.cache_hit)
            # identical kernels share one loaded function: the symbol is a content hash
            errors = tuple((e.error, e.message) for e in kernel.errors)
            arguments = ast.arguments(kernel.params)
            binaries[i] = KernelBinary(result.symbol, result.relative, result.symbol, arguments, errors, ast.inplace,
                                       sha256=result.sha256, variables=kernel.variables)  # fmt: skip
        return binaries


BATCH_KERNELS = 8  # distinct kernels per gcc process while rendering (Note: kernels compiled together)


def compile_workers(requested: int) -> int:
    """`compile_threads`, or one per core this process may run on when it is 0."""
    return requested if requested > 0 else max(1, len(os.sched_getaffinity(0)))
