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
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import ember
from ember.codegen.kernel import build_kernel_ast
from ember.codegen.linearize import linearize
from ember.codegen.phases import full_rewrite
from ember.config import Config
from ember.debug.log import DebugDump, describe_fusion, describe_ir
from ember.errors import EmberError
from ember.lower import lower_graph
from ember.metrics import metrics
from ember.renderer.cpp import RenderedKernel, render
from ember.runtime.cache import content_hash
from ember.runtime.cpu import CompiledKernel, compile_cpp, simd_math_functions
from ember.schedule import KernelStep, schedule
from ember.wrapper.python import KernelBinary, generate_wrapper, load_wrapper


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
    timings: dict[str, float] = {}
    debug = DebugDump(config.debug, config.debug_dir, content_hash(gm.code, repr(_input_metadata(example_inputs))))
    debug.write("fx_graph.txt", gm.print_readable(print_output=False))
    with stage("lower", timings):
        graph, lowering = lower_graph(gm, example_inputs)
    debug.write("ir.txt", describe_ir(graph))
    with stage("schedule", timings):
        scheduled = schedule(graph, fusion=config.fusion)
        steps = scheduled.steps
    debug.write("fusion.txt", describe_fusion(scheduled))
    with stage("codegen", timings):
        rendered = {i: codegen_kernel(s, config) for i, s in enumerate(steps) if isinstance(s, KernelStep)}
    for kernel, _ in rendered.values():
        debug.write(f"kernels/{kernel.name}.cpp", kernel.source)
    with stage("runtime", timings):
        binaries = compile_kernels(rendered, config)
    with stage("wrapper", timings):
        wrapper = generate_wrapper(graph, steps, binaries)
        call, path = load_wrapper(wrapper, graph.constants, Path(config.cache_dir))
    debug.write("wrapper.py", wrapper.source)
    if config.explain_file:
        with open(config.explain_file, "a") as f:
            f.write(f"=== graph with inputs {[b.name for b in graph.inputs]}\n")
            f.write(describe_fusion(scheduled))
            f.write(f"planned peak memory of intermediates: {wrapper.peak_bytes} bytes\n\n")
    debug.write("timings.txt", "".join(f"{k:10s} {v:.4f}s\n" for k, v in timings.items()))
    metrics.graphs_compiled += 1
    metrics.kernels_generated += len(rendered)
    metrics.fusions += scheduled.fusions
    metrics.fusion_refusals += len(scheduled.refusals)
    metrics.extern_calls += sum(1 for s in steps if not isinstance(s, KernelStep))
    metrics.fallback_calls += len(lowering.fallback_ops)
    metrics.fallback_ops.update(lowering.fallback_ops)
    call._boxed_call = True  # type: ignore[attr-defined]
    call.wrapper_path = path  # type: ignore[attr-defined]
    return call


def codegen_kernel(step: KernelStep, config: Config) -> tuple[RenderedKernel, tuple[str, ...]]:
    """One kernel: AST, rewrite phases, linearize, render. Names the op when it fails."""
    try:
        ast = build_kernel_ast(step.group, step.stored)
        sink = full_rewrite(ast.sink)
        program = linearize(sink)
        name = f"kernel_{sink.key[:16]}"
        return render(name, program, ast.outputs, config.parallel_threshold, simd_math_functions()), ast.params
    except Exception as e:
        origins = ", ".join(o for c in step.group for o in c.origins)
        raise EmberError("codegen", f"{type(e).__name__}: {e}", origins) from e


def compile_kernels(rendered: dict[int, tuple[RenderedKernel, tuple[str, ...]]], config: Config) -> dict:
    """gcc runs in parallel: each compile is a subprocess, so threads are enough."""
    cache_dir = Path(config.cache_dir)

    def build(item: tuple[RenderedKernel, tuple[str, ...]]) -> CompiledKernel:
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
        binaries[i] = KernelBinary(result.symbol, str(result.path), result.symbol, rendered[i][1], errors)
    return binaries


def _input_metadata(example_inputs: list[Any]) -> list:
    return [
        (tuple(x.shape), x.stride(), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else type(x).__name__
        for x in example_inputs
    ]
