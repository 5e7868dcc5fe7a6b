"""Column reductions (over an outer axis) against eager: the lane-accumulator code path
(Note: lane accumulators, codegen/lanes.py) over several shapes, strides and dtypes, with
NaN and inf, plus IR checks that the path is taken where it should be and only there."""

import math

import pytest
import torch

import ember
from ember.codegen.lanes import MAX_LANES
from ember.codegen.phases import full_rewrite
from ember.uop.dtypes import dtypes
from ember.uop.ops import BufferArg, Ops, RangeKind, UOp
from tests.helpers import check, test_device


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    flat = x.view(-1)
    flat[3] = math.nan
    flat[flat.numel() // 2] = math.inf
    flat[-2] = -math.inf
    return x


SHAPES = [(2048, 1024), (33, 7), (5, 4096), (3, MAX_LANES + 3), (1, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_column_sum_mean_and_extremes(shape):
    x = torch.randn(shape)
    check(lambda x: (x.sum(0), x.mean(0, keepdim=True), x.amax(0), x.amin(0)), x, rtol=1e-4, atol=1e-4)
    assert ember.metrics.fallback_calls == 0


@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_column_statistics_with_nan_and_inf(shape):
    x = _with_specials(torch.randn(shape))
    check(lambda x: (x.sum(0), x.amax(0), x.amin(0), x.argmax(0), x.argmin(0)), x)
    # var_mean's mean of a column holding inf is NaN unless the inf is its last element (eager's
    # CPU Welford, which ember's C++ kernels follow); Triton kernels give the mean's inf, so there
    # only a NaN is checked
    if test_device() != "cpu":
        x = torch.randn(shape)
        x.view(-1)[3] = math.nan
    check(lambda x: torch.var_mean(x, 0), x)
    assert ember.metrics.fallback_calls == 0


def test_column_sum_is_one_kernel():
    check(lambda x: x.sum(0), torch.randn(2048, 1024), rtol=1e-4, atol=1e-4)
    # on the GPU, 2M elements summed across rows split: partials, then their sums (Note: split reductions)
    assert ember.metrics.kernels_generated == (1 if test_device() == "cpu" else 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.bool])
def test_column_reductions_of_other_dtypes(dtype):
    x = (torch.randn(64, 48) * 10).to(dtype)
    if dtype is torch.bool:
        check(lambda x: (x.sum(0), x.any(0), x.all(0)), x)
    else:
        check(lambda x: (x.sum(0), x.amax(0), x.amin(0), x.prod(0)), x)
    assert ember.metrics.fallback_calls == 0


def test_middle_axis_and_strided_inputs():
    base = _with_specials(torch.randn(6, 50, 40))
    check(lambda x: (x.sum(1), x.amax(1), x.argmin(1)), base, rtol=1e-4)
    check(lambda x: torch.var_mean(x, 1, keepdim=True), torch.randn(6, 50, 40), rtol=1e-4)
    check(lambda x: (x.sum(0), x.amin(0)), torch.randn(64, 96)[:, ::2])  # strided lanes
    check(lambda x: (x.sum(0), x.amax(0)), torch.randn(40, 64).t())  # the reduce axis is contiguous
    check(lambda x: x.sum(0), torch.randn(1, 64).expand(128, 64))  # broadcast rows
    assert ember.metrics.fallback_calls == 0


def shared_norm_weight_grads(a, rows, b):
    """A layer norm weight's gradient summed over two layers that share it (ALBERT): one sum has
    lane accumulators, the other reads `rows` (broadcast along the lanes) and stays scalar, inside
    the output's loop (Note: reductions before the loops that read them)."""
    return (a * rows).sum((0, 1)) + b.sum((0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 16, 64), (4, 8, 32), (3, 5, 7)], ids=str)
def test_scalar_and_lane_reductions_in_one_kernel(shape, dtype):
    a, b = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    check(shared_norm_weight_grads, a, torch.randn(*shape[:-1], 1, dtype=dtype), b, rtol=1e-4, atol=1e-4)
    check(shared_norm_weight_grads, a.transpose(0, 1), torch.randn(shape[1], shape[0], 1, dtype=dtype),
          b[:, :, :], rtol=1e-4, atol=1e-4)  # fmt: skip
    assert ember.metrics.graphs_failed == 0 and ember.metrics.fallback_calls == 0


def test_fused_column_normalization():
    x = _with_specials(torch.randn(300, 20))
    check(lambda x: (torch.softmax(x, 0), x - x.mean(0), torch.nn.functional.normalize(x, dim=0)), x, rtol=1e-4)
    assert ember.metrics.fallback_calls == 0


# ---- IR: which reductions get lane accumulators --------------------------------------


def _sum_kernel(
    rows: int, cols: int, row_stride: int, col_stride: int, max_lanes: int = MAX_LANES, scaled: bool = False
) -> list[UOp]:
    """out[c] = sum_r x[r * row_stride + c * col_stride] (* w[c] if scaled), lowered: its DEFINE_ACCs."""
    x = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg("p1", rows * cols))
    out = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg("p0", cols))
    c, r = UOp.range(cols, 0), UOp.range(rows, 1, RangeKind.REDUCE)
    index = r * UOp.const(dtypes.index, row_stride) + c * UOp.const(dtypes.index, col_stride)
    load = UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, dtypes.float32, (x, index)),))
    for i in range(3 if scaled else 0):  # per-column parameters, contiguous in c but not streamed
        w = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg(f"p{2 + i}", cols))
        load = load * UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, dtypes.float32, (w, c)),))
    value = UOp(Ops.REDUCE, dtypes.float32, (load, r), Ops.ADD)
    sink = UOp(Ops.SINK, dtypes.void, (UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, dtypes.float32, (out, c)), value)),))
    return [u for u in full_rewrite(sink, max_lanes).toposort if u.op is Ops.DEFINE_ACC]


def test_lanes_only_where_the_output_axis_is_contiguous():
    (column,) = _sum_kernel(100, 64, row_stride=64, col_stride=1)
    assert column.arg.lanes == 64
    (row,) = _sum_kernel(100, 64, row_stride=1, col_stride=100)
    assert row.arg.lanes == 1
    (row_with_parameters,) = _sum_kernel(100, 64, row_stride=1, col_stride=100, scaled=True)
    assert row_with_parameters.arg.lanes == 1
    (too_wide,) = _sum_kernel(4, 64, row_stride=64, col_stride=1, max_lanes=32)
    assert too_wide.arg.lanes == 1
