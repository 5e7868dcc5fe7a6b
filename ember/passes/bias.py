"""Bias adds that a library would make a pass of its own, written into ember's kernels instead.

Where every reader of a product or a convolution is an ember kernel (through views), that kernel
reads the result anyway and adds the bias as it loads it:

  addmm(b, x, y)                -> mm(x, y) + b
  convolution(x, w, b, ...)     -> convolution(x, w, None, ...) + b viewed along the channels (CUDA)

Note: bias in ember's kernels. Why each library's bias costs:
  - MKL's addmm (CPU) first copies the bias into its result, a pass of its own (Note: which
    library multiplies, mkldnn.py). Measured for pointwise readers, so on the CPU only those
    count (an activation, a residual add, a layer scale).
  - cuBLAS's addmm takes bias-epilogue kernels that are slower than its plain mm at transformer
    shapes (H100, float32, 4096 x 768 x 768 and x 3072: BERT-base's and ViT-base's projections
    ran on 64 x 64 tiles as addmm, on 128 x 128 tiles as mm; their GEMMs took 5% longer).
  - cuDNN's convolution adds its bias with an elementwise kernel after the convolution: a
    read and a write of the whole output.
On the GPU any ember kernel may take the add: a reduction (a layer norm's statistics) reads the
result as a pointwise op does. A reader ember lowers may still end up an extern (a lowering that
declines a call): the add is then a kernel of its own, the pass the library would have made.
Views, a split's pieces included, are looked through: GPT-2's query/key/value product, split
and read by attention, keeps its addmm. Measured on an H100 (benchmarks.run --suite real
--device cuda --batch-scale 4, float32): BERT-base 20.64 -> 19.59 ms, ViT-base 32.92 -> 31.77,
ConvNeXt-tiny 12.53 -> 12.08, GPT-2 small 25.46 -> 25.09 (inductor: 19.29-19.55, 31.35-31.72,
11.45-11.98, 24.86-24.93; two processes, so within about 1%).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx

from ember.passes import meta
from ember.passes.matcher import FxPat, FxPatternMatcher
from ember.passes.noops import VIEWS

aten = torch.ops.aten


def read_by_kernels_only(node: torch.fx.Node, reductions: bool = False) -> bool:
    """Whether every reader of `node`, directly or through views, is an op an ember kernel computes
    with `node`'s value read in (never an extern kernel, never the graph's output): a pointwise op,
    or with `reductions` any op ember lowers itself into a kernel."""
    views = VIEWS if not reductions else _lowered_views()
    for user in node.users:
        if user.op != "call_function":
            return False
        if user.target in views:
            if not read_by_kernels_only(user, reductions):
                return False
        elif torch.Tag.pointwise not in getattr(user.target, "tags", ()) and not (reductions and _lowered(user)):
            return False
    return bool(node.users)


@functools.cache
def _lowered_views() -> frozenset:
    """Every op lowering reads as a view of its input (a split's pieces and the getitems that pick
    them included): their readers decide, not they."""
    from ember.lower.graph import MULTI_VIEW_OPS, VIEW_OPS  # (lowering imports the passes)

    return frozenset((*VIEWS, *VIEW_OPS, *MULTI_VIEW_OPS, operator.getitem))


def _lowered(node: torch.fx.Node) -> bool:
    """ember lowers `node`'s op into its own kernels (the lowering table: lower/registry.py)."""
    import ember.lower  # noqa: F401  (registers every lowering)
    from ember.lower.registry import EXTERN_BY_DESIGN, lookup

    packet = getattr(node.target, "overloadpacket", None)
    return lookup(node.target) is not None and packet not in EXTERN_BY_DESIGN


def _on(device: str, *nodes: Any, dtypes: tuple = (torch.float32, torch.float16, torch.bfloat16)) -> bool:
    """Every one of `nodes` is a tensor on `device` of one of `dtypes`."""
    for node in nodes:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dtype not in dtypes or value.device.type != device:
            return False
    return True


def matmul_bias(graph: torch.fx.Graph, node: torch.fx.Node, b: Any, x: Any, y: Any) -> torch.fx.Node | None:
    """addmm(b, x, y) -> mm(x, y) + b (plain alpha and beta, a 1-d bias) where ember's kernels read
    the product: on the CPU in float32 with pointwise readers, on the GPU in float32 with any
    kernel's. Not in float16 or bfloat16: the product would be rounded to 8 or 11 bits before the
    bias is added, where addmm rounds once (float32 rounds the product to 24 bits, as close as
    cuBLAS's epilogue gets)."""
    if node.kwargs or not isinstance(b, torch.fx.Node) or b.meta["val"].dim() != 1:
        return None
    if meta.cpu_float32(node, b, x, y):
        if not read_by_kernels_only(node):
            return None
    elif not _on("cuda", node, b, x, y, dtypes=(torch.float32,)) or not read_by_kernels_only(node, reductions=True):
        return None
    product = meta.call(graph, aten.mm.default, (x, y))
    return meta.call(graph, aten.add.Tensor, (product, b), like=node.meta["val"])


def convolution_bias(graph: torch.fx.Graph, node: torch.fx.Node, x: Any, w: Any, b: Any, rest: Any
                     ) -> torch.fx.Node | None:  # fmt: skip
    """convolution(x, w, b, ...) -> convolution(x, w, None, ...) + b along dim 1, on the GPU, where
    ember's kernels read the result. Any float dtype: eager's cuDNN path rounds the convolution
    before it adds the bias too."""
    if b is None or node.kwargs or not _on("cuda", node, x, w, b) or b.meta["val"].dim() != 1:
        return None
    if not read_by_kernels_only(node, reductions=True):
        return None
    out = node.meta["val"]
    plain = meta.call(graph, aten.convolution.default, (x, w, None, *rest))
    if plain.meta["val"].stride() != out.stride():  # another layout without the bias: keep the traced call
        graph.erase_node(plain)
        return None
    channels = meta.call(graph, aten.view.default, (b, [1, out.shape[1]] + [1] * (out.dim() - 2)))
    return meta.call(graph, aten.add.Tensor, (plain, channels), like=out)


_b, _x, _y = FxPat.var("b"), FxPat.var("x"), FxPat.var("y")
pm_bias_in_kernels = FxPatternMatcher([
    (FxPat(aten.addmm.default, _b, _x, _y), matmul_bias),  # addmm(b, x, y) -> mm(x, y) + b
])  # fmt: skip


def unfuse_convolution_biases(graph: torch.fx.Graph) -> int:
    """Each GPU convolution whose bias ember's kernels can add (`convolution_bias`); returns how many."""
    rewritten = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is aten.convolution.default]:
        x, w, b, *rest = node.args
        with graph.inserting_before(node):
            new = convolution_bias(graph, node, x, w, b, rest)
        if new is not None:
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            rewritten += 1
    return rewritten
