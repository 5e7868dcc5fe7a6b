"""Arguments of aten calls (externs) in the strides eager gives them, size-1 dims included:
cuDNN's attention backward rejects a (batch, heads, rows, 1) statistics tensor whose last stride
is not 1, and ember's views leave a size-1 dim's stride 0 (lower/context.py
`with_eager_unit_strides`)."""

from __future__ import annotations

import torch

from ember.metrics import metrics
from tests.helpers import check, compile_fn


@torch.library.custom_op("ember_test::strict_unit_stride", mutates_args=())
def strict_unit_stride(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:  # as cuDNN's frontend checks
        raise RuntimeError(f"the last dim must have stride 1, got strides {x.stride()}")
    return x * 2


@strict_unit_stride.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("ember_test::attention_like", mutates_args=())
def attention_like(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two results, the second (batch, heads, rows, 1) as cuDNN attention's statistics."""
    return x * 2, x.sum(-1, keepdim=True)


@attention_like.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1))


def test_size_one_dims_keep_eager_strides():
    def f(x, y):
        z = x + y  # an output, so a buffer of its own shape that the unsqueeze views
        return strict_unit_stride(z.unsqueeze(-1)) + 1, z

    compiled = compile_fn(f)
    for shape in ((5,), (3, 7), (2, 3, 4)):
        x, y = torch.randn(shape), torch.randn(shape)
        metrics.reset()
        out, z = compiled(x, y)
        torch.testing.assert_close(out, (x + y).unsqueeze(-1) * 2 + 1)
        torch.testing.assert_close(z, x + y)
        assert metrics.extern_calls >= 1 and metrics.graphs_failed == 0


def test_size_one_dims_of_inputs_keep_eager_strides():
    f = compile_fn(lambda x: strict_unit_stride(x.unsqueeze(-1)[1:]))
    x = torch.randn(6, 4)
    torch.testing.assert_close(f(x), x.unsqueeze(-1)[1:] * 2)


def test_outputs_keep_eager_strides_on_size_one_dims():
    """A forward's saved tensor reaches the backward's externs as the forward returned it."""

    def f(x):
        z = x * 2
        return z, z.unsqueeze(-1), z.unsqueeze(0)[:, 1:], strict_unit_stride(x.unsqueeze(-1))

    compiled = compile_fn(f)
    for shape in ((5,), (3, 7)):
        x = torch.randn(shape)
        for got, want in zip(compiled(x), f(x)):
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride(), (got.stride(), want.stride())


def test_a_second_aten_result_returned_keeps_eager_strides():
    """The case of cuDNN attention's statistics, saved for the backward (fails on 77968f1:
    strides (32, 8, 1, 0))."""

    def f(x):
        out, stats = attention_like(x)
        return out + 1, stats

    compiled = compile_fn(f)
    x = torch.randn(2, 4, 8, 16)
    for got, want in zip(compiled(x), f(x)):
        torch.testing.assert_close(got, want)
        assert got.stride() == want.stride(), (got.stride(), want.stride())


def test_a_kernel_never_writes_over_an_aten_view_of_an_input():
    """as_strided of a transposed input runs in aten and returns a view of the input; the kernel
    after it, the view's last reader, used to store its result in place there: into the caller's
    tensor (the in-place choice took any dying aten result: lower/context.py `_returns_alias`)."""

    def f(x):
        return torch.as_strided(x.t(), (3, 2), (1, 3)) * 2

    x = torch.randn(4, 3)
    before = x.clone()
    torch.testing.assert_close(compile_fn(f)(x), f(before))
    assert torch.equal(x, before)
    assert metrics.fallback_calls == 1  # (the as_strided: the view this is about)


def test_reshape_of_a_buffer_that_an_extern_reads_is_no_copy():
    """ConvNeXt's MLP: a linear, its rows viewed as (N, H, W, C), gelu, viewed back as rows for
    the next linear. The gelu's buffer read as rows is the same memory, so the extern reads it in
    place: the row's three digits (n, h, w) recombine into the row (uop/symbolic.py
    `recombine_div_mod`) and no copy kernel is made."""

    def f(x, w1, w2):
        rows = x.reshape(-1, x.shape[-1])
        h = torch.nn.functional.linear(rows, w1).view(*x.shape[:-1], w1.shape[0])
        return torch.nn.functional.linear(torch.nn.functional.gelu(h).view(-1, w1.shape[0]), w2)

    for shape, hidden in (((2, 5, 7, 16), 24), ((3, 4, 6, 8), 32), ((1, 3, 3, 4), 12)):
        x, w1, w2 = torch.randn(shape), torch.randn(hidden, shape[-1]), torch.randn(shape[-1], hidden)
        metrics.reset()
        check(f, x, w1, w2)
        assert metrics.kernels_generated == 1, f"{shape}: {metrics.kernels_generated} kernels (gelu, then a copy?)"
