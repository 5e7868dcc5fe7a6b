"""compile_graph: one aten FX graph -> a callable, through every stage in order.

passes    FX graph passes on the aten graph (DCE, no-ops, oneDNN rewrites, user hooks)
lower     aten FX graph -> LoweredGraph (computed buffers with UOp bodies, externs)
schedule  -> kernels and extern calls in order
codegen   each kernel -> UOp AST -> rewrite phases -> linearized program
render    -> C++ source
runtime   -> gcc (in parallel, cached on disk) -> loaded kernels
wrapper   -> Python `call(args)`, written to the cache and imported
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import ember
from ember.codegen.kernel import KernelAST, build_kernel_ast
from ember.codegen.linearize import linearize
from ember.codegen.phases import full_rewrite
from ember.codegen.shared_loops import reduce_loop_count
from ember.compile_search import compile_candidates, plan_search
from ember.compile_triton import codegen_triton_kernel, compile_triton_kernels, graph_backend, graph_device
from ember.config import Config
from ember.debug.log import DebugDump, describe_fusion, describe_ir
from ember.debug.progress import CompileProgress, logger
from ember.errors import EmberError
from ember.lower import lower_graph
from ember.lower.split_reductions import SplitPolicy, split_reductions
from ember.metrics import metrics
from ember.passes import run_passes
from ember.renderer.cpp import RenderedKernel, render
from ember.runtime import graph_cache
from ember.runtime.cache import CacheDirectoryError, open_root
from ember.runtime.cache_identity import graph_identity
from ember.runtime.cpu import CompiledKernel, compile_cpp, kernel_identity, simd_math_functions
from ember.runtime.search import machine_identity
from ember.schedule import KernelStep, graph_last_uses, schedule
from ember.wrapper.python import KernelBinary, WrapperSource, generate_wrapper, load_wrapper
from ember.wrapper.verify import VerifiedGraph


class StageTimes(dict):
    """Seconds per stage, summed over its entries; and the compile's progress display, which
    shows the stage being run (ember/debug/progress.py)."""

    def __init__(self, progress: CompileProgress | None = None):
        super().__init__()
        self.progress = progress


@contextlib.contextmanager
def stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Times a stage and names it in any internal error that escapes it."""
    start = time.perf_counter()
    if isinstance(timings, StageTimes) and timings.progress is not None:
        timings.progress.stage_started(name)
    try:
        yield
    except EmberError:
        raise
    except Exception as e:
        raise EmberError(name, f"{type(e).__name__}: {e}") from e
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config) -> Callable:
    progress = CompileProgress()
    try:
        return _compile_graph(gm, example_inputs, config, StageTimes(progress))
    finally:
        progress.finish()


def _compile_graph(
    gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config, timings: StageTimes
) -> Callable:
    cache_dir = open_root(config.cache_dir)  # refuses a folder others could put code in (Note: cache safety)
    received = gm.print_readable(print_output=False) if config.debug else ""
    versions = graph_identity(kernel_identity(config.cxx))
    versions += f" threads={torch.get_num_threads()}"  # the oneDNN rewrites depend on it (passes/mkldnn.py)
    # Note: the graph cache key and the passes. ember's own passes are a function of the graph,
    # the config and ember's source, all in the key: without user hooks the graph is keyed as
    # received, and a hit skips the passes too. A user's hook may do anything, so with hooks
    # the passes run first and the key is the graph after them.
    hooks = bool(config.pre_passes or config.post_passes)
    versions += f" {machine_identity()}" if config.kernel_search else ""  # a wrapper may hold a recorded winner
    # a debug run wants every stage's dump, so it never loads a graph whole; a verified one needs
    # the lowered graph and the steps, which a cached graph does not keep
    use_cache = config.graph_cache and not config.debug and not config.verify
    original = gm  # the passes work on a copy: verify checks against the graph as received
    key, call = None, None
    if not hooks:
        key, call = _key_and_cached(gm, example_inputs, config, versions, use_cache, timings)
    if call is None:
        with stage("passes", timings):
            gm, rewrites = run_passes(gm, config)
        if hooks:
            key, call = _key_and_cached(gm, example_inputs, config, versions, use_cache, timings)
    assert key is not None
    debug = DebugDump(config.debug, config.debug_dir, key)
    if call is None:
        debug.write("fx_graph.txt", received)
        debug.write("fx_graph_after_passes.txt", gm.print_readable(print_output=False))
        call, source, objects, summary = _compile_stages(gm, example_inputs, config, debug, timings, original)
        summary.pass_rewrites = dict(rewrites)
        if config.graph_cache and not config.verify:  # off means neither loaded nor written
            with stage("graph_cache_store", timings):
                graph_cache.store(cache_dir, key, source, objects, summary)
    else:
        summary = call.summary
    debug.write("timings.txt", "".join(f"{k:18s} {v:.4f}s\n" for k, v in timings.items()))
    log_stages(timings)
    if config.explain_file:
        with open(config.explain_file, "a") as f:
            f.write(summary.explanation)
    _record(summary, timings)
    return call


