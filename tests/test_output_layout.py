"""Graph outputs in eager's memory order (Note: outputs in eager's layout, lower/graph.py): a
pointwise result of permuted inputs comes back with eager's strides, and one that eager returns
as a strided view of a larger intermediate comes back dense in the order of eager's strides."""

import pytest
import torch

import ember
from tests import helpers
from tests.helpers import check, compile_fn


def _dim_order(t: torch.Tensor) -> list[int]:
    return sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: (-t.stride(d), d))


PERMUTED = {
    "transposed": (lambda x, y: torch.tanh(x.t()) * y.t() + 1, (300, 200)),
    "permuted_3d": (lambda x, y: x.permute(2, 0, 1).exp() - y.permute(2, 0, 1), (6, 40, 70)),
    "channels_last": (lambda x, y: torch.sigmoid(x) + y, (2, 16, 9, 11)),
}


@pytest.mark.parametrize("name", PERMUTED)
def test_permuted_pointwise_has_eager_strides(name):
    fn, shape = PERMUTED[name]
    x, y = torch.randn(shape), torch.randn(shape)
    if name == "channels_last":
        x, y = x.to(memory_format=torch.channels_last), y.to(memory_format=torch.channels_last)
    out = check(fn, x, y)
    assert out.stride() == fn(x, y).stride()


@pytest.mark.parametrize("step", [2, 3])
def test_strided_view_of_an_intermediate_is_dense_in_eager_order(step):
    """eager returns `h.t()[::step]` as a view of the whole (N, N) h; ember computes only the
    elements returned, in eager's order, so its loops walk the inputs as eager's do."""
    x, y = torch.randn(256, 300), torch.randn(256, 300)

    def fn(x, y):
        return (torch.nn.functional.gelu(x) * torch.sigmoid(y) + x.sin()).t()[::step]

    out = check(fn, x, y)
    eager = fn(x, y)
    assert _dim_order(out) == _dim_order(eager) == [1, 0]
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size()  # dense: no (N, N) buffer
    if helpers.test_device() == "cpu":
        assert ember.metrics.tiled_kernels == 0  # its order makes every access near: nothing to tile


def test_output_of_broadcast_and_negative_strides_stays_row_major():
    x = torch.randn(64, 1).expand(64, 48)
    out = compile_fn(lambda x: (x * 2)[:, ::2])(x)
    torch.testing.assert_close(out, (x * 2)[:, ::2])


def test_complex_output_of_a_broadcast_input_is_the_aten_result_not_a_kernel():
    # eager's result has stride 0; no ember kernel can copy a complex tensor into a dense layout
    # (the copy was rendered with no C++ type: gcc failed)
    x = torch.randn(1, 4, 2).expand(3, 4, 2)
    fn = lambda x: torch.view_as_complex(x)  # noqa: E731
    torch.testing.assert_close(compile_fn(fn)(x), fn(x))
    torch.testing.assert_close(compile_fn(lambda x: torch.view_as_complex(x * 2))(x), torch.view_as_complex(x * 2))


SAVED_VIEWS = {
    # Funnel's pooled queries: a step slice, strides (32, 1) for rows of 16
    "step_slice": (lambda x, v: (v * (x * 2)[:-1:2]).softmax(-1).pow(3).sum(), (16, 16), (8, 16)),
    # ProphetNet's n-gram states: a slice of a wider row, permuted, strides (576, 1, 48)
    "permuted_slice": (
        lambda x, v: (v * (x * 2).view(8, 12, 48)[:, :, :16].permute(0, 2, 1)).softmax(-1).pow(3).sum(),
        (96, 48),
        (8, 16, 12),
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", SAVED_VIEWS)
def test_a_view_saved_for_the_backward_keeps_eagers_gaps(name):
    """A forward output the backward reads comes back in eager's exact strides, gaps included
    (the backward's kernels were made for them); stored dense, the backward's layout check raised."""
    fn, x_shape, v_shape = SAVED_VIEWS[name]
    x, v = torch.randn(x_shape), torch.randn(v_shape, requires_grad=True)
    x_on, v_on = helpers.to_test_device(x), helpers.to_test_device(v)
    compile_fn(fn)(x_on, v_on).backward()
    v64 = v.detach().double().requires_grad_()
    fn(x.double(), v64).backward()
    torch.testing.assert_close(v_on.grad.cpu(), v64.grad.float(), rtol=1e-4, atol=1e-5)
