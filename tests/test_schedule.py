"""The scheduler's fusion decisions, asserted on ember.metrics kernel counts."""

import math

import torch
import torch.nn.functional as F

import ember
from tests.helpers import check


def test_pointwise_chain_of_20_ops_over_3_inputs_is_one_kernel():
    def chain(x, y, z):
        h = x * y + z
        for i in range(6):
            h = (h.sin() * y - z).abs() + i
        return h * 0.5

    # six rounds of sin: a few ulp of difference (libmvec vs eager's sin) grow along the chain
    check(chain, torch.randn(64, 64), torch.randn(64, 64), torch.randn(64), rtol=1e-4, atol=1e-4)
    assert ember.metrics.kernels_generated == 1


def test_horizontal_fusion_of_independent_outputs():
    check(lambda x: (x.sin() + 1, x.cos() * 2), torch.randn(128, 32))
    assert ember.metrics.kernels_generated == 1
    assert ember.metrics.fusions == 1


def test_softmax_is_one_kernel():
    check(lambda x: x.softmax(-1), torch.randn(4096, 1024))
    assert ember.metrics.kernels_generated == 1


def test_layer_norm_and_rms_norm_are_one_kernel_each():
    x = torch.randn(256, 768)
    check(lambda x: F.layer_norm(x, (768,)), x)
    assert ember.metrics.kernels_generated == 1
    ember.metrics.reset()
    check(lambda x: F.rms_norm(x, (768,), eps=1e-6), x)
    assert ember.metrics.kernels_generated == 1


def test_log_softmax_and_nll_loss_at_most_two_kernels():
    check(lambda x, t: F.nll_loss(x.log_softmax(-1), t), torch.randn(64, 100), torch.randint(0, 100, (64,)))
    assert ember.metrics.kernels_generated <= 2


def test_matmul_epilogue_is_one_extern_and_one_kernel():
    x, w, b = torch.randn(32, 64), torch.randn(64, 48), torch.randn(48)
    check(lambda x, w, b: F.gelu(x @ w + b), x, w, b, rtol=1e-4, atol=1e-4)
    assert ember.metrics.kernels_generated == 1
    assert ember.metrics.extern_calls == 1 and ember.metrics.fallback_calls == 0


def test_reduction_over_leading_dim_is_not_fused_into_its_broadcast():
    # mean over dim 0 read by every row: fusing would recompute the mean per row
    check(lambda x: x - x.mean(0), torch.randn(64, 32))
    assert ember.metrics.kernels_generated == 2


def test_fusion_that_would_create_a_cycle_is_refused():
    def f(x):
        a = x.sin()
        values, _ = torch.sort(a, dim=-1)  # an extern between a and its second reader
        return values + a

    text = ember.explain(f, torch.randn(16, 16))
    assert "fusion would create a cycle through" in text
    check(f, torch.randn(16, 16))


def test_fusion_that_would_raise_peak_memory_is_refused():
    def f(x):
        a = x.sin()
        first, _ = torch.sort(a, dim=-1)  # large temporaries live here
        early = first * 2
        b = x.cos()  # shares x with a, but is needed only much later
        second, _ = torch.sort(b, dim=-1)
        return early, second

    text = ember.explain(f, torch.randn(256, 256))
    assert "fusion would raise peak memory" in text
    check(f, torch.randn(256, 256))


def test_explain_lists_kernels_and_fallbacks():
    text = ember.explain(lambda x: torch.sort(x.exp())[0] + 1, torch.randn(8, 8))
    assert "kernel [" in text and "fallback aten.sort" in text


def test_fusion_off_gives_same_results():
    def f(x):
        return x.softmax(-1) * F.layer_norm(x, (x.shape[-1],)) + math.pi

    x = torch.randn(32, 48)
    check(f, x)
    fused = ember.metrics.kernels_generated
    ember.metrics.reset()
    unfused = torch.compile(f, backend=lambda gm, inp: ember.ember_backend(gm, inp, fusion=False))(x)
    torch.testing.assert_close(unfused, f(x))
    assert ember.metrics.kernels_generated > fused


def test_softmax_read_by_bmm_through_a_view_is_one_kernel():
    # realized in its own shape before the (16, 16, 16) view bmm reads: the row statistics,
    # shaped (4, 4, 16, 1), align with it and fuse (realized as the view, they would not)
    scores, v = torch.randn(4, 4, 16, 16), torch.randn(4, 4, 16, 8)
    check(lambda s, v: torch.matmul(s.softmax(-1), v), scores, v, rtol=1e-4, atol=1e-4)
    assert ember.metrics.kernels_generated == 1 and ember.metrics.fallback_calls == 0


def test_transposed_matmul_operand_is_a_view_of_one_buffer():
    # a linear layer's backward: grad.t() @ x, grad @ w and grad.sum(0) all read one buffer;
    # mm gets a transposed view of it, never a transposed copy
    def backward_like(a, g, x, w):
        grad = torch.where(a <= 0, 0.0, g)
        return grad.t() @ x, grad @ w, grad.sum(0)

    a, g, x, w = torch.randn(64, 32), torch.randn(64, 32), torch.randn(64, 16), torch.randn(32, 8)
    a[0, 0] = math.nan
    check(backward_like, a, g, x, w, rtol=1e-4, atol=1e-4)
    assert ember.metrics.kernels_generated == 2  # the grad, its column sum
    assert ember.metrics.extern_calls == 2 and ember.metrics.fallback_calls == 0


def test_reshaped_matmul_result_is_returned_as_a_view():
    x, w = torch.randn(4, 8, 48), torch.randn(48, 64)
    check(lambda x, w: (x.reshape(32, 48) @ w).reshape(4, 8, 64), x, w, rtol=1e-4, atol=1e-4)
    assert ember.metrics.kernels_generated == 0 and ember.metrics.extern_calls == 1
