"""Errors on data are raised as eager raises them, and the compiled graph stays usable."""

import pytest
import torch

from tests.helpers import check, compile_fn


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_division_by_zero_raises_like_eager(dtype):
    fn = lambda a, b: (a // b, a % b, torch.div(a, b, rounding_mode="trunc"))
    a, b = torch.tensor([7, -7, 5], dtype=dtype), torch.tensor([2, 3, 0], dtype=dtype)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        fn(a, b)
    compiled = compile_fn(fn)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        compiled(a, b)
    b[2] = -4
    for got, want in zip(compiled(a, b), fn(a, b)):
        assert torch.equal(got, want)


def test_a_zero_divisor_of_a_division_feeding_another_is_reported():
    # the inner division's only user is the outer one; its CHECK used to be dropped (a silent 0)
    fn = lambda a, b, c: torch.div(torch.div(a, b, rounding_mode="trunc"), c, rounding_mode="trunc")
    a, b, c = torch.tensor([7, 8, 9]), torch.tensor([1, 0, 2]), torch.tensor([2, 3, 5])
    compiled = compile_fn(fn)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        compiled(a, b, c)
    b[1] = -3
    assert torch.equal(compiled(a, b, c), fn(a, b, c))


def test_division_by_a_nonzero_constant_needs_no_check():
    check(lambda a: (a // 3, a % -2), torch.arange(-6, 6))


def test_gather_out_of_range_raises_then_recovers():
    fn = lambda x, i: torch.gather(x, 1, i) * 2
    x, i = torch.randn(4, 5), torch.randint(0, 5, (4, 3))
    compiled = compile_fn(fn)
    torch.testing.assert_close(compiled(x, i), fn(x, i))
    i[1, 2] = 7
    with pytest.raises(IndexError, match="out of range"):
        compiled(x, i)
    i[1, 2] = -1
    with pytest.raises(IndexError, match="out of range"):
        compiled(x, i)
    i[1, 2] = 4
    torch.testing.assert_close(compiled(x, i), fn(x, i))
