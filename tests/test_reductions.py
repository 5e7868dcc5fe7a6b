"""Reductions against eager: every reduction over several dims, keepdim, full reductions,
non-contiguous, broadcast, empty and NaN-holding inputs, and the composites built from them."""

import math

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import check, compile_fn, to_test_device


def inputs():
    torch.manual_seed(0)
    base = torch.randn(7, 12, 5)
    with_nan = base.clone()
    with_nan[2, 3, 1] = math.nan
    with_inf = base.clone()
    with_inf[1, :, 2] = math.inf
    return {
        "contiguous": base,
        "transposed": base.transpose(0, 2),
        "sliced": torch.randn(7, 24, 5)[:, ::2],
        "broadcast": torch.randn(7, 1, 5).expand(7, 12, 5),
        "nan": with_nan,
        "inf": with_inf,
    }


INPUTS = inputs()


@pytest.mark.parametrize("name", list(INPUTS))
def test_sum_mean_amax_amin_prod(name):
    x = INPUTS[name]
    check(lambda x: (x.sum(1), x.sum((0, 2), keepdim=True), x.sum(), x.mean(-1), x.mean((0, 1))), x)
    check(lambda x: (x.amax(1), x.amin((0, 2), keepdim=True), x.amax(), x.prod(2)), x, rtol=1e-4)
    assert ember.metrics.fallback_calls == 0


@pytest.mark.parametrize("name", list(INPUTS))
def test_arg_and_indexed_extremes(name):
    x = INPUTS[name]
    check(lambda x: (x.argmax(1), x.argmin(0, keepdim=True), x.argmax(), x.max(2), x.min(1, keepdim=True)), x)
    assert ember.metrics.fallback_calls == 0


@pytest.mark.parametrize("name", ["contiguous", "transposed", "nan", "broadcast"])
@pytest.mark.parametrize("correction", [0, 1, 2])
def test_var_std(name, correction):
    x = INPUTS[name]
    check(
        lambda x: (
            x.var(1, correction=correction),
            x.std((0, 2), correction=correction, keepdim=True),
            torch.var_mean(x, -1, correction=correction),
            torch.std_mean(x, correction=correction),
        ),
        x,
    )
    assert ember.metrics.fallback_calls == 0


def test_var_of_one_element_is_nan_like_eager():
    check(lambda x: (x.var(0), x.std(1)), torch.randn(1, 1))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_and_bool_reductions(dtype):
    x = torch.randint(-3, 4, (6, 9)).to(dtype)
    check(lambda x: (x.sum(1), x.sum(), x.amax(0), x.amin(1), x.any(1), x.all(0)), x)
    if dtype != torch.bool:  # eager rejects argmax and prod... of bool
        check(lambda x: (x.prod(1), x.argmax(1), x.argmin()), x)


def test_any_all_float():
    x = torch.tensor([[0.0, 1.0, math.nan], [0.0, 0.0, 0.0]])
    check(lambda x: (x.any(1), x.all(1), x.any(), x.all()), x)


@pytest.mark.parametrize("ord", [1, 2, 3, 0, math.inf, -math.inf])
def test_vector_norm(ord):
    x = INPUTS["contiguous"]
    check(lambda x: (torch.linalg.vector_norm(x, ord, dim=1), torch.linalg.vector_norm(x, ord)), x, rtol=1e-4)


def test_empty_reductions():
    x = torch.randn(0, 4)
    check(lambda x: (x.sum(0), x.sum(1), x.mean(0), x.prod(0), x.any(0), x.all(0)), x)


def test_zero_dim_reductions():
    x = torch.tensor(2.5)
    check(lambda x: (x.sum(), x.mean(), x.amax(), x.argmax()), x)
    # dim 0 (or -1) of a 0-d tensor is the tensor itself (OpInfo max.reduction_with_dim, mean, argmax)
    check(lambda x: (x.max(0), x.argmax(0), x.argmin(-1, keepdim=True), x.mean(0), x.var(0), x.amin(0), x.sum(-1)), x)
    assert ember.metrics.fallback_calls == 0


def test_max_like_reductions_of_empty_tensors_over_nonempty_dims():
    """Eager raises only when a reduced dim is empty; otherwise the result is just empty."""
    x = torch.randn(0, 5)
    check(lambda x: (x.amax(1), x.amin(1, keepdim=True), x.argmax(1), x.max(1), x.min(1, keepdim=True)), x)
    check(lambda x: torch.linalg.vector_norm(x, math.inf, 1), x)
    assert ember.metrics.fallback_calls == 0