def _key_and_cached(gm, example_inputs, config: Config, versions: str, use_cache: bool, timings: dict) -> tuple:
    with stage("graph_key", timings):
        key = graph_cache.graph_key(gm, example_inputs, config.cache_key(), versions)
    if not use_cache:
        return key, None
    with stage("graph_cache_load", timings):
        return key, _load_cached(gm, key, config)


def _compile_stages(gm, example_inputs: list[Any], config: Config, debug: DebugDump, timings: dict,
                    original: torch.fx.GraphModule | None = None) -> tuple:  # fmt: skip
    """Every stage, in order; returns the loaded wrapper, its source and a summary.
    C++ kernels go to gcc as soon as each is rendered (Note: compiling while generating).
    `original`: the graph before the passes, which `config.verify` checks each call against."""
    device = graph_device(gm, example_inputs)
    backend = graph_backend(device, config)
    with stage("lower", timings):
        graph, lowering = lower_graph(gm, example_inputs, fallback_random=config.fallback_random, backend=backend)
        if backend == "triton":
            split_reductions(graph, lowering, SplitPolicy(config.split_reductions))
    debug.write("ir.txt", describe_ir(graph))
    with stage("schedule", timings):
        scheduled = schedule(graph, fusion=config.fusion)
        steps = scheduled.steps
    metrics.tally("schedule_work", vars(scheduled.work))
    debug.write("fusion.txt", describe_fusion(scheduled))
    with contextlib.ExitStack() as pool_scope:
        if backend == "triton":
            with stage("codegen", timings):
                rendered: dict = {i: codegen_triton_kernel(s) for i, s in enumerate(steps) if _has_work(s)}
            with stage("runtime", timings):
                binaries = compile_triton_kernels(rendered, config, interpret=device.type == "cpu")
        else:
            progress = timings.progress if isinstance(timings, StageTimes) else None
            builder = pool_scope.enter_context(KernelBuilder(config, progress))
            with stage("codegen", timings):
                dying = [{n: graph.buffers[n] for n in names} for names in graph_last_uses(graph, steps)]
            rendered = {}
            if progress is not None:
                progress.kernels(total=sum(1 for s in steps if _has_work(s)))
            for i, step in enumerate(steps):
                if _has_work(step):
                    with stage("codegen", timings):
                        rendered[i] = codegen_kernel(step, config, dying[i], timings)
                    builder.submit(rendered[i][0])
                    if progress is not None:
                        progress.kernels(generated=1)
            with stage("runtime", timings):  # what is left of gcc once every kernel is rendered
                binaries = builder.binaries(rendered)
    for kernel, _ in rendered.values():
        debug.write(f"kernels/{kernel.name}.{'py' if backend == 'triton' else 'cpp'}", kernel.source)
    if backend != "triton" and config.kernel_search:
        binaries = compile_candidates(binaries, rendered, config, debug)
    with stage("wrapper", timings):
        host_inputs = frozenset(b.name for b, x in zip(graph.inputs, example_inputs)
                                if isinstance(x, torch.Tensor) and x.device != device)  # fmt: skip
        wrapper = generate_wrapper(
            graph, steps, binaries, device, host_inputs, config.huge_pages, config.buffer_pool_mb << 20, config.verify
        )
        call, path = load_wrapper(wrapper, graph.constants, Path(config.cache_dir))
        if config.verify:  # Note: verifying a compiled graph
            call = VerifiedGraph(call, original if original is not None else gm, graph, steps, binaries, config.strict)
    debug.write("wrapper.py", wrapper.source)
    explanation = (
        f"=== graph with inputs {[b.name for b in graph.inputs]}\n{describe_fusion(scheduled)}"
        f"planned peak memory of intermediates: {wrapper.peak_bytes} bytes\n\n"
    )
    summary = graph_cache.GraphSummary(
        kernels=len(rendered), fusions=scheduled.fusions, refusals=len(scheduled.refusals),
        extern_calls=sum(1 for s in steps if not isinstance(s, KernelStep)),
        reduce_loops=sum(getattr(kernel, "reduce_loops", 0) for kernel, _ in rendered.values()),
        fallback_ops=list(lowering.fallback_ops), explanation=explanation,
        tiled_kernels=0 if backend == "triton" else sum(kernel.tiled for kernel, _ in rendered.values()),
    )  # fmt: skip
    return _finish(call, path, summary), wrapper.source, wrapper.objects, summary


def _load_cached(gm: torch.fx.GraphModule, key: str, config: Config) -> Callable | None:
    """The graph of `key` from the cache, or None. Any failure while loading it (a damaged or
    foreign entry, a kernel that is gone or fails its checksum) discards the entry and the
    graph is compiled again (Note: cache safety)."""
    cache_dir = Path(config.cache_dir)
    try:
        entry = graph_cache.load(cache_dir, key)
        if entry is None:
            return None
        source, objects, summary = entry
        call, path = load_wrapper(WrapperSource(source, objects), graph_cache.graph_constants(gm), cache_dir)
    except CacheDirectoryError:
        raise
    except Exception as e:
        graph_cache.discard_entry(cache_dir, key, e)
        return None
    metrics.add(graph_cache_hits=1)
    return _finish(call, path, summary)


