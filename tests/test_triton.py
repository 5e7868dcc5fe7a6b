"""The Triton renderer, through Triton's interpreter on CPU tensors (how CI, with no GPU, runs
it): a representative subset of the op, reduction, indexing and model tests, reused as they
are written (EMBER_BACKEND=triton sends CPU graphs to the Triton renderer), plus the
kernel shapes only the Triton path has (persistent vs looped reductions, fused row
normalizations, kernel errors through the device flag). Tests that matter most to the Triton
path but hold on any device (contended atomic stores, nested reductions) live with their ops
(test_scatter.py, test_reductions.py) and are reused here.

On a GPU machine the whole suite runs on CUDA with EMBER_TEST_DEVICE=cuda (tests/helpers.py);
these interpreter tests need TRITON_INTERPRET=1 set before triton is imported (conftest.py
does that when no GPU is present) and skip otherwise.
"""

import os

import pytest
import torch
import torch.nn.functional as F

import ember
from tests import test_indexing, test_models, test_ops, test_reductions, test_scatter, test_schedule
from tests.helpers import check

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter needs TRITON_INTERPRET=1 at start-up"
)


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("EMBER_BACKEND", "triton")
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")


def _subset(test, **kept):
    """`test` with its parametrizations narrowed to the values in `kept` (CI time)."""
    marks = []
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0] in kept:
            names, values = mark.args[0], mark.args[1]
            ids = mark.kwargs.get("ids")
            chosen = [i for i, v in enumerate(values) if kept[names](v)]
            new_ids = [ids[i] for i in chosen] if isinstance(ids, list) else ids
            marks.append(pytest.mark.parametrize(names, [values[i] for i in chosen], ids=new_ids))
        else:
            marks.append(mark)

    def run(**kwargs):
        test.__wrapped__(**kwargs) if hasattr(test, "__wrapped__") else test(**kwargs)

    run.__signature__ = __import__("inspect").signature(test)
    run.pytestmark = marks
    return run


# ---- reused tests (written once, run per backend) ---------------------------------------------

test_unary = _subset(test_ops.test_unary, domain=lambda d: d == test_ops.UNARY_DOMAINS[0])
test_binary = _subset(test_ops.test_binary, domains=lambda d: d == test_ops.BINARY_DOMAINS[0])
test_where = test_ops.test_where
test_cast = test_ops.test_cast
test_integer_overflow_wraps_like_eager = test_ops.test_integer_overflow_wraps_like_eager
test_floor_division_ties_round_like_eager = test_ops.test_floor_division_ties_round_like_eager
test_python_scalars = test_ops.test_python_scalars
test_view = _subset(test_ops.test_view, base=lambda b: b == test_ops.VIEW_BASES[0])
test_sum_mean_amax_amin_prod = test_reductions.test_sum_mean_amax_amin_prod
test_arg_and_indexed_extremes = _subset(
    test_reductions.test_arg_and_indexed_extremes, name=lambda n: n in ("nan", "transposed")
)
test_var_std = _subset(test_reductions.test_var_std, correction=lambda c: c == 1)
test_integer_and_bool_reductions = test_reductions.test_integer_and_bool_reductions
test_zero_dim_reductions = test_reductions.test_zero_dim_reductions
test_composites = test_reductions.test_composites
test_gather_index_select_embedding = test_indexing.test_gather_index_select_embedding
test_advanced_indexing = test_indexing.test_advanced_indexing
test_cat_stack = test_indexing.test_cat_stack
test_runtime_index_out_of_range_raises = test_indexing.test_runtime_index_out_of_range_raises
test_encoder_layer_inference_matches_eager = test_models.test_encoder_layer_inference_matches_eager
# stores at computed positions (Note: stores at computed positions on the GPU, renderer/triton_scatter.py)
test_scatter_scatter_add_scatter_reduce = _subset(
    test_scatter.test_scatter_scatter_add_scatter_reduce, layout=lambda layout: layout == "transposed"
)
test_scatter_bool = test_scatter.test_scatter_bool
test_scatter_nan_and_infinities = test_scatter.test_scatter_nan_and_infinities
test_scatter_0d_and_empty = test_scatter.test_scatter_0d_and_empty
test_scatter_with_duplicates_stores_one_of_the_values = (
    test_scatter.test_scatter_with_duplicates_stores_one_of_the_values
)
test_index_put_and_friends = _subset(
    test_scatter.test_index_put_and_friends, layout=lambda layout: layout == "contiguous"
)
test_index_put_int32_indices_and_bool_values = test_scatter.test_index_put_int32_indices_and_bool_values
test_index_reduce = test_scatter.test_index_reduce
test_out_of_range_index_raises_as_in_eager = _subset(test_scatter.test_out_of_range_index_raises_as_in_eager,
                                                     bad=lambda bad: bad == 5)  # fmt: skip
