"""compile_graph: one aten FX graph -> a callable, through every stage in order.

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
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import ember
from ember.codegen.kernel import KernelAST, build_kernel_ast
from ember.codegen.linearize import linearize
from ember.codegen.phases import full_rewrite
from ember.compile_search import compile_candidates, plan_search
from ember.compile_triton import codegen_triton_kernel, compile_triton_kernels, graph_backend, graph_device
from ember.config import Config
from ember.debug.log import DebugDump, describe_fusion, describe_ir
from ember.errors import EmberError
from ember.lower import lower_graph
from ember.metrics import metrics
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
    versions = f"{ember_source_hash()} {compiler_identity(config.cxx)} {simd_math_functions()}"
    versions += f" {machine_identity()}" if config.kernel_search else ""  # a wrapper may hold a recorded winner
    key = graph_cache.graph_key(gm, example_inputs, config.cache_key(), versions)
    debug = DebugDump(config.debug, config.debug_dir, key)
    debug.write("fx_graph.txt", gm.print_readable(print_output=False))
    # a debug run wants every stage's dump, so it never loads a graph whole
    call = _load_cached(gm, key, config) if config.graph_cache and not config.debug else None
    if call is None:
        call, source, objects, summary = _compile_stages(gm, example_inputs, config, debug)
        graph_cache.store(cache_dir, key, source, objects, summary)
    else:
        summary = call.summary
    if config.explain_file:
        with open(config.explain_file, "a") as f:
            f.write(summary.explanation)
    _record(summary)
    return call


def _compile_stages(gm, example_inputs: list[Any], config: Config, debug: DebugDump) -> tuple:
    """Every stage, in order; returns the loaded wrapper, its source and a summary."""
    timings: dict[str, float] = {}
    with stage("lower", timings):
        graph, lowering = lower_graph(gm, example_inputs, fallback_random=config.fallback_random)
    debug.write("ir.txt", describe_ir(graph))
    with stage("schedule", timings):
        scheduled = schedule(graph, fusion=config.fusion)
        steps = scheduled.steps
    debug.write("fusion.txt", describe_fusion(scheduled))
    device = graph_device(gm, example_inputs)
    with stage("codegen", timings):
        backend = graph_backend(device, config)
        if backend == "triton":
            rendered = {i: codegen_triton_kernel(s) for i, s in enumerate(steps) if _has_work(s)}
        else:
            dying = [{n: graph.buffers[n] for n in names} for names in graph_last_uses(graph, steps)]
            rendered = {i: codegen_kernel(s, config, dying[i]) for i, s in enumerate(steps) if _has_work(s)}
    for kernel, _ in rendered.values():
        debug.write(f"kernels/{kernel.name}.{'py' if backend == 'triton' else 'cpp'}", kernel.source)
    with stage("runtime", timings):
        if backend == "triton":
            binaries = compile_triton_kernels(rendered, config, interpret=device.type == "cpu")
        else:
            binaries = compile_kernels(rendered, config)
            if config.kernel_search:
                binaries = compile_candidates(binaries, rendered, config, debug)
    with stage("wrapper", timings):
        host_inputs = frozenset(b.name for b, x in zip(graph.inputs, example_inputs)
                                if isinstance(x, torch.Tensor) and x.device != device)  # fmt: skip
        wrapper = generate_wrapper(graph, steps, binaries, device, host_inputs)
        call, path = load_wrapper(wrapper, graph.constants, Path(config.cache_dir))
    debug.write("wrapper.py", wrapper.source)
    debug.write("timings.txt", "".join(f"{k:10s} {v:.4f}s\n" for k, v in timings.items()))
    explanation = (
        f"=== graph with inputs {[b.name for b in graph.inputs]}\n{describe_fusion(scheduled)}"
        f"planned peak memory of intermediates: {wrapper.peak_bytes} bytes\n\n"
    )
    summary = graph_cache.GraphSummary(
        kernels=len(rendered), fusions=scheduled.fusions, refusals=len(scheduled.refusals),
        extern_calls=sum(1 for s in steps if not isinstance(s, KernelStep)),
        fallback_ops=list(lowering.fallback_ops), explanation=explanation,
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


def _record(summary) -> None:
    metrics.graphs_compiled += 1
    metrics.kernels_generated += summary.kernels
    metrics.fusions += summary.fusions
    metrics.fusion_refusals += summary.refusals
    metrics.extern_calls += summary.extern_calls
    metrics.fallback_calls += len(summary.fallback_ops)
    metrics.fallback_ops.update(summary.fallback_ops)


@functools.cache
def ember_source_hash() -> str:
    """ember's version and a hash of its source: a graph cached by other code is never served."""
    root = Path(ember.__file__).parent
    return content_hash(ember.__version__, *(p.read_text() for p in sorted(root.rglob("*.py"))))


def _has_work(step) -> bool:
    """A kernel over empty buffers has nothing to do: the wrapper only allocates them."""
    return isinstance(step, KernelStep) and any(c.buffer.layout.numel > 0 for c in step.group)


def codegen_kernel(step: KernelStep, config: Config, dying: dict | None = None) -> tuple[RenderedKernel, KernelAST]:
    """One kernel: AST, rewrite phases, linearize, render. Names the op when it fails.
    `dying`: the buffers whose last use is this kernel (it may write over one of them)."""
    try:
        ast = build_kernel_ast(step.group, step.stored, dying)
        sink = full_rewrite(ast.sink)
        program = linearize(sink)
        name = f"kernel_{sink.key[:16]}"
        kernel = render(name, program, ast.outputs, config.parallel_threshold, simd_math_functions())
        if config.kernel_search:
            kernel.search = plan_search(program, kernel, lambda c: render(
                name, program, ast.outputs, config.parallel_threshold, simd_math_functions(), c).source)  # fmt: skip
        return kernel, ast
    except Exception as e:
        origins = ", ".join(o for c in step.group for o in c.origins)
        raise EmberError("codegen", f"{type(e).__name__}: {e}", origins) from e


def compile_kernels(rendered: dict[int, tuple[RenderedKernel, KernelAST]], config: Config) -> dict:
    """gcc runs in parallel: each compile is a subprocess, so threads are enough."""
    cache_dir = Path(config.cache_dir)

    def build(item: tuple[RenderedKernel, KernelAST]) -> CompiledKernel:
        kernel, _ = item
        return compile_cpp(kernel.source, kernel.name, cache_dir, config.cxx, ember.__version__)

    with ThreadPoolExecutor(max_workers=max(1, config.compile_threads)) as pool:
        compiled = dict(zip(rendered, pool.map(build, rendered.values())))
    binaries = {}
    for i, result in compiled.items():
        metrics.code_cache_hits += result.cache_hit
        metrics.code_cache_misses += not result.cache_hit
        # identical kernels share one loaded function: the symbol is a content hash
        errors = tuple((e.error, e.message) for e in rendered[i][0].errors)
        ast = rendered[i][1]
        binaries[i] = KernelBinary(result.symbol, str(result.path), result.symbol, ast.params, errors, ast.inplace)
    return binaries
