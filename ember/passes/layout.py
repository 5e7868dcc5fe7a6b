"""Channels-last convolutions: 2-d convolutions read NHWC activations.

oneDNN's convolutions are fastest on channels-last (NHWC) activations, and given one they
return one, so a chain conv -> pointwise -> conv stays NHWC end to end: the pointwise
kernel between them reads NHWC and writes NHWC (lowering realizes a clone's memory format,
lower/pointwise.py), and only the graph's input pays one transposing copy. Measured on the
convnet workload (README of benchmarks): conv externs ~15-30% faster.

The pass asks for the layout with `clone(x, memory_format=channels_last)` before each
convolution's input, then recomputes every node's fake metadata (strides change downstream).
A weight with a spatial kernel (3 x 3, 7 x 7) is asked for channels-last (OHWI) too: given
NHWC activations and a plain OIHW weight, oneDNN reorders the weight inside every call, at
about the cost of a second convolution (Note: channels-last weights).
A graph output keeps its layout: one output that became NHWC is copied back (the copy fuses
into the kernel computing it, when one does); more than one (a training forward saving
activations, whose layouts the backward graph was traced with) makes the pass undo itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ember.passes import meta

aten = torch.ops.aten


def wants_channels_last(node: torch.fx.Node) -> bool:
    """A CPU float32 2-d convolution (not transposed) whose input is not NHWC yet."""
    if node.op != "call_function" or node.target is not aten.convolution.default:
        return False
    x, out = node.args[0].meta.get("val"), node.meta.get("val")  # type: ignore[union-attr]
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or node.args[6]:
        return False
    if x.dim() != 4 or x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0:
        return False
    return not x.is_contiguous(memory_format=torch.channels_last)


# Note: channels-last weights
# oneDNN's convolution on NHWC activations wants its weight as OHWI. Given a plain OIHW weight
# it reorders it inside the call, slowly: one thread, batch 1, a 256 -> 256 3 x 3 convolution
# on 14 x 14 takes 2.17 ms with the OIHW weight and 1.27 ms with an OHWI one; 512 -> 512 on
# 7 x 7, 4.23 against 2.04; at batch 8, 19.7 against 11.4 (oneDNN 3.x, torch 2.13). ember's
# own copy into OHWI is one pass over the weight (and carries a folded BatchNorm's scale for
# free, mkldnn.py). A 1 x 1 kernel's OIHW weight is OHWI already; so is a depthwise one's.


def wants_channels_last_weight(conv: torch.fx.Node) -> bool:
    """The convolution's weight is a 4-d float32 tensor with a spatial kernel, not OHWI yet."""
    w = conv.args[1].meta.get("val")  # type: ignore[union-attr]
    if not isinstance(w, torch.Tensor) or w.dim() != 4 or w.dtype != torch.float32 or w.numel() == 0:
        return False
    return not w.is_contiguous(memory_format=torch.channels_last)


def channels_last_convolutions(graph: torch.fx.Graph) -> int:
    """Returns how many convolutions now read NHWC input (and an OHWI weight, Note:
    channels-last weights)."""
    convolutions = [n for n in graph.nodes if wants_channels_last(n)]
    if not convolutions:
        return 0
    before = _outputs(graph)
    requests: dict[torch.fx.Node, torch.fx.Node] = {}  # source -> its one NHWC copy, whatever reads it
    for conv in convolutions:
        for position in (0, 1) if wants_channels_last_weight(conv) else (0,):
            source = conv.args[position]
            if source not in requests:  # copied just before its first reader: a weight's copy lives no longer
                with graph.inserting_before(conv):
                    requests[source] = graph.call_function(aten.clone.default, (source,),  # type: ignore[arg-type]
                                                           {"memory_format": torch.channels_last})  # fmt: skip
            conv.update_arg(position, requests[source])
    meta.repropagate(graph, set(requests.values()))
    _drop_copies_of_nhwc_values(graph, requests)
    if not _restore_output_layouts(graph, before):
        for request in requests.values():
            request.replace_all_uses_with(request.args[0])  # type: ignore[arg-type]
            graph.erase_node(request)
        meta.repropagate(graph, set(convolutions))
        return 0
    return len(convolutions)


def _drop_copies_of_nhwc_values(graph: torch.fx.Graph, requests: dict[torch.fx.Node, torch.fx.Node]) -> None:
    """A requested copy whose source became NHWC itself once the layouts spread (a pooling of
    NHWC activations, which eager returns NHWC) is no copy at all: the convolution reads the source."""
    for source, request in list(requests.items()):
        if meta.same_layout(source.meta.get("val"), request.meta.get("val")):
            request.replace_all_uses_with(source)
            graph.erase_node(request)
            del requests[source]


def _outputs(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, Any]]:
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    return [(n, n.meta.get("val")) for n in output.all_input_nodes]


def _restore_output_layouts(graph: torch.fx.Graph, before: list[tuple[torch.fx.Node, Any]]) -> bool:
    """One graph output that became NHWC gets a copy back to its contiguous layout (lowering
    fuses it into the kernel computing the output, when one does). More than one (a training
    forward saving activations, whose layouts the backward graph was traced with), or a layout
    other than contiguous: False, the pass is undone."""
    changed = [(node, old) for node, old in before if not meta.same_layout(node.meta.get("val"), old)
               and isinstance(old, torch.Tensor)]  # fmt: skip
    if len(changed) > 1 or any(not old.is_contiguous() for _, old in changed):
        return False
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for node, _ in changed:
        with graph.inserting_before(output):
            restored = meta.call(graph, aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
        output.replace_input_with(node, restored)
    return True
