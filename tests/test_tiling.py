"""2-D tiles for transposed access (Note: 2-D tiles, codegen/tiling.py) against eager:
transposes and permuted pointwise kernels over shapes that are and are not multiples of the
tile, every dtype, views with offsets and broadcasts; plus metrics that say which kernels are
tiled (and that the Triton path never is)."""

import pytest
import torch

import ember
from ember.codegen.tiling import tile_size, trip_count
from ember.uop.ops import RangeArg, RangeKind, UOp
from tests import helpers
from tests.helpers import check


def _tiled(expected: int) -> None:
    """The C++ path tiles `expected` kernels; the Triton renderer's blocks are its own."""
    assert ember.metrics.tiled_kernels == (expected if helpers.test_device() == "cpu" else 0)


SHAPES = [(64, 64), (100, 70), (33, 257), (1000, 40), (129, 4097)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_transpose_copy(shape):
    check(lambda x: x.t().contiguous(), torch.randn(shape))
    _tiled(1)


@pytest.mark.parametrize("shape", SHAPES[:4], ids=str)
def test_transpose_plus_contiguous(shape):
    x, y = torch.randn(shape), torch.randn(shape[::-1])
    check(lambda x, y: (x.t() + y).relu(), x, y)
    _tiled(1)


DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transpose_of_every_dtype(dtype):
    x = (torch.randn(300, 150) * 100).to(dtype)  # a bool tile is 128 elements wide
    check(lambda x: x.t().contiguous(), x)
    check(lambda x: (x.t() * 2 if dtype is not torch.bool else ~x.t()).contiguous(), x)
    _tiled(2)


def test_nchw_to_nhwc_and_back():
    x = torch.randn(2, 48, 20, 37)
    check(lambda x: x.permute(0, 2, 3, 1).contiguous(), x)
    _tiled(1)
    check(lambda x: x.permute(0, 3, 1, 2).contiguous(), torch.randn(2, 20, 37, 48))
    _tiled(2)


def test_batched_permute_plus():
    x, y = torch.randn(3, 65, 129), torch.randn(129, 65)
    check(lambda x, y: x.permute(0, 2, 1) + y, x, y)
    _tiled(1)


def test_views_with_offsets_and_broadcasts():
    base = torch.randn(300, 200)
    x = base[5:105, 3:163]  # an offset and a row stride wider than the row
    bias = torch.randn(100, 1)
    check(lambda x, b: (x.t() + b.t()).contiguous(), x, bias)
    _tiled(1)
    check(lambda x: x.t().contiguous(), base[::2, 1:])  # a stepped view
    _tiled(2)


def test_nan_and_inf_pass_through():
    x = torch.randn(70, 90)
    x[3, 5], x[60, 80], x[10, 1] = float("nan"), float("inf"), -float("inf")
    check(lambda x: (x.t() * 3 - 1).contiguous(), x)
    _tiled(1)


def test_contiguous_and_small_kernels_are_not_tiled():
    check(lambda x, y: x * y + 1, torch.randn(256, 256), torch.randn(256, 256))
    check(lambda x: x.t().contiguous(), torch.randn(8, 300))  # a side shorter than a tile
    check(lambda x: x.t().contiguous(), torch.randn(0, 64))  # empty
    check(lambda x: x * 2, torch.tensor(3.0))  # 0-d
    _tiled(0)


def test_reductions_are_not_tiled():
    x = torch.randn(128, 96)
    check(lambda x: x.t().sum(1), x, rtol=1e-4, atol=1e-4)
    check(lambda x: (x.t().cumsum(1), x.t().amax(0)), x, rtol=1e-4, atol=1e-4)
    _tiled(0)


def test_tile_sizes_and_trip_counts():
    assert tile_size(4) == tile_size(8) == 32 and tile_size(2) == 64 and tile_size(1) == 128
    tile = UOp.range(100, 0)
    tile = UOp(tile.op, tile.dtype, tile.src, RangeArg(RangeKind.TILE, 0, tile=32))
    element = UOp(tile.op, tile.dtype, (tile.src[0], tile), RangeArg(RangeKind.LOOP, 1))
    assert (trip_count(tile), trip_count(element), trip_count(tile, 16), trip_count(element, 16)) == (4, 32, 7, 16)
    assert trip_count(UOp.range(100, 2)) == 100


def test_permutes_of_three_dims_and_expanded_inputs():
    check(lambda x: x.permute(2, 1, 0).contiguous(), torch.randn(70, 3, 33)[1:, :, 1:])
    x = torch.randn(100, 1, 64).expand(100, 7, 64)  # a stride-0 dim
    check(lambda x, y: x.transpose(0, 2) + y, x, torch.randn(64, 7, 1))
    _tiled(2)


def test_integer_division_checks_in_tiles():
    a = torch.randint(-50, 50, (64, 96), dtype=torch.int32)
    b = torch.randint(1, 9, (96, 64), dtype=torch.int32)
    check(lambda a, b: (a.t() // b).contiguous(), a, b)
    check(lambda a, b: torch.where(a.t() > 0, a.t(), b) * 3, a, b)
    _tiled(2)


@pytest.mark.parametrize("step", [2, 3, 15])
def test_reads_a_few_elements_apart_along_another_loop(step):
    """`x.t()[::step]` read into a row-major result: the load's step along the row loop is
    `step`, not 1; the innermost loop still reads a row apart, so the kernel is tiled."""
    x, y = torch.randn(600, 4 * step * 33), torch.randn(600, 4 * step * 33)
    check(lambda x, y: (torch.sigmoid(x.t()[::step]) * y.t()[::step]).contiguous(), x, y)
    _tiled(1)


def test_reads_sixteen_apart_along_both_loops_are_not_tiled():
    x = torch.randn(32 * 20, 16 * 70)
    check(lambda x: x.t()[::16].contiguous(), x)  # no loop to tile it along
    _tiled(0)
