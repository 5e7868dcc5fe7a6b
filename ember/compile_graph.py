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

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ember.backend import Backend
from ember.compile_cpp import CppBackend
from ember.compile_triton import TritonBackend
from ember.config import Config
from ember.debug.log import DebugDump, describe_fusion, describe_ir
from ember.debug.progress import CompileProgress, StageTimes, logger
from ember.debug.provenance import profiler_labels, step_origins
from ember.debug.record import GraphRecord, buffer_bytes, is_recording, new_graph_record
from ember.donation import DONATED_INPUTS
from ember.errors import EmberError, stage
from ember.lower import lower_graph
from ember.lower.collectives import groups_run_one_at_a_time
from ember.lower.graph import SAVED_OUTPUTS
from ember.metrics import metrics
from ember.passes import run_passes
from ember.passes.eager_memory import INPUTS_HELD
from ember.runtime import graph_cache
from ember.runtime.cache import CacheDirectoryError, open_root
from ember.runtime.cache_identity import graph_identity
from ember.runtime.cpu import kernel_identity
from ember.runtime.cuda_graphs import CudaGraphRunner
from ember.runtime.search import machine_identity
from ember.schedule import KernelStep, schedule
from ember.schedule.collectives import most_in_flight
from ember.schedule.host_scalars import scalar_inputs
from ember.schedule.nodes import mutated_buffers
from ember.size_guards import SizeGuards
from ember.uop.variables import size_hint
from ember.wrapper.python import WrapperSource, generate_wrapper, load_wrapper
from ember.wrapper.verify import VerifiedGraph


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config, role: str = "graph",
                  guards: SizeGuards | None = None) -> Callable:  # fmt: skip
    """`role` (forward, backward, inference) names the graph in debug dumps. `guards`: a symbolic
    compile's, stored with the graph and re-asserted when it is loaded (Note: guards a compile adds)."""
    progress = CompileProgress()
    try:
        return _compile_graph(gm, example_inputs, config, StageTimes(progress), role, guards)
    finally:
        progress.finish()


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config, timings: StageTimes,
                   role: str, guards: SizeGuards | None) -> Callable:  # fmt: skip
    cache_dir = open_root(config.cache_dir)  # refuses a folder others could put code in (Note: cache safety)
    config = _one_collective_at_a_time(gm, config)
    received = gm.print_readable(print_output=False) if config.debug else ""
    versions = graph_identity(kernel_identity(config.cxx))
    versions += f" threads={torch.get_num_threads()}"  # the oneDNN rewrites depend on it (passes/mkldnn.py)
    versions += " inputs_held" if gm.meta.get(INPUTS_HELD) else ""  # and on this (passes/eager_memory.py)
    donated = donated_inputs(gm, config)
    versions += f" donated={','.join(donated)}" if donated else ""  # (Note: donated inputs, donation.py)
    saved = gm.meta.get(SAVED_OUTPUTS, ())  # stored in eager's exact strides (Note: outputs in eager's layout)
    versions += f" saved={','.join(saved)}" if saved else ""
    # Note: the graph cache key and the passes. ember's own passes are a function of the graph,
    # the config and ember's source, all in the key: without user hooks the graph is keyed as
    # received, and a hit skips the passes too. A user's hook may do anything, so with hooks
    # the passes run first and the key is the graph after them.
    hooks = bool(config.pre_passes or config.post_passes)
    # a wrapper may hold a recorded winner; the linears' library was timed on this machine (passes/matmul_timing.py)
    versions += f" {machine_identity()}" if config.kernel_search or config.matmul_timing else ""
    # a debug run wants every stage's dump, so it never loads a graph whole; a verified one needs
    # the lowered graph and the steps, which a cached graph does not keep
    use_cache = config.graph_cache and not config.debug and not config.verify and not is_recording()
    original = gm  # the passes work on a copy: verify checks against the graph as received
    key, call = None, None
    if not hooks:
        key, call = _key_and_cached(gm, example_inputs, config, versions, use_cache, timings, guards)
    if call is None:
        with stage("passes", timings):
            gm, rewrites = run_passes(gm, config)
        if hooks:
            key, call = _key_and_cached(gm, example_inputs, config, versions, use_cache, timings, guards)
    assert key is not None
    debug = DebugDump(config.debug, config.debug_dir, key, role)
    record = new_graph_record(role, key)  # Note: report records (debug/record.py); None without a report
    if call is None:
        debug.write("fx_graph.txt", received)
        if debug.wants("fx_graph_after_passes.txt"):  # printing a large graph takes a tenth of a second
            debug.write("fx_graph_after_passes.txt", gm.print_readable(print_output=False))
        call, source, objects, summary = _compile_stages(gm, example_inputs, config, debug, timings, original, record,
                                                         donated)  # fmt: skip
        summary.pass_rewrites = dict(rewrites)
        summary.size_guards = guards.encoded() if guards is not None else []
        # off means neither loaded nor written; a guard the cache cannot hold keeps the graph out of it
        if config.graph_cache and not config.verify and record is None and summary.size_guards is not None:
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
    _log_summary(summary, role, key)
    if config.cuda_graphs and launches_work(summary) and graph_device(gm, example_inputs).type == "cuda":
        runner = CudaGraphRunner(call, frozenset(summary.mutated_inputs), f"{role} {key[:8]}", visible_outputs(role))
        if summary.collectives:  # a wait is a host-side wait on the process group's work: not replayable
            runner.refuse("it holds collectives (Note: collectives in the graph, schedule/collectives.py)")
        call = runner
    return call


