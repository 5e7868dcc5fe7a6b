"""Reductions that share a loop (Note: shared reduce loops, codegen/shared_loops.py): loop
counts from `ember.metrics.reduce_loops`, results against eager on float64-upcast inputs over
shapes, dims, keepdim, dtypes, strides, NaN/inf and empty tensors; var_mean's mean of rows
holding infinities as eager's Welford gives it."""

import math

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import check, cpu_kernels_only


def statistics(x, dim, keepdim):
    """Independent statistics of one tensor: one loop when they reduce the same dims."""
    return (x.sum(dim, keepdim=keepdim), x.mean(dim, keepdim=keepdim), (x * x).sum(dim, keepdim=keepdim),
            x.amax(dim, keepdim=keepdim), x.amin(dim, keepdim=keepdim))  # fmt: skip


def dependent_statistics(x, dim, keepdim):
    """Statistics that read others (a variance reads its mean, logsumexp's sum its max)."""
    var, mean = torch.var_mean(x, dim, keepdim=keepdim)
    every_dim = tuple(range(x.ndim)) if dim is None else dim
    return var, mean, x.std(dim, keepdim=keepdim), torch.logsumexp(x, every_dim, keepdim=keepdim)


def with_specials(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    flat = x.view(-1)
    flat[flat.numel() // 3] = math.nan
    flat[flat.numel() // 2] = math.inf
    flat[-1] = -math.inf
    return x


@cpu_kernels_only
def test_row_statistics_share_one_loop():
    check(lambda x: statistics(x, -1, False), torch.randn(64, 300), rtol=1e-4, atol=1e-4)
    assert ember.metrics.reduce_loops == 1


@cpu_kernels_only
def test_column_statistics_share_one_loop():
    check(lambda x: statistics(x, 0, False), torch.randn(300, 64), rtol=1e-4, atol=1e-4)
    assert ember.metrics.reduce_loops == 1


@cpu_kernels_only
def test_dependent_reductions_keep_their_order():
    # pass 1: the means, the max and the infinity count; pass 2: squared deviations and exp sums
    check(lambda x: dependent_statistics(x, -1, False), torch.randn(64, 300), rtol=1e-4, atol=1e-4)
    assert ember.metrics.reduce_loops == 2


@cpu_kernels_only
def test_logsumexp_alone_walks_twice():
    check(lambda x: torch.logsumexp(x, -1), torch.randn(16, 100))
    assert ember.metrics.reduce_loops == 2


@cpu_kernels_only
def test_identical_statistics_of_norms_collapse():
    # layer norm's var_mean and a var_mean of its own (another correction) are one mean and one
    # sum of squared deviations; rms norm's sum of squares joins the first pass
    def norms(x, weight, bias):
        var, mean = torch.var_mean(x, -1)
        return F.layer_norm(x, (256,), weight, bias), F.rms_norm(x, (256,), weight, eps=1e-6), var, mean

    check(norms, torch.randn(32, 256), torch.randn(256), torch.randn(256), rtol=1e-4, atol=1e-4)
    assert ember.metrics.kernels_generated == 1
    assert ember.metrics.reduce_loops == 2


SHAPES_AND_DIMS = [((33, 7), -1), ((33, 7), 0), ((5, 4096), 1), ((1, 16), 0), ((3, 1), 1), ((4, 6, 10), (0, 2)),
                   ((4, 6, 10), None), ((2, 3, 130), (1, 2))]  # fmt: skip


@pytest.mark.parametrize("shape,dim", SHAPES_AND_DIMS, ids=str)
@pytest.mark.parametrize("keepdim", [False, True])
def test_shared_statistics_match_eager(shape, dim, keepdim):
    x = torch.randn(shape)
    check(lambda x: statistics(x, dim, keepdim) + dependent_statistics(x, dim, keepdim), x, rtol=1e-4, atol=1e-4)
    assert ember.metrics.fallback_calls == 0


@cpu_kernels_only
@pytest.mark.parametrize("shape,dim", SHAPES_AND_DIMS[:4], ids=str)
def test_shared_statistics_with_nan_and_inf(shape, dim):
    x = with_specials(torch.randn(shape))
    check(lambda x: statistics(x, dim, False) + dependent_statistics(x, dim, False), x, rtol=1e-4, atol=1e-4)


def test_shared_statistics_of_float64_and_transposed_inputs():
    check(lambda x: statistics(x, -1, False) + dependent_statistics(x, -1, False), torch.randn(40, 50).double())
    x = torch.randn(50, 40).t()
    check(lambda x: statistics(x, 1, True) + dependent_statistics(x, 0, False), x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_shared_integer_statistics(dtype):
    x = torch.randint(-9, 10, (17, 23), dtype=dtype)
    check(lambda x: (x.sum(-1), x.amax(-1), x.amin(-1), x.prod(-1), x.sum(0), x.amax(0)), x)
    b = x > 0
    check(lambda b: (b.any(-1), b.all(-1), b.sum(-1)), b)


@pytest.mark.parametrize("shape,dim", [((0, 5), 0), ((0, 5), 1), ((3, 0), 1), ((3, 0), 0)], ids=str)
def test_shared_statistics_of_empty_tensors(shape, dim):
    check(lambda x: (x.sum(dim), x.mean(dim), (x * x).sum(dim), torch.var_mean(x, dim)), torch.randn(shape))


INFINITY_CASES = [((1, 16), -1), ((6, 3), 0), ((4, 5), None), ((2, 3, 4), (0, 2)), ((5,), 0), ((1, 1), -1)]


@cpu_kernels_only
@pytest.mark.parametrize("shape,dim", INFINITY_CASES, ids=str)
@pytest.mark.parametrize("sign", [1, -1])
def test_var_mean_of_infinities_is_eagers_welford(shape, dim, sign):
    # an infinity followed by any element makes eager's mean NaN; alone at the end it stays infinite
    n = math.prod(shape)
    for position in sorted({0, n // 2, n - 2, n - 1} - {-1}):
        x = torch.randn(shape)
        x.view(-1)[position] = sign * math.inf
        check(lambda x: (torch.var_mean(x, dim), torch.std_mean(x, dim, keepdim=True)), x)
    x = torch.randn(shape)
    x.view(-1)[-1] = sign * math.inf
    x.view(-1)[0] = -sign * math.inf if n > 1 else x.view(-1)[0]
    check(lambda x: torch.var_mean(x, dim), x)


@cpu_kernels_only
def test_var_mean_of_infinities_in_transposed_rows():
    # eager's order is the logical one, not memory's
    for row, col in [(3, 4), (2, 4), (3, 3)]:
        x = torch.randn(5, 4).t()
        x[row, col] = math.inf
        check(lambda x: torch.var_mean(x, 1), x)
