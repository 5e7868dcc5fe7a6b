"""compile_graph: one aten FX graph -> a callable, through every stage in order.

passes    FX graph passes on the aten graph (DCE, no-ops, oneDNN rewrites, user hooks)
lower     aten FX graph -> LoweredGraph (computed buffers with UOp bodies, externs)
schedule  -> kernels and extern calls in order
codegen   each kernel -> UOp AST -> rewrite phases -> C++ or Triton source (the backend's:
          compile_cpp.CppBackend, compile_triton.TritonBackend; Note: backends, backend.py)
runtime   -> gcc (in parallel, cached on disk) or Triton modules -> loaded kernels
wrapper   -> Python `call(args)`, written to the cache and imported
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ember
from ember.backend import Backend
from ember.compile_cpp import CppBackend
from ember.compile_triton import TritonBackend
from ember.config import Config
from ember.debug.log import DebugDump, describe_fusion, describe_ir
from ember.errors import EmberError, stage
from ember.lower import lower_graph
from ember.metrics import metrics
from ember.passes import run_passes
from ember.runtime import graph_cache
from ember.runtime.cache import content_hash
from ember.runtime.cpu import compiler_identity, simd_math_functions
from ember.runtime.search import machine_identity
from ember.schedule import KernelStep, schedule
from ember.wrapper.python import WrapperSource, generate_wrapper, load_wrapper


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
    """Every stage, in order; returns the loaded wrapper, its source and a summary. The backend
    (Note: backends, backend.py) does what differs between C++ and Triton."""
    device = graph_device(gm, example_inputs)
    backend = backend_for(device, config)
    with stage("lower", timings):
        caps = backend.capabilities
        graph, lowering = lower_graph(
            gm,
            example_inputs,
            fallback_random=config.fallback_random,
            unrenderable=caps.unrenderable,
            ordered_reductions=caps.ordered_reductions,
        )
        backend.prepare(graph, lowering, config)
    debug.write("ir.txt", describe_ir(graph))
    with stage("schedule", timings):
        scheduled = schedule(graph, fusion=config.fusion)
        steps = scheduled.steps
    debug.write("fusion.txt", describe_fusion(scheduled))
    generated = backend.generate(graph, steps, config, debug, timings)
    with stage("wrapper", timings):
        host_inputs = frozenset(b.name for b, x in zip(graph.inputs, example_inputs)
                                if isinstance(x, torch.Tensor) and x.device != device)  # fmt: skip
        wrapper = generate_wrapper(
            graph, steps, generated.binaries, device, host_inputs, config.huge_pages, config.buffer_pool_mb << 20
        )
        call, path = load_wrapper(wrapper, graph.constants, Path(config.cache_dir))
    debug.write("wrapper.py", wrapper.source)
    explanation = (
        f"=== graph with inputs {[b.name for b in graph.inputs]}\n{describe_fusion(scheduled)}"
        f"planned peak memory of intermediates: {wrapper.peak_bytes} bytes\n\n"
    )
    summary = graph_cache.GraphSummary(
        kernels=generated.kernels, fusions=scheduled.fusions, refusals=len(scheduled.refusals),
        extern_calls=sum(1 for s in steps if not isinstance(s, KernelStep)),
        reduce_loops=generated.reduce_loops, fallback_ops=list(lowering.fallback_ops), explanation=explanation,
        tiled_kernels=generated.tiled_kernels,
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


def graph_device(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> torch.device:
    """The device a graph computes on: its first CUDA input's (a CPU 0-d tensor may come along,
    as eager allows), else its first tensor input's, else any node's, else the CPU."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    for x in sorted(tensors, key=lambda t: t.device.type != "cuda"):
        return x.device
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def backend_for(device: torch.device, config: Config) -> Backend:
    """Triton for CUDA graphs; C++ for CPU graphs, or Triton under its interpreter when
    `config.backend == "triton"` (how CI tests the Triton path)."""
    if device.type == "cuda":
        return TritonBackend(interpret=False)
    if device.type == "cpu":
        return TritonBackend(interpret=True) if config.backend == "triton" else CppBackend()
    raise EmberError("lower", f"ember compiles for CPU and CUDA, not for device {device}")
