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
import functools
import os
import time
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
from ember.errors import EmberError
from ember.lower import lower_graph
from ember.lower.split_reductions import SplitPolicy, split_reductions
from ember.metrics import metrics
from ember.passes import run_passes
from ember.renderer.cpp import RenderedKernel, render
from ember.runtime import graph_cache
from ember.runtime.cache import content_hash
from ember.runtime.cpu import CompiledKernel, compile_cpp, compiler_identity, simd_math_functions
from ember.runtime.search import machine_identity
from ember.schedule import KernelStep, graph_last_uses, schedule
from ember.wrapper.python import KernelBinary, WrapperSource, generate_wrapper, load_wrapper


@contextlib.contextmanager
def stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Times a stage and names it in any internal error that escapes it."""
    start = time.perf_counter()
    try:
        yield
    except EmberError:
        raise
    except Exception as e:
        raise EmberError(name, f"{type(e).__name__}: {e}") from e
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config) -> Callable:
    cache_dir = Path(config.cache_dir)
    received = gm.print_readable(print_output=False) if config.debug else ""
    timings: dict[str, float] = {}
    versions = f"{ember_source_hash()} {compiler_identity(config.cxx)} {simd_math_functions()}"
    # Note: the graph cache key and the passes. ember's own passes are a function of the graph,
    # the config and ember's source, all in the key: without user hooks the graph is keyed as
    # received, and a hit skips the passes too. A user's hook may do anything, so with hooks
    # the passes run first and the key is the graph after them.
    hooks = bool(config.pre_passes or config.post_passes)
    versions += f" {machine_identity()}" if config.kernel_search else ""  # a wrapper may hold a recorded winner
    # a debug run wants every stage's dump, so it never loads a graph whole
    use_cache = config.graph_cache and not config.debug
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
        call, source, objects, summary = _compile_stages(gm, example_inputs, config, debug, timings)
        summary.pass_rewrites = dict(rewrites)
        if config.graph_cache:  # off means neither loaded nor written
            with stage("graph_cache_store", timings):
                graph_cache.store(cache_dir, key, source, objects, summary)
    else:
        summary = call.summary
    debug.write("timings.txt", "".join(f"{k:18s} {v:.4f}s\n" for k, v in timings.items()))
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


def _compile_stages(gm, example_inputs: list[Any], config: Config, debug: DebugDump, timings: dict) -> tuple:
    """Every stage, in order; returns the loaded wrapper, its source and a summary.
    C++ kernels go to gcc as soon as each is rendered (Note: compiling while generating)."""
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
    debug.write("fusion.txt", describe_fusion(scheduled))
    with contextlib.ExitStack() as pool_scope:
        if backend == "triton":
            with stage("codegen", timings):
                rendered: dict = {i: codegen_triton_kernel(s, config.check_ir)
                                  for i, s in enumerate(steps) if _has_work(s)}  # fmt: skip
            with stage("runtime", timings):
                binaries = compile_triton_kernels(rendered, config, interpret=device.type == "cpu")
        else:
            builder = pool_scope.enter_context(KernelBuilder(config))
            with stage("codegen", timings):
                dying = [{n: graph.buffers[n] for n in names} for names in graph_last_uses(graph, steps)]
            rendered = {}
            for i, step in enumerate(steps):
                if _has_work(step):
                    with stage("codegen", timings):
                        rendered[i] = codegen_kernel(step, config, dying[i], timings)
                    builder.submit(rendered[i][0])
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
            graph, steps, binaries, device, host_inputs, config.huge_pages, config.buffer_pool_mb << 20
        )
        call, path = load_wrapper(wrapper, graph.constants, Path(config.cache_dir))
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
    cache_dir = Path(config.cache_dir)
    entry = graph_cache.load(cache_dir, key)
    if entry is None:
        return None
    source, objects, summary = entry
    try:
        call, path = load_wrapper(WrapperSource(source, objects), graph_cache.graph_constants(gm), cache_dir)
    except OSError:  # a kernel it loads is gone: rebuild the whole graph
        graph_cache.discard(cache_dir, key)
        return None
    metrics.graph_cache_hits += 1
    return _finish(call, path, summary)


def _finish(call: Callable, path: Path, summary) -> Callable:
    call._boxed_call = True  # type: ignore[attr-defined]
    call.wrapper_path = path  # type: ignore[attr-defined]
    call.summary = summary  # type: ignore[attr-defined]
    return call


def _record(summary, timings: dict[str, float]) -> None:
    metrics.graphs_compiled += 1
    metrics.compile_seconds.update(timings)
    metrics.kernels_generated += summary.kernels
    metrics.tiled_kernels += summary.tiled_kernels
    metrics.fusions += summary.fusions
    metrics.fusion_refusals += summary.refusals
    metrics.extern_calls += summary.extern_calls
    metrics.reduce_loops += summary.reduce_loops
    metrics.fallback_calls += len(summary.fallback_ops)
    metrics.fallback_ops.update(summary.fallback_ops)
    metrics.pass_rewrites.update(summary.pass_rewrites)


@functools.cache
def ember_source_hash() -> str:
    """ember's version and a hash of its source: a graph cached by other code is never served."""
    root = Path(ember.__file__).parent
    return content_hash(ember.__version__, *(p.read_text() for p in sorted(root.rglob("*.py"))))


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
        ast = build_kernel_ast(step.group, step.stored, dying)
        sink = full_rewrite(ast.sink, check=config.check_ir)
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

    def __init__(self, config: Config):
        self.config = config
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

    def binaries(self, rendered: dict[int, tuple[RenderedKernel, KernelAST]]) -> dict[int, KernelBinary]:
        binaries = {}
        for i, (kernel, ast) in rendered.items():
            result = self.futures[kernel.source].result()
            metrics.code_cache_hits += result.cache_hit
            metrics.code_cache_misses += not result.cache_hit
            # identical kernels share one loaded function: the symbol is a content hash
            errors = tuple((e.error, e.message) for e in kernel.errors)
            binaries[i] = KernelBinary(result.symbol, str(result.path), result.symbol, ast.params, errors, ast.inplace)
        return binaries


def compile_workers(requested: int) -> int:
    """`compile_threads`, or one per core this process may run on when it is 0."""
    return requested if requested > 0 else max(1, len(os.sched_getaffinity(0)))