def test_composites():
    x = torch.randn(16, 40)
    check(lambda x: (x.softmax(-1), x.log_softmax(0), x.logsumexp(1)), x)
    check(lambda x: torch.nn.functional.layer_norm(x, (40,)), x)
    check(lambda x: torch.nn.functional.rms_norm(x, (40,)), x)
    assert ember.metrics.fallback_calls == 0


@pytest.mark.parametrize("shape,groups", [((2, 6, 5), 3), ((2, 4, 3, 3), 2), ((1, 3), 1)])
def test_group_norm_forward_and_backward(shape, groups):
    x, w, b = torch.randn(shape), torch.randn(shape[1]), torch.randn(shape[1])
    check(lambda x, w, b: F.group_norm(x, groups, w, b), x, w, b)
    leaf, scale = x.clone().requires_grad_(), torch.randn(shape)
    (grad,) = torch.autograd.grad((compile_fn(lambda t: F.group_norm(t, groups, w, b))(leaf) * scale).sum(), leaf)
    exact = x.double().requires_grad_()
    (want,) = torch.autograd.grad((F.group_norm(exact, groups, w.double(), b.double()) * scale.double()).sum(), exact)
    torch.testing.assert_close(grad, want.float(), rtol=1e-4, atol=1e-4)
    assert ember.metrics.fallback_calls == 0


def test_group_norm_of_equal_values_is_the_bias():
    # a group of equal values has variance 0: the result is the bias exactly. Folded into a
    # bias (x * rstd * w + (b - mean * rstd * w), torch's CPU decomposition) it was 1e-3 off
    x = torch.tensor([[-8.0676, -8.0676, -8.0676], [100.3, 100.3, 100.3]])
    w, b = torch.tensor([-8.4784, 9.5, 3.0]), torch.tensor([-2.4005, 0.5, 1.0])
    check(lambda x, w, b: F.group_norm(x, 1, w, b), x, w, b)
    check(lambda x, w, b: F.group_norm(x, 1, w, b), x[:1].expand(4, 3), w[:1].expand(3), b)


def test_reduction_read_at_two_positions_in_one_kernel():
    check(lambda x: x.sum(1)[:, None] + x.sum(1)[None, :], torch.randn(16, 16))


def test_large_reduction_accuracy():
    x = torch.rand(3_000_000) + 1000
    check(lambda x: (x.sum(), x.mean()), x)


def test_reduction_of_broadcast_reductions_declares_each_accumulator_once():
    # a row norm of a broadcast input depends on fewer loops than the sum that reads it
    a, b = torch.randn(1, 2, 3), torch.randn(2, 1, 3)
    check(lambda a, b: torch.nn.functional.cosine_similarity(a, b, dim=-1), a, b)
    check(lambda a, b: torch.nn.functional.cosine_similarity(a, b, dim=1), torch.randn(4, 5, 1), torch.randn(4, 1, 6))


@pytest.mark.parametrize("shape", [(4, 8), (3, 5, 7)])
def test_arg_extreme_of_a_reduction_runs_the_max_loop_before_the_row_loop(shape):
    # argmax(s) = first i with s[i] == max(s): the max is a reduction outside the row loop that
    # reads it (was 'linearize: DEFINE_ACC would be emitted twice'); integer values keep the
    # row sums exact, so ties resolve as eager's
    x = torch.randint(-9, 10, shape).float()
    check(lambda x: (x.sum(-1).argmax(), x.sum(-1).argmin(-1), x.sum(-1).argmax(0)), x)
    check(lambda x: (x.sum(-1).max(0), x.sum(-1).min(-1)), x)
    assert ember.metrics.fallback_calls == 0


def test_masked_variance_recomputes_index_math_after_a_loop_closes():
    # mask index math hoisted out of an inner loop that closes for another reduction
    x, mask = torch.randn(5, 5, 5), torch.rand(5, 1, 5) > 0.3
    check(lambda x, m: torch.masked.var(x, mask=m.expand(5, 5, 5)), x, mask)
    check(lambda x, m: torch.masked.std(x, 1, mask=m.expand(5, 5, 5)), x, mask)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_margin_loss_ignores_slots_after_the_first_minus_one(reduction):
    # torch's own decomposition counts those slots too (ember ships its own)
    x, target = torch.randn(3, 6), torch.tensor([[3, 0, -1, 1, 2, 4], [1, 2, 5, -1, 0, 0], [-1, 0, 0, 0, 0, 0]])
    f = lambda x, t: torch.nn.functional.multilabel_margin_loss(x, t, reduction=reduction)
    check(f, x, target)
    check(f, torch.randn(6), torch.tensor([2, 5, -1, 0, 1, 3]))
    assert ember.metrics.fallback_calls == 0


