"""Stage `passes`: FX graph passes on the aten graph, before lowering (as TorchInductor's).

Takes the functional aten graph AOTAutograd produced and rewrites a copy of it (a failed
compile runs the original eagerly); lowering sees the result. The steps, in order:

  pre_passes     the user's callables (config), each given the torch.fx.Graph
  noops          x+0, x*1, same-dtype conversions, views that end where they began (noops.py)
  attention      softmax(q @ k^T * c) @ v written out -> one flash-attention call (attention.py)
  grouped_query_attention
                 flash attention over k/v heads repeated for GQA reads the shared heads (attention.py)
  cse            equal pure calls (a per-layer copy of one attention bias) -> one call (cse.py);
                 after attention, whose patterns ask for values with one reader
  channels_last  2-d convolutions read NHWC activations (layout.py)
  vector_matmul  a float32 linear of one static row (decode) -> sum(w * x, 1) (vector_matmul.py)
  mkldnn         linear / convolution + bias + activation as one oneDNN call where that fuses a
                 pass (mkldnn.py)
  bias           an addmm left, or a GPU convolution, whose readers are ember kernels -> the
                 product or convolution without its bias, + the bias in those kernels (bias.py)
  dce            calls whose results nobody uses (mutations and random ops stay)
  post_passes    the user's callables, after ember's own

A user pass that adds nodes gives them `node.meta["val"]` (a fake tensor, as AOTAutograd's
nodes have; `ember.passes.meta.call` builds a node with it): lowering reads it. Each ember
pass counts what it rewrote in `metrics.pass_rewrites[name]`. `config.passes`
(EMBER_PASSES=0) turns ember's own passes off; the user's hooks always run. With hooks the
graph cache is keyed by the graph after the passes, so a changed hook never serves a stale
graph (compile_graph.py, Note: the graph cache key and the passes).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from ember.config import Config
from ember.errors import EmberError
from ember.passes import attention, bias, cse, layout, mkldnn, noops, vector_matmul
from ember.passes.eager_memory import INPUTS_HELD


def run_passes(gm: torch.fx.GraphModule, config: Config) -> tuple[torch.fx.GraphModule, Counter]:
    """A rewritten copy of `gm` (the original stays intact for the eager fallback) and what
    each pass rewrote (pass name -> count)."""
    graph = copy.deepcopy(gm.graph)  # copies nodes; shares constants and meta values
    graph.owning_module = gm  # constants (get_attr) resolve against the original meanwhile
    rewrites: Counter = Counter()
    run_user_passes("pre_passes", config.pre_passes, graph)
    if config.passes:
        rewrites["noops"] += noops.remove_noops(graph)
        rewrites["attention"] += attention.pm_flash_attention.apply(graph)
        rewrites["grouped_query_attention"] += attention.pm_grouped_query_attention.apply(graph)
        rewrites["cse"] += cse.eliminate_common_subexpressions(graph)
        if config.conv_channels_last:
            rewrites["channels_last"] += layout.channels_last_convolutions(graph)
        onednn = config.mkldnn_fusion and mkldnn.applicable()
        if onednn:  # on eager's graph, before vector_matmul (whose products are never materialized)
            mkldnn.annotate_headroom(graph, gm.meta.get(INPUTS_HELD, False), config.onednn_slack_kb * 1024)
        if config.vector_matmul:
            rewrites["vector_matmul"] += vector_matmul.pm_vector_matmul.apply(graph)
        if onednn:
            timed_in = config.cache_dir if config.matmul_timing else None  # Note: timed matmul libraries
            rewrites["mkldnn_linear"] += mkldnn.pm_mkldnn_linear(config.mkldnn_relu, timed_in).apply(graph)
            if config.mkldnn_relu:
                rewrites["mkldnn_linear"] += mkldnn.pm_mkldnn_linear_relu.apply(graph)
            rewrites["mkldnn_convolution"] += mkldnn.fold_convolution_epilogues(graph, relu=config.mkldnn_relu)
        rewrites["matmul_bias"] += bias.pm_bias_in_kernels.apply(graph)  # after oneDNN took its linears
        rewrites["convolution_bias"] += bias.unfuse_convolution_biases(graph)
        rewrites["dce"] += eliminate_dead_code(graph)
    run_user_passes("post_passes", config.post_passes, graph)
    # lazy: its Python code is generated only if something calls it (lowering reads the graph)
    after = _LazyGraphModule(gm, graph)
    after.meta.update(gm.meta)  # what the frontend marked (lower/graph.py SAVED_OUTPUTS) goes on to lowering
    return after, +rewrites


def eliminate_dead_code(graph: torch.fx.Graph) -> int:
    """torch.fx's DCE (it keeps impure calls: mutations, random ops); returns calls removed."""
    before = len(graph.nodes)
    graph.eliminate_dead_code()
    return before - len(graph.nodes)


def run_user_passes(option: str, hooks: tuple[Callable, ...], graph: torch.fx.Graph) -> None:
    """Call each hook with the graph; an exception, or a graph left broken, names the hook."""
    for i, hook in enumerate(hooks):
        name = f"{option}[{i}] ({getattr(hook, '__qualname__', repr(hook))})"
        try:
            hook(graph)
        except Exception as e:
            raise EmberError("passes", f"the user pass {name} raised {type(e).__name__}: {e}") from e
        try:
            graph.lint()
        except Exception as e:
            raise EmberError("passes", f"the user pass {name} left an invalid graph: {e}") from e
