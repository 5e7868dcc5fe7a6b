"""Frontend: the `torch.compile` backend and `ember.compile`.

Dynamo captures an FX graph; AOTAutograd (with ember's decomposition table) turns it into
functional aten graphs for forward and backward; each goes to `compile_graph`. When a graph
fails to compile, ember warns once, names the stage and op, and runs that graph eagerly —
unless `strict` (EMBER_STRICT=1), which raises.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import RestartAnalysis
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.utils._pytree import tree_flatten

from ember import config as config_module
from ember.collector import collection_paused
from ember.compile_graph import compile_graph
from ember.compile_symbolic import compile_symbolic, record_fallback
from ember.data_dependent import data_dependent_size
from ember.donation import mark_donated_inputs
from ember.errors import EmberError, warn_running_eagerly
from ember.frame_chunks import call_with_frame_room
from ember.lower.decompositions import corrected_autograd_kernels, decomposition_table
from ember.lower.graph import SAVED_OUTPUTS
from ember.metrics import metrics
from ember.passes.eager_memory import INPUTS_HELD
from ember.shape_specialization import ShapeSpecializedGraph, is_symbolic

log = logging.getLogger("ember")


# Note: the partitioner
#   AOTAutograd traces a training graph's forward and backward as one joint graph and splits it.
#   Its default split saves every forward value the backward reads; the min-cut split (torch's,
#   as inductor uses) saves a smallest set and recomputes cheap pointwise values in the backward,
#   where ember fuses them into the kernels that read them. Same results; a bf16 LLaMA (2 layers,
#   width 256, 4x128 tokens) saved 14.0 MiB for its backward instead of 22.6, a GPT-2 20.1 instead
#   of 34.9, with the same kernel counts. Random ops are never recomputed (torch's rule).
PARTITIONERS = {"min_cut": min_cut_rematerialization_partition, "default": default_partition}


def ember_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **options: Any) -> Callable:
    """The `torch.compile(..., backend="ember")` entry point. torch.compile passes its `mode` and
    `options` here: mode "reduce-overhead" turns CUDA graphs on; `options` are ember options."""
    options = {**(options.pop("options", None) or {}), **options}
    mode = options.pop("mode", None)
    if mode not in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        raise ValueError(f'unknown torch.compile mode {mode!r} for backend="ember"')
    if mode in ("reduce-overhead", "max-autotune"):  # as inductor's: both modes use CUDA graphs
        options.setdefault("cuda_graphs", True)
    config = config_module.load(**options)

    def compiler(role: str) -> Callable:  # the role names the graph's debug dump
        return functools.partial(compile_aot_graph, config=config, role=role)

    backend = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        partition_fn=PARTITIONERS[config.partitioner],
        decompositions=decomposition_table(config.fallback_random),
        # an inference graph's writes into its inputs stay in the graph as copy_, and its kernels
        # store there in place (Note: inputs written in place, lower/mutation.py)
        keep_inference_input_mutations=True,
    )
    start, ember_seconds = time.perf_counter(), metrics.compile_seconds.total()
    try:
        with corrected_autograd_kernels(), collection_paused():  # Note: no garbage collection while compiling
            # AOTAutograd's tracing and torch's partitioner (Note: frame stack chunks, frame_chunks.py)
            return call_with_frame_room(backend, gm, example_inputs)
    except RestartAnalysis:  # dynamo's control flow (e.g. float scalars made tensors): it traces again
        raise
    except Exception as e:
        # AOTAutograd itself failed (a torch limitation or bug, before any ember stage ran):
        # the user's code still runs, as with any graph ember cannot compile.
        if config.strict or isinstance(e, EmberError):
            raise
        return eager_fallback(gm, EmberError("frontend", f"AOTAutograd could not trace the graph: {e}"))
    finally:  # AOTAutograd's tracing and partitioning: the time not spent in ember's own stages
        inside = metrics.compile_seconds.total() - ember_seconds
        metrics.tally("compile_seconds", {"aot_autograd": time.perf_counter() - start - inside})


def compile_aot_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], config, role: str) -> Callable:
    """The compiler AOTAutograd calls: a backward learns here, while AOTAutograd's tracing context
    is its own, which of its inputs are donated (Note: donated inputs, donation.py)."""
    if role == "backward":
        mark_donated_inputs(gm, example_inputs)
    if role == "forward":
        mark_saved_outputs(gm)
    return compile_or_fallback(gm, example_inputs, config, role)


def mark_saved_outputs(gm: torch.fx.GraphModule) -> None:
    """Which of a forward's outputs its backward reads, from AOTAutograd's tracing context while it
    compiles: those after its first `num_forward` (the caller's outputs, mutated inputs, bases, RNG
    offsets). They must come back in eager's exact strides (Note: outputs in eager's layout); their
    node names are kept in `gm.meta[SAVED_OUTPUTS]` (part of the graph key). Absent where torch has
    no such field."""
    context = torch._guards.TracingContext.try_get()
    forward = getattr(getattr(context, "fw_metadata", None), "num_forward", None)
    if not isinstance(forward, int):
        return
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    saved = tree_flatten(output.args[0])[0][forward:]
    gm.meta[SAVED_OUTPUTS] = tuple(sorted({r.name for r in saved if isinstance(r, torch.fx.Node)}))


def compile_or_fallback(gm: torch.fx.GraphModule, example_inputs: list[Any], config, role: str = "graph") -> Callable:
    """`role`: forward, backward, inference, or graph (unknown). A forward's or an inference
    graph's caller holds every input through the call (passes/eager_memory.py INPUTS_HELD)."""
    if (refused := data_dependent_size(gm)) is not None:  # Note: data-dependent sizes
        error = EmberError("frontend", refused[1], op=refused[0])
        if config.strict:
            raise error
        return make_boxed_func(eager_fallback(gm, error))
    if is_symbolic(example_inputs):  # Note: symbolic sizes; else Note: dynamic shapes by specialization
        if role in ("forward", "inference"):
            gm.meta[INPUTS_HELD] = True
        with collection_paused():
            compiled = call_with_frame_room(compile_symbolic, gm, example_inputs, config, role)
        if not isinstance(compiled, str):
            return compiled
        record_fallback(compiled, role, config)
        static_compiler = functools.partial(compile_or_fallback, config=config, role=role)
        return ShapeSpecializedGraph(gm, static_compiler, config.shape_specializations, config.strict)
    if role in ("forward", "inference"):
        gm.meta[INPUTS_HELD] = True
    try:
        with collection_paused():  # a backward compiles at its first call, outside ember_backend
            return call_with_frame_room(compile_graph, gm, example_inputs, config, role)
    except Exception as e:
        if config.strict:
            raise
        return make_boxed_func(eager_fallback(gm, e))


def eager_fallback(gm: torch.fx.GraphModule, error: Exception) -> Callable:
    metrics.add(graphs_failed=1)
    log.info("graph runs eagerly: %s", error)  # the user also gets one warning, below
    warn_running_eagerly(error)
    return gm.forward


def compile(model: Callable, **options: Any) -> Callable:  # noqa: A001 - mirrors torch.compile
    """`torch.compile(model, backend="ember")` with ember options, e.g. `ember.compile(m, debug=True)`.
    Options are the fields of `ember.config.Config`; `dynamic` and `fullgraph` go to torch.compile."""
    torch_options = {k: options.pop(k) for k in ("dynamic", "fullgraph", "mode") if k in options}
    config_module.load(**options)  # reject unknown options now, not at the first call
    return torch.compile(model, backend=functools.partial(ember_backend, **options), **torch_options)