# ---- nested reductions (Note: nested reductions, renderer/triton.py) ----------------------------


@pytest.mark.parametrize("width", [24, 100], ids=["persistent", "looped"])
def test_cross_entropy_forward_and_backward(width):
    """The mean over rows of each row's logsumexp: a reduction inside another's loop, walked
    XBLOCK rows at a time (Note: nested reductions); in training, fused with per-row outputs
    into a kernel with an x axis of its own."""
    torch.manual_seed(0)
    x, target = torch.randn(21, width), torch.randint(0, width, (21,))  # rows > XBLOCK: chunks with a tail
    target[4] = -100
    x[2, 3] = float("-inf")
    check(lambda x, t: F.cross_entropy(x, t), x, target)
    assert ember.metrics.kernels_generated <= 2
    x = x.clone().requires_grad_()

    def step(x, t):
        loss = F.cross_entropy(x, t, label_smoothing=0.1)
        loss.backward()
        return loss

    device_x = to_test_device(x.detach()).requires_grad_()
    loss = compile_fn(step)(device_x, to_test_device(target))
    want = step(x, target)
    torch.testing.assert_close(loss.cpu(), want)
    torch.testing.assert_close(device_x.grad.cpu(), x.grad)
    assert ember.metrics.fallback_calls == 0 and ember.metrics.graphs_failed == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool])
def test_a_short_sum_is_unrolled_into_its_reader(dtype):
    """Note: a short sum unrolled (lower/reductions.py): GQA's backward sums the gradients of the
    2 query heads sharing a key head, then permutes them. Written out as a pointwise sum, the
    permute reads it in one kernel (as a REDUCE: a reduction kernel, then the permute's copy)."""
    torch.manual_seed(0)
    g = torch.randn(2, 3, 2, 5, 4)
    g[0, 1, 1, 2, 3], g[1, 0, 0, 1, 1], g[1, 2, 1, 4, 0] = math.nan, math.inf, -math.inf
    g = g.to(dtype) if dtype is not torch.bool else g > 0
    ember.metrics.reset()
    check(lambda g: g.sum(2).permute(0, 2, 1, 3).reshape(2, 5, 12), g)
    assert ember.metrics.kernels_generated == 1
    ember.metrics.reset()
    check(lambda g: (g.sum((1, 2)), g.sum(dim=(2, 4), keepdim=True)), g)  # 6 and 8 positions
    check(lambda g: g.transpose(0, 4).sum(4), g)  # strided


def test_a_sum_of_more_positions_stays_a_reduction():
    torch.manual_seed(0)
    x = torch.randn(9, 6)
    ember.metrics.reset()
    check(lambda x: (x.sum(0) * 2).t(), x)  # 9 positions: a reduction loop; x * 2 read through it
    check(lambda x: x.sum((0, 1)), torch.randn(3, 3))
    check(lambda x: x.sum(1), torch.empty(4, 0))  # no positions: the sum's identity


def test_a_short_sum_of_exponentials_stays_a_loop():
    """A transcendental summed over 8 positions is not written out: its reader would compute the
    8 exponentials again for each of its elements (Note: a short sum unrolled)."""
    from ember.lower.reductions import unrolled_sum
    from ember.lower.values import axis
    from ember.uop.dtypes import dtypes
    from ember.uop.ops import Ops, UOp

    value = UOp.const(dtypes.float64, 1.0)
    position = UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, 8),), 0)
    cheap = value + position.cast(dtypes.float64) + axis(0).cast(dtypes.float64)
    assert unrolled_sum(cheap, [position], Ops.ADD) is not None
    assert unrolled_sum(cheap.alu(Ops.EXP2), [position], Ops.ADD) is None
    assert unrolled_sum(cheap, [position], Ops.MAX) is None
    check(lambda x: x / x.exp().sum(-1, keepdim=True), torch.randn(16, 8))