def _one_collective_at_a_time(gm: torch.fx.GraphModule, config: Config) -> Config:
    """`config`, with one collective in flight where `gm`'s collectives go to a gloo group with
    several worker threads (Note: gloo runs collectives one at a time, lower/collectives.py)."""
    groups = groups_run_one_at_a_time(gm)
    if not groups:
        return config
    for group, threads in groups.items():
        _announce_once(f"ember: the collectives of process group {group!r} are issued one at a time: its gloo "
                       f"backend runs them on {threads} worker threads, and torch's gloo worker loop can corrupt "
                       "the heap when two finish together (Note: gloo runs collectives one at a time)")  # fmt: skip
    return dataclasses.replace(config, collectives_in_flight=1, collective_overlap=True)


_announced: set[str] = set()
_announced_lock = threading.Lock()


def _announce_once(message: str) -> None:
    """Log `message` (INFO) the first time this process meets it."""
    with _announced_lock:
        if message in _announced:
            return
        _announced.add(message)
    logger.info(message)


def launches_work(summary: graph_cache.GraphSummary) -> bool:
    """Whether a call of the graph launches anything a CUDA graph could replay: a graph of views and
    aliases alone would record an empty graph (torch warns that it was captured on the wrong stream)."""
    return summary.kernels + summary.extern_calls > 0


def visible_outputs(role: str) -> int | None:
    """How many leading outputs of the graph AOTAutograd is compiling reach the user, who may keep
    them across calls (None: all). A forward's later outputs are the activations saved for its
    backward, and a backward's outputs are gradients for `.grad` (Note: outputs lent or copied)."""
    if role == "backward":
        return 0
    if role != "forward":
        return None
    context = torch._guards.TracingContext.try_get()
    found = getattr(getattr(context, "fw_metadata", None), "num_forward", None)
    return found if isinstance(found, int) else None


def _key_and_cached(gm, example_inputs, config: Config, versions: str, use_cache: bool, timings: dict,
                    guards: SizeGuards | None) -> tuple:  # fmt: skip
    with stage("graph_key", timings):
        key = graph_cache.graph_key(gm, example_inputs, config.cache_key(), versions)
    if not use_cache:
        return key, None
    with stage("graph_cache_load", timings):
        return key, _load_cached(gm, key, config, guards)


