"""Scans (ember/lower/scans.py) against eager, through `check`: cumsum, cumprod, cummax,
cummin (values and indices), logcumsumexp, over several shapes and dims (negative too),
0-d and empty tensors, non-contiguous inputs, int/bool/float dtypes, NaN and infinities, and
their gradients. Every test asserts that nothing went to the aten fallback.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ember
from tests import helpers
from tests.helpers import check_lowered, compile_fn, to_test_device

f32, f64, i32, i64, b8 = torch.float32, torch.float64, torch.int32, torch.int64, torch.bool


def data(shape: tuple[int, ...], dtype: torch.dtype = f32, seed: int = 0) -> torch.Tensor:
    """Small values, so running sums and products stay exact enough to compare."""
    return helpers.data(shape, dtype, seed, spread=1.5, int_bound=3)


def scans(dim: int, floats: bool) -> dict[str, Callable]:
    ops: dict[str, Callable] = {
        "cumsum": lambda x: x.cumsum(dim),
        "cumprod": lambda x: x.cumprod(dim),
        "cummax": lambda x: x.cummax(dim),
        "cummin": lambda x: x.cummin(dim),
        "cumsum_of_expression": lambda x: (x * 2 + 1).cumsum(dim) * 3,
        "cumsum_of_broadcast": lambda x: x.sum().expand(x.shape).cumsum(dim),  # restarts per row all the same
    }
    if floats:
        ops["logcumsumexp"] = lambda x: x.logcumsumexp(dim)
        ops["cumsum_to_float64"] = lambda x: x.cumsum(dim, dtype=f64)
    else:
        ops["cumsum_to_float32"] = lambda x: x.cumsum(dim, dtype=f32)
    return ops


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
@pytest.mark.parametrize("dtype", [f32, i64, i32, b8], ids=lambda d: str(d).removeprefix("torch."))
def test_scans_over_each_dim(dtype, dim):
    check_lowered(scans(dim, dtype.is_floating_point), data((3, 4, 5), dtype))


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (7,), (1, 6), (6, 1), (40, 33)], ids=str)
def test_scans_of_odd_shapes(shape):
    x = data(shape)
    for dim in sorted({0, -1}) if shape else [0]:
        torch._dynamo.reset()
        check_lowered(scans(dim, True), x)


def test_scans_of_non_contiguous_inputs():
    x = data((5, 4, 3)).permute(2, 0, 1)
    check_lowered(scans(1, True), x)
    torch._dynamo.reset()
    check_lowered(scans(0, True), data((6, 8))[::2, 1::2])


def test_long_scan_in_parallel_rows():
    """Rows run on all threads, each row's scan in order; float sums accumulate in double."""
    check_lowered({"cumsum": lambda x: x.cumsum(1), "cummax": lambda x: x.cummax(0)}, data((300, 2000)))


def test_nan_and_infinities():
    x = data((4, 6))
    x[0, 2], x[1, 0], x[1, 4], x[2, 1], x[3, 3] = float("nan"), float("inf"), float("nan"), float("-inf"), float("inf")
    x[2, 3] = float("-inf")
    check_lowered(scans(1, True), x)


def test_ties_pick_eagers_index():
    x = torch.tensor([[1.0, 2, 2, 1, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3]])
    check_lowered({"cummax": lambda x: x.cummax(1), "cummin": lambda x: x.cummin(1)}, x)
    torch._dynamo.reset()
    check_lowered({"cummax": lambda x: x.cummax(0), "cummin": lambda x: x.cummin(-1)}, x.to(i64))


def test_integer_cumsum_wraps_and_promotes():
    x = torch.tensor([2**62, 2**62, 2**62, -5], dtype=i64)
    check_lowered({"cumsum": lambda x: x.cumsum(0), "cumprod": lambda x: x.cumprod(0)}, x)
    torch._dynamo.reset()
    check_lowered({"int8": lambda x: x.to(torch.int8).cumsum(0), "u8": lambda x: x.to(torch.uint8).cumprod(0)},
                  torch.tensor([100, 100, 3, 7]))  # fmt: skip


def test_scan_kernel_runs_alone_and_feeds_consumers():
    """The scan is one kernel; producers inline into it, consumers read it from memory."""
    check_lowered({"fn": lambda x: (x.exp() + 1).cumsum(-1).sin() + x}, data((8, 16)))
    assert ember.metrics.kernels_generated == 2


def test_masked_scatter_counts_with_a_scan():
    check_lowered({"masked_scatter": lambda x, s: x.masked_scatter(x > 0, s)}, data((50, 40)), data((2000,)))


# ---- gradients ------------------------------------------------------------------------------------


def check_gradients(fn: Callable, x: torch.Tensor) -> None:
    """Forward and backward compiled on the test device (EMBER_TEST_DEVICE), eager float64 on the CPU."""

    def grad(run, leaf):
        leaf = leaf.requires_grad_()
        out = run(leaf)
        weights = torch.linspace(-1, 2, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
        (out * weights).sum().backward()
        return leaf.grad.cpu()

    got = grad(compile_fn(fn), to_test_device(x.detach().clone()))
    want = grad(fn, x.detach().to(f64))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    assert ember.metrics.fallback_calls == 0, dict(ember.metrics.fallback_ops)


@pytest.mark.parametrize("op", ["cumsum", "cumprod", "cummax", "logcumsumexp"])
def test_gradients(op):
    fn = {
        "cumsum": lambda x: x.cumsum(1),
        "cumprod": lambda x: x.cumprod(-1),
        "cummax": lambda x: x.cummax(0).values,
        "logcumsumexp": lambda x: x.logcumsumexp(1),
    }[op]
    check_gradients(fn, data((4, 6)))
