"""Stage `passes` (CPU): one row times a weight matrix, a decode step's linear, as an ember reduction.

Note: a vector times a matrix
    A language model's decode step at batch 1 multiplies a single row by every weight matrix.
    Each weight element is read once for one multiply-add, so the product runs at the speed the
    matrix streams from memory, and a model's weights (GPT-2 small's 500 MB) come from DRAM.
    On an AMD EPYC (2 threads, a 1 GiB sum at 47 GB/s), GPT-2's 50257 x 768 LM head, weights
    rotated among copies so they come from DRAM (whole models: benchmarks/decode.py):
      - aten's mm (MKL's sgemv): 8.6 ms, 18 GB/s;
      - oneDNN's linear: 3.6 ms, and it takes its scratchpad, which where the product is the
        graph's peak does not fit (Note: oneDNN's scratchpad, mkldnn.py);
      - ember's row reduction sum(w * x, 1) of the (out, in) weight: 3.2 ms, 48 GB/s, no
        scratchpad, and the bias and what reads the product fuse into its kernel.
    So mm(x, w.t()), and addmm with a bias, on a CPU float32 x of one static row and a row-major
    (out, in) weight w of MIN_OUT_FEATURES outputs or more becomes sum(w * x, 1) (+ b), viewed as
    the (1, out) product. Both sum
    each output's K products in float32; the reduction's blocked sums (Note: float32 sums)
    round no worse than BLAS's dot products. A weight stored (in, out) (GPT-2's Conv1D) makes
    a column reduction, which ember's kernels stream far worse (14.6 ms at that shape against
    oneDNN's 3.4): those stay with the linear rules (mkldnn.py), as do products of more rows,
    where the weight is reused from cache and BLAS's blocking wins.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ember.passes import meta, mkldnn
from ember.passes.matcher import FxPat, FxPatternMatcher

aten = torch.ops.aten

MIN_MACS = 1 << 16  # below, one extern call costs about what the kernel would (and nothing streams)
# the reduction's threads split the outputs (each sums its rows whole): fewer outputs than this
# would leave a large machine's threads idle, where BLAS also splits the depth
MIN_OUT_FEATURES = 256


def vector_times_matrix(graph: torch.fx.Graph, node: torch.fx.Node, x: torch.fx.Node, w: torch.fx.Node,
                        b: Any = None) -> torch.fx.Node | None:  # fmt: skip
    """x @ w.t() (+ b) -> sum(w * x, 1) (+ b) viewed (1, out), for one row x (Note: a vector
    times a matrix)."""
    if node.kwargs or not _one_row_product(node, x, w, b):
        return None
    out_features, in_features = w.meta["val"].shape
    products = meta.call(graph, aten.mul.Tensor, (w, x))  # (out, in): x's one row broadcast over w's rows
    summed = meta.call(graph, aten.sum.dim_IntList, (products, [1]))
    if b is not None:
        summed = meta.call(graph, aten.add.Tensor, (summed, b))
    return meta.call(graph, aten.view.default, (summed, [1, out_features]), like=node.meta["val"])


def _one_row_product(node: torch.fx.Node, x: torch.fx.Node, w: torch.fx.Node, b: Any) -> bool:
    if not meta.cpu_float32(node, x, w, *([b] if b is not None else [])):
        return False
    out, x_value, weight = node.meta["val"], x.meta["val"], w.meta["val"]
    if weight.dim() != 2 or not weight.is_contiguous() or x_value.dim() != 2 or out.dim() != 2:
        return False
    if not all(isinstance(s, int) for s in (*x_value.shape, *weight.shape)):
        return False  # symbolic sizes: a row count that may grow (a prompt), decided per call elsewhere
    if x_value.shape[0] != 1 or x_value.stride(1) != 1 or not out.is_contiguous():
        return False
    if b is not None and tuple(b.meta["val"].shape) != (weight.shape[0],):
        return False
    return weight.shape[0] >= MIN_OUT_FEATURES and weight.shape[0] * weight.shape[1] >= MIN_MACS


# the linear rules' patterns (mkldnn.py): x, b and w.t()
pm_vector_matmul = FxPatternMatcher([
    (FxPat(aten.mm.default, mkldnn.x, mkldnn.weight_t), vector_times_matrix),            # mm(x, w.t()), x one row
    (FxPat(aten.addmm.default, mkldnn.b, mkldnn.x, mkldnn.weight_t), vector_times_matrix),  # addmm(b, x, w.t())
])  # fmt: skip