def _compile_stages(gm, example_inputs: list[Any], config: Config, debug: DebugDump, timings: dict,
                    original: torch.fx.GraphModule | None = None,
                    record: GraphRecord | None = None, donated: tuple[str, ...] = ()) -> tuple:  # fmt: skip
    """Every stage, in order; returns the loaded wrapper, its source and a summary. The backend
    (Note: backends, backend.py) does what differs between C++ and Triton. `original`: the
    graph before the passes, which `config.verify` checks each call against. `record`: what a
    report keeps of the graph (Note: report records, debug/record.py), None without a report.
    `donated`: the inputs the graph may overwrite and free (Note: donated inputs, donation.py)."""
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
        graph.donated_inputs = {b.name for b in graph.inputs if b.name in donated}
        backend.prepare(graph, lowering, config)
    if debug.wants("ir.txt"):
        debug.write("ir.txt", describe_ir(graph))
    with stage("schedule", timings):
        scheduled = schedule(
            graph,
            fusion=config.fusion,
            blocks=backend.capabilities.blocks is not None,
            horizontal=config.horizontal_fusion,
            overlap=config.collective_overlap,
            in_flight=config.collectives_in_flight,
        )
        steps = scheduled.steps
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]  # (graph.inputs: the tensor ones)
        host_inputs = frozenset(b.name for b, x in zip(graph.inputs, tensors) if x.device != device)
        if backend.capabilities.blocks is not None:  # Triton kernels (Note: host scalars by value)
            on_cpu = frozenset(b.name for b, x in zip(graph.inputs, tensors) if x.device.type == "cpu")
            graph.scalar_inputs = scalar_inputs(graph, steps, on_cpu, config.cuda_graphs and device.type == "cuda")
    metrics.tally("schedule_work", vars(scheduled.work))
    origins = step_origins(gm, graph.holds, steps)
    fusion_report = describe_fusion(scheduled, origins)  # fusion.txt, and the explanation below
    debug.write("fusion.txt", fusion_report)
    if record is not None:
        debug.captured = {}  # the kernels' sources, for the report
    generated = backend.generate(graph, steps, config, debug, timings)
    labels = profiler_labels(steps, origins, {i: k.var for i, k in generated.binaries.items()})
    if record is not None:
        record.aten_graph, record.timings, record.device = gm.print_readable(print_output=False), timings, str(device)
        labels = record.record_steps(graph, scheduled, origins, generated.binaries, labels, debug.captured)
    with stage("wrapper", timings):
        wrapper = generate_wrapper(
            graph,
            steps,
            generated.binaries,
            device,
            host_inputs,
            config.huge_pages,
            config.buffer_pool_mb << 20,
            config.verify,
            labels,
            config.gpu_error_checks == "deferred",
            config.cuda_graphs and device.type == "cuda",
        )
        call, path = load_wrapper(wrapper, graph.constants, Path(config.cache_dir))
        if config.verify:  # Note: verifying a compiled graph
            original = original if original is not None else gm
            call = VerifiedGraph(call, original, graph, steps, generated.binaries, config.strict)
    debug.write("wrapper.py", wrapper.source)
    if record is not None:
        record.planned_peak_bytes, record.fallback_ops = wrapper.peak_bytes, list(lowering.fallback_ops)
    explanation = (
        f"=== graph with inputs {[b.name for b in graph.inputs]}\n{fusion_report}"
        f"planned peak memory of intermediates: {wrapper.peak_bytes} bytes\n\n"
    )
    summary = graph_cache.GraphSummary(
        kernels=generated.kernels, fusions=scheduled.fusions, refusals=len(scheduled.refusals),
        extern_calls=sum(1 for s in steps if not isinstance(s, KernelStep)),
        reduce_loops=generated.reduce_loops, fallback_ops=list(lowering.fallback_ops), explanation=explanation,
        tiled_kernels=generated.tiled_kernels, row_kernels=generated.row_kernels,
        mutated_inputs=mutated_inputs(graph, steps),
        inputs_written_in_place=len(graph.mutated_inputs),
        inplace_writes=sum(len(b.inplace) for b in generated.binaries.values()),
        donated_inputs_overwritten=sum(v in graph.donated_inputs for b in generated.binaries.values()
                                       for v in b.inplace.values()),
        collectives=len(scheduled.overlaps), overlapped_kernels=sum(o.kernels for o in scheduled.overlaps),
        collectives_in_flight=most_in_flight(scheduled.overlaps, len(steps)),
        kernel_bytes=sum(kernel_bytes(graph, s) for s in steps if isinstance(s, KernelStep)),
        horizontal_groups=scheduled.horizontal_groups, horizontal_parts=scheduled.horizontal_parts,
        scalar_inputs=len(graph.scalar_inputs),
    )  # fmt: skip
    call = record.in_profiler_range(call) if record is not None else call
    return _finish(call, path, summary), wrapper.source, wrapper.objects, summary


