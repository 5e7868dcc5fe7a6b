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
from ember.uop.variables import size_hint

aten = torch.ops.aten


def cpu_convolution_2d(node: torch.fx.Node) -> bool:
    """A CPU float32 2-d convolution, not transposed."""
    if node.op != "call_function" or node.target is not aten.convolution.default:
        return False
    x, out = node.args[0].meta.get("val"), node.meta.get("val")  # type: ignore[union-attr]
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or node.args[6]:
        return False
    return x.dim() == 4 and x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() > 0


def wants_channels_last(node: torch.fx.Node) -> bool:
    """A CPU float32 2-d convolution whose input is not NHWC yet."""
    return cpu_convolution_2d(node) and not node.args[0].meta["val"].is_contiguous(memory_format=torch.channels_last)  # type: ignore[union-attr]


# Note: convolutions that stay NCHW
# Where a convolution's weight is much larger than its output (a late stage of a convnet at a
# small batch), aten's NCHW convolution with the OIHW weight, eager's path, beats oneDNN's on
# NHWC even given an OHWI weight, before the copy into OHWI. ResNet-50 at batch 1, one thread
# (each convolution alone, median of 20; torch 2.13): 512 -> 2048 1 x 1 on 7 x 7, 1.43 ms NCHW
# against 2.33 NHWC; 1024 -> 2048 1 x 1 stride 2 on 14 x 14, 2.90 against 7.85; 512 -> 512 3 x 3
# on 7 x 7, 2.90 against 3.77 and a 1.70 ms weight copy; 1024 -> 256 1 x 1 on 14 x 14 (weight 5
# times the output), 1.09 against 1.19. Where the output is the larger the early stages go the
# other way (256 -> 128 1 x 1 on 56 x 56: 2.20 against 1.87), and near equal sizes they tie
# (128 -> 128 3 x 3 on 28 x 28, weight 1.5 times the output: 2.09 against 2.08 and a copy).
# Over ResNet-50's 53 convolutions: all NCHW 87.3 ms, all NHWC with OHWI weights 108.4, each
# the faster way 85.2. So a convolution whose weight has WEIGHT_BOUND_ELEMENTS elements or more
# and WEIGHT_BOUND_RATIO times its output's reads NCHW: a contiguous copy of its input where
# that is NHWC (fused into the kernel writing it), its weight as it is, and no oneDNN rewrite
# (mkldnn.py takes NHWC convolutions only). A symbolic output is weighed at its example's size.
# Only the graph's last convolutions keep NCHW, those after every one that is not weight-bound:
# one change of layout, where a convnet's late stages begin. Chosen one by one, EfficientNet-B0's
# 1 x 1 projections (NCHW) and expansions (NHWC) took turns, every block copying its activations
# back and forth and adding residuals across layouts: 0.81 of eager's time became 1.05.
WEIGHT_BOUND_ELEMENTS = 1 << 17
WEIGHT_BOUND_RATIO = 4


def nchw_tail(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The convolutions that keep NCHW (Note: convolutions that stay NCHW): the weight-bound ones
    after the graph's last convolution that is not."""
    convolutions = [n for n in graph.nodes if cpu_convolution_2d(n)]
    bound = [weight_bound(c) for c in convolutions]
    start = max((i + 1 for i, b in enumerate(bound) if not b), default=0)
    return set(convolutions[start:])


def weight_bound(conv: torch.fx.Node) -> bool:
    """The convolution keeps NCHW (Note: convolutions that stay NCHW)."""
    weight = conv.args[1].meta.get("val")  # type: ignore[union-attr]
    if not isinstance(weight, torch.Tensor):
        return False
    elements = weight.numel()
    return elements >= WEIGHT_BOUND_ELEMENTS and elements >= WEIGHT_BOUND_RATIO * size_hint(conv.meta["val"].numel())


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
    tail = nchw_tail(graph)
    convolutions = [n for n in graph.nodes if wants_channels_last(n) and n not in tail]
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
    contiguous = _nchw_inputs(graph, tail)
    if not _restore_output_layouts(graph, before):
        for request in [*requests.values(), *contiguous]:
            request.replace_all_uses_with(request.args[0])  # type: ignore[arg-type]
            graph.erase_node(request)
        meta.repropagate(graph, set(convolutions))
        return 0
    return len(convolutions)


def _nchw_inputs(graph: torch.fx.Graph, tail: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """A convolution that stays NCHW (`tail`, Note: convolutions that stay NCHW) reading
    activations that became NHWC upstream reads a contiguous copy of them instead; the copies made."""
    copies = []
    for conv in [n for n in graph.nodes if n in tail]:
        x = conv.args[0]
        if x.meta["val"].is_contiguous():  # type: ignore[union-attr]
            continue
        with graph.inserting_before(conv):
            copy = graph.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
        conv.update_arg(0, copy)
        copies.append(copy)
    if copies:
        meta.repropagate(graph, set(copies))
    return copies


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