def _finish(call: Callable, path: Path, summary) -> Callable:
    call._boxed_call = True  # type: ignore[attr-defined]
    call.wrapper_path = path  # type: ignore[attr-defined]
    call.summary = summary  # type: ignore[attr-defined]
    return call


def log_stages(timings: dict[str, float]) -> None:
    """One `logging` record per stage (logger "ember"), with its seconds."""
    for name, seconds in timings.items():
        logger.info("stage %s: %.3f s", name, seconds)


def _record(summary, timings: dict[str, float]) -> None:
    metrics.add(
        graphs_compiled=1,
        kernels_generated=summary.kernels,
        tiled_kernels=summary.tiled_kernels,
        fusions=summary.fusions,
        fusion_refusals=summary.refusals,
        extern_calls=summary.extern_calls,
        reduce_loops=summary.reduce_loops,
        fallback_calls=len(summary.fallback_ops),
    )
    metrics.tally("compile_seconds", timings)
    metrics.tally("fallback_ops", Counter(summary.fallback_ops))
    metrics.tally("pass_rewrites", summary.pass_rewrites)


def _has_work(step) -> bool:
    """A kernel over empty buffers has nothing to do: the wrapper only allocates them."""
    return isinstance(step, KernelStep) and any(c.buffer.layout.numel > 0 for c in step.group)


def codegen_kernel(
    step: KernelStep, config: Config, dying: dict | None = None, timings: dict[str, float] | None = None
) -> tuple[RenderedKernel, KernelAST]:
    """One kernel: AST, rewrite phases, linearize, render. Names the op when it fails.
    `dying`: the buffers whose last use is this kernel (it may write over one of them).
    `timings` gets the rendering's share under "render" (it is part of "codegen")."""
    try:
        ast = build_kernel_ast(step.group, step.stored, dying, step.alignment, step.bodies)
        sink = full_rewrite(ast.sink)
        program = linearize(sink)
        name = f"kernel_{sink.key[:16]}"
        start = time.perf_counter()
        kernel = render(name, program, ast.outputs, config.parallel_threshold, simd_math_functions())
        kernel.reduce_loops = reduce_loop_count(program)
        if timings is not None:
            timings["render"] = timings.get("render", 0.0) + time.perf_counter() - start
        if config.kernel_search:
            kernel.search = plan_search(program, kernel, lambda c: render(
                name, program, ast.outputs, config.parallel_threshold, simd_math_functions(), c).source)  # fmt: skip
        return kernel, ast
    except Exception as e:
        origins = ", ".join(o for c in step.group for o in c.origins)
        raise EmberError("codegen", f"{type(e).__name__}: {e}", origins) from e


class KernelBuilder:
    """gcc for each rendered kernel, started as soon as it is submitted.

    Note: compiling while generating
        Code generation is Python (one core, the GIL); gcc runs in subprocesses. Submitting each
        kernel to a thread pool as soon as it is rendered lets gcc work on the other cores while
        the next kernels are generated, instead of waiting for all of them. Each compile is a
        subprocess, so threads are enough; identical sources are compiled once. The pool has one
        thread per usable core (`config.compile_threads`), so a cold compile does not start more
        gcc processes than the machine runs at once.
    """

    def __init__(self, config: Config, progress: CompileProgress | None = None):
        self.config = config
        self.progress = progress
        self.pool = ThreadPoolExecutor(max_workers=compile_workers(config.compile_threads))
        self.futures: dict[str, Future[CompiledKernel]] = {}  # source -> its compile

    def __enter__(self) -> KernelBuilder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, kernel: RenderedKernel) -> None:
        if kernel.source not in self.futures:
            cache_dir, cxx = Path(self.config.cache_dir), self.config.cxx
            self.futures[kernel.source] = self.pool.submit(
                compile_cpp, kernel.source, kernel.name, cache_dir, cxx, ember.__version__
            )
            if (progress := self.progress) is not None:
                self.futures[kernel.source].add_done_callback(lambda _: progress.kernels(compiled=1))

    def binaries(self, rendered: dict[int, tuple[RenderedKernel, KernelAST]]) -> dict[int, KernelBinary]:
        binaries = {}
        for i, (kernel, ast) in rendered.items():
            result = self.futures[kernel.source].result()
            metrics.add(code_cache_hits=result.cache_hit, code_cache_misses=not result.cache_hit)
            # identical kernels share one loaded function: the symbol is a content hash
            errors = tuple((e.error, e.message) for e in kernel.errors)
            binaries[i] = KernelBinary(result.symbol, result.relative, result.symbol, ast.params, errors, ast.inplace,
                                       sha256=result.sha256)  # fmt: skip
        return binaries


def compile_workers(requested: int) -> int:
    """`compile_threads`, or one per core this process may run on when it is 0."""
    return requested if requested > 0 else max(1, len(os.sched_getaffinity(0)))