def donated_inputs(gm: torch.fx.GraphModule, config: Config) -> tuple[str, ...]:
    """The inputs this graph may overwrite (Note: donated inputs, donation.py). None under
    `config.verify` (which runs the graph eagerly on the same inputs) or CUDA
    graphs (whose recordings read the inputs where they lie, and write only the ones they know)."""
    if config.verify or config.cuda_graphs:
        return ()
    return tuple(gm.meta.get(DONATED_INPUTS, ()))


def _load_cached(gm: torch.fx.GraphModule, key: str, config: Config, guards: SizeGuards | None) -> Callable | None:
    """The graph of `key` from the cache, or None. Any failure while loading it (a damaged or
    foreign entry, a kernel that is gone or fails its checksum) discards the entry and the
    graph is compiled again (Note: cache safety). A graph compiled under guards on its sizes is
    served only where they hold, and they are then asserted here (Note: guards a compile adds)."""
    cache_dir = Path(config.cache_dir)
    try:
        entry = graph_cache.load(cache_dir, key)
        if entry is None:
            return None
        source, objects, summary = entry
        if summary.size_guards and (guards is None or not guards.reassert(summary.size_guards)):
            return None  # compiled again; the store replaces the entry
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


def mutated_inputs(graph, steps: list) -> list[int]:
    """The positions of the inputs some step writes into (a CUDA graph must not copy them)."""
    written = {name for step in steps
               for name in (step.writes if isinstance(step, KernelStep) else mutated_buffers(step))}  # fmt: skip
    written |= set(graph.mutated_inputs)  # stored in place by kernels (Note: inputs written in place)
    return [i for i, b in enumerate(graph.inputs) if b.name in written]


def kernel_bytes(graph, step: KernelStep) -> int:
    """What one kernel reads and writes, in bytes (ember.metrics.kernel_bytes): a horizontal
    kernel's parts each read their own (Note: horizontal fusion, schedule/horizontal.py)."""
    if step.parts:
        return sum(kernel_bytes(graph, part) for part in step.parts)
    return int(size_hint(buffer_bytes(graph, (*step.reads, *step.writes))))


def log_stages(timings: dict[str, float]) -> None:
    """One `logging` record per stage (logger "ember", DEBUG), with its seconds."""
    for name, seconds in timings.items():
        logger.debug("stage %s: %.3f s", name, seconds)


def _record(summary, timings: dict[str, float]) -> None:
    metrics.add(
        graphs_compiled=1,
        kernels_generated=summary.kernels,
        tiled_kernels=summary.tiled_kernels,
        row_kernels=summary.row_kernels,
        inputs_written_in_place=summary.inputs_written_in_place,
        kernel_bytes=summary.kernel_bytes,
        inplace_writes=summary.inplace_writes,
        donated_inputs_overwritten=summary.donated_inputs_overwritten,
        fusions=summary.fusions,
        fusion_refusals=summary.refusals,
        extern_calls=summary.extern_calls,
        reduce_loops=summary.reduce_loops,
        fallback_calls=len(summary.fallback_ops),
        collective_calls=summary.collectives,
        collective_overlap_kernels=summary.overlapped_kernels,
        horizontal_groups=summary.horizontal_groups,
        horizontal_kernels_saved=summary.horizontal_parts - summary.horizontal_groups,
        scalar_inputs_by_value=summary.scalar_inputs,
    )
    metrics.raise_to(collectives_most_in_flight=summary.collectives_in_flight)
    metrics.tally("compile_seconds", timings)
    metrics.tally("fallback_ops", Counter(summary.fallback_ops))
    metrics.tally("pass_rewrites", summary.pass_rewrites)


def _log_summary(summary, role: str, key: str) -> None:
    """What this graph became, through `logging` (logger `ember`): one INFO line naming its
    fallback ops (correct, only slower, so not a warning), the fusion report at DEBUG."""
    fallbacks = ", ".join(f"{op} x{n}" for op, n in Counter(summary.fallback_ops).items())
    counts = (summary.kernels, summary.fusions, summary.refusals, summary.extern_calls)
    logger.info("%s graph %s: %d kernels, %d fusions (%d refused), %d extern calls%s", role, key[:8], *counts,
                f"; fallbacks: {fallbacks}" if fallbacks else "")  # fmt: skip
    logger.debug("%s graph %s:\n%s", role, key[:8], summary.explanation)


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