test_gradient_of_embedding = test_scatter.test_gradient_of_embedding
test_contended_stores_combine_every_value = test_scatter.test_contended_stores_combine_every_value
test_owner_dim_stores_are_atomic_across_a_block = test_scatter.test_owner_dim_stores_are_atomic_across_a_block
test_out_of_range_in_an_atomic_store_raises_and_flag_resets = (
    test_scatter.test_out_of_range_in_an_atomic_store_raises_and_flag_resets
)
# reductions inside another reduction's loop (Note: nested reductions, renderer/triton.py)
test_log_softmax_and_nll_loss_at_most_two_kernels = test_schedule.test_log_softmax_and_nll_loss_at_most_two_kernels
test_multilabel_margin_loss_ignores_slots_after_the_first_minus_one = (
    test_reductions.test_multilabel_margin_loss_ignores_slots_after_the_first_minus_one
)
test_cross_entropy_forward_and_backward = test_reductions.test_cross_entropy_forward_and_backward


# ---- what only the Triton path has ------------------------------------------------------------


@pytest.mark.parametrize("width", [24, 200], ids=["persistent", "looped"])
def test_softmax_and_layer_norm_are_one_kernel(width):
    torch.manual_seed(0)
    x = torch.randn(13, width)
    x[3, 5] = float("inf")
    check(lambda x: torch.softmax(x, -1), x)
    assert ember.metrics.kernels_generated == 1
    ember.metrics.reset()
    weight, bias = torch.randn(width), torch.randn(width)
    check(lambda x, w, b: F.layer_norm(x, (width,), w, b), torch.randn(13, width), weight, bias)
    assert ember.metrics.kernels_generated == 1
    assert ember.metrics.fallback_calls == 0


@pytest.mark.parametrize("shape", [(5, 300), (300, 5), (1000,), (3, 4, 70)])
def test_reductions_over_rows_columns_and_all(shape):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    x.view(-1)[7] = float("nan")
    check(lambda x: (x.sum(-1), x.amax(0), x.sum(), x.amin(-1)), x, rtol=1e-4)
    assert ember.metrics.fallback_calls == 0


def test_pointwise_chain_is_one_kernel_with_tails():
    torch.manual_seed(0)
    a, b, c = (torch.randn(3001) for _ in range(3))

    def chain(a, b, c):
        t = torch.where(a * b + c > 0, a * b + c, (a * b + c) * 0.5)
        return (t - a * c + b).tanh() * torch.expm1(b).clamp(-2, 2) + torch.log1p(a.abs())

    check(chain, a, b, c)
    assert ember.metrics.kernels_generated == 1


def test_broadcast_transposed_and_0d_operands():
    torch.manual_seed(0)
    x, y, s = torch.randn(6, 9), torch.randn(9, 6).t(), torch.tensor(2.5)
    check(lambda x, y, s: (x + y * s, torch.maximum(x, s), (x * s).sum()), x, y, s)


def test_integer_division_by_zero_raises():
    x = torch.tensor([5, 7, -3], dtype=torch.int64)
    y = torch.tensor([1, 0, 2], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        torch.compile(lambda a, b: torch.div(a, b, rounding_mode="trunc"), backend="ember", dynamic=False)(x, y)


def test_embedding_index_error_is_reported_and_flag_resets():
    weight = torch.randn(10, 4)
    fn = torch.compile(lambda w, i: F.embedding(i, w) * 2, backend="ember", dynamic=False)
    with pytest.raises(IndexError):
        fn(weight, torch.tensor([1, 10]))
    good = torch.tensor([1, 9])
    torch.testing.assert_close(fn(weight, good), F.embedding(good, weight) * 2)


def test_small_mlp_inference():
    torch.manual_seed(0)
    model = test_models.mlp().eval()
    x = torch.randn(16, 32)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="ember")(x), model(x), rtol=1e-4, atol=1e-5)
    assert ember.metrics.graphs_failed == 0
    assert ember.metrics.fallback_calls == 0
