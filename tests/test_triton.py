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
from ember.runtime import triton as triton_runtime
from tests import (
    test_errors,
    test_indexing,
    test_lowp,
    test_models,
    test_ops,
    test_ops_more,
    test_optimizer,
    test_random,
    test_reductions,
    test_scans,
    test_scatter,
    test_schedule,
    test_verify,
)
from tests.helpers import check, check_lowered

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
test_nested_division_by_zero = test_errors.test_a_zero_divisor_of_a_division_feeding_another_is_reported
test_kernel_errors_name_the_offending_index = test_errors.test_kernel_errors_name_the_offending_index
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
# (not test_fma_rounds_once: Triton's interpreter computes tl.fma as x * y + z in numpy, two roundings)
test_in_place_store_reading_another_input_at_other_elements = (
    test_optimizer.test_in_place_store_reading_another_input_at_other_elements
)
test_optimizer_step_in_place = _subset(
    test_optimizer.test_training_step_with_optimizer_matches_eager, name=lambda n: n == "adamw", foreach=lambda f: f
)
test_scans_over_each_dim = _subset(
    test_scans.test_scans_over_each_dim, dtype=lambda d: d in (torch.float32, torch.bool), dim=lambda d: d in (0, -1)
)
test_scans_of_odd_shapes = _subset(test_scans.test_scans_of_odd_shapes, shape=lambda s: s in ((), (0,), (7,), (6, 1)))
test_scans_of_non_contiguous_inputs = test_scans.test_scans_of_non_contiguous_inputs
test_scan_nan_and_infinities = test_scans.test_nan_and_infinities
test_scan_ties_pick_eagers_index = test_scans.test_ties_pick_eagers_index
test_integer_cumsum_wraps_and_promotes = test_scans.test_integer_cumsum_wraps_and_promotes
test_scan_kernel_runs_alone_and_feeds_consumers = test_scans.test_scan_kernel_runs_alone_and_feeds_consumers
test_masked_scatter_counts_with_a_scan = test_scans.test_masked_scatter_counts_with_a_scan
# cumprod's and cummax's gradients store at computed positions (scatter): not yet on Triton
test_scan_gradients = _subset(test_scans.test_gradients, op=lambda op: op in ("cumsum", "logcumsumexp"))


# stores at computed positions (Note: stores at computed positions on the GPU, renderer/triton_scatter.py)
test_scatter_scatter_add_scatter_reduce = _subset(
    test_scatter.test_scatter_scatter_add_scatter_reduce, layout=lambda layout: layout == "transposed"
)
test_scatter_bool = test_scatter.test_scatter_bool
test_accumulating_an_expanded_source_adds_every_repeat = (
    test_scatter.test_accumulating_an_expanded_source_adds_every_repeat
)
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
# EMBER_VERIFY checks Triton kernels as it checks C++ ones (Note: verifying a compiled graph)
test_verify_a_correct_graph_passes_silently = _subset(
    test_verify.test_a_correct_graph_passes_silently, dtype=lambda dtype: dtype == torch.float32
)
test_verify_a_broken_lowering_is_named = test_verify.test_a_broken_lowering_is_named_with_its_node_and_line
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


def test_negative_zero_constants_keep_their_sign():
    """tl.full builds every zero as +0.0: a -0.0 constant is filled in by its bits (renderer/triton.py)."""
    for dtype in (torch.float64, torch.float32, torch.float16):
        x = torch.tensor([1.5, -2.0, 0.0, float("nan")], dtype=dtype)
        got = torch.compile(lambda x: torch.where(x > 0, x, -0.0), backend="ember", dynamic=False)(x)
        want = torch.where(x > 0, x, -0.0)
        assert torch.equal(torch.signbit(got), torch.signbit(want)), (dtype, got)
        torch._dynamo.reset()


def test_small_mlp_inference():
    torch.manual_seed(0)
    model = test_models.mlp().eval()
    x = torch.randn(16, 32)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="ember")(x), model(x), rtol=1e-4, atol=1e-5)
    assert ember.metrics.graphs_failed == 0
    assert ember.metrics.fallback_calls == 0


# ---- scans (Note: scans on blocks, renderer/triton_scan.py) -----------------------------------


def force_launch(monkeypatch, variant: str, xblock: int, rblock: int) -> None:
    """Launch every kernel whose rows the configuration takes with it (else the usual choice)."""
    config, default = triton_runtime.LaunchConfig(variant, xblock, rblock, 1), triton_runtime.candidates

    def forced(variants, xnumel, rnumel, interpret):
        fits = variant in variants and (variant == "looped" or rblock >= rnumel)
        return [config] if fits else default(variants, xnumel, rnumel, interpret)

    monkeypatch.setattr(triton_runtime, "candidates", forced)


def scan_rows() -> torch.Tensor:
    x = test_scans.data((5, 37))
    x[0, 20], x[1, 9], x[1, 30], x[4, 7] = float("nan"), float("inf"), float("-inf"), float("-inf")
    x[2] = float("-inf")  # logcumsumexp of -inf stays -inf; cummax ties everywhere
    x[3] = torch.tensor([float(i // 5 % 3) for i in range(37)])  # ties that straddle chunk edges
    x[4, 8] = float("-inf")
    return x


# (variant, XBLOCK, RBLOCK): a row in one block; rows in chunks, with tails in x and r, so the
# carry crosses chunk edges at NaN, infinities and ties.
@pytest.mark.parametrize("launch", [("persistent", 4, 64), ("looped", 2, 8)], ids=["persistent", "looped"])
def test_scan_variants_agree_with_eager(monkeypatch, launch):
    force_launch(monkeypatch, *launch)
    x = scan_rows()
    check_lowered(test_scans.scans(1, True), x)
    torch._dynamo.reset()
    check_lowered(test_scans.scans(0, True), x.t())  # the scanned dim strided, columns on x
    for dtype in (torch.int64, torch.bool):
        torch._dynamo.reset()
        check_lowered(test_scans.scans(-1, False), test_scans.data((5, 37), dtype))
    torch._dynamo.reset()
    wrapping = torch.tensor([[5] * 37, [2**61 + 7] * 37])  # int64 sums and products wrap across chunk edges
    check_lowered({"cumsum": lambda x: x.cumsum(1), "cumprod": lambda x: x.cumprod(1)}, wrapping)


@pytest.mark.parametrize("launch", [("persistent", 4, 64), ("looped", 2, 8)], ids=["persistent", "looped"])
def test_both_scan_variants_give_one_sum_of_negative_zeros(monkeypatch, launch):
    """A row's scan is the same bits in either variant (the launcher picks one by time): the
    looped carry starts at -0.0 (Note: scans on blocks), since -0.0 + x is x for every x, where a
    0.0 carry would turn the row's -0.0 sums to 0.0 from the second chunk on."""
    force_launch(monkeypatch, *launch)
    x = torch.full((3, 37), -0.0)
    x[1, 20:] = 1.0
    got = torch.compile(lambda x: x.cumsum(1), backend="ember", dynamic=False)(x)
    torch.testing.assert_close(got, x.cumsum(1))
    assert torch.signbit(got[[0, 2]]).all() and torch.signbit(got[1, :20]).all()  # the block scan's own sign


def test_long_row_scans_in_chunks(monkeypatch):
    """100k elements: more than a persistent block holds, so only the looped variant exists."""
    force_launch(monkeypatch, "looped", 1, 4096)
    x = test_scans.data((100_000,))
    x[99_990] = float("inf")
    check_lowered({"cumsum": lambda x: x.cumsum(0), "count": lambda x: (x > 0).cumsum(0),
                   "logcumsumexp": lambda x: x[:9000].logcumsumexp(0)}, x)  # fmt: skip
    assert ember.metrics.kernels_generated == 3


# ---- random numbers (Note: counter-based random numbers, lower/random.py) -----------------------
# (the statistics tests draw 2**20 values: minutes under the interpreter; they run on the GPU)

test_random_cpp_and_triton_kernels_draw_the_same_numbers = test_random.test_cpp_and_triton_kernels_draw_the_same_numbers
test_random_two_random_ops_in_one_graph_differ = test_random.test_two_random_ops_in_one_graph_differ
test_random_value_read_in_several_kernels = test_random.test_a_random_value_read_in_several_kernels_is_one_value
test_random_dropout_backward_uses_the_forward_mask = test_random.test_dropout_backward_uses_the_forward_mask
test_random_dropout_fuses_with_its_neighbours = test_random.test_dropout_fuses_with_its_neighbours
test_random_dropout_edge_probabilities = test_random.test_dropout_edge_probabilities
test_random_training_step_with_dropout = test_random.test_training_step_with_dropout_has_no_fallbacks
test_random_shapes_strides_and_dtypes = test_random.test_shapes_strides_and_dtypes_follow_eager
test_random_op_variants = test_random.test_random_op_variants_lower_without_fallbacks
test_random_randint_of_the_widest_ranges = test_random.test_randint_of_the_widest_ranges
test_random_fallback_random_matches_eager = test_random.test_fallback_random_matches_eager_bit_for_bit
test_random_later_op_offsets = test_random.test_a_later_random_op_draws_at_the_counters_after_the_earlier_ones
test_random_identical_layers_share_kernels = test_random.test_identical_layers_with_dropout_share_their_kernels


# ---- float16 / bfloat16 (Note: low-precision floats in Triton, renderer/triton.py) ---------------

test_lowp_from_low_precision_every_value = test_lowp.test_from_low_precision_every_value
test_lowp_to_low_precision_rounds_to_nearest_even = test_lowp.test_to_low_precision_rounds_to_nearest_even
test_lowp_integers_and_bools_to_low_precision = test_lowp.test_integers_and_bools_to_low_precision
test_lowp_float16_and_bfloat16_convert_both_ways = test_lowp.test_float16_and_bfloat16_convert_both_ways
test_lowp_exactly_rounded_ops = _subset(test_lowp.test_exactly_rounded_ops_match_eager_bit_for_bit,
                                        variant=lambda v: v in ("contiguous", "0-d"))  # fmt: skip
test_lowp_transcendental_ops = _subset(test_lowp.test_transcendental_ops_within_one_ulp,
                                       variant=lambda v: v == "transposed")  # fmt: skip
test_lowp_fused_chain_rounds_after_every_op = test_lowp.test_fused_chain_rounds_after_every_op_as_eager
test_lowp_promotion = _subset(
    test_lowp.test_promotion_with_every_kind_of_operand,
    other=lambda o: o in ("float64", "int32", "0-d other 16-bit", "python float"),
)


@pytest.mark.parametrize("dtype", test_lowp.LOW)
def test_lowp_reductions_and_normalizations(dtype):
    # test_lowp's inputs, cut small: every reduction kernel takes minutes on them in the interpreter
    x = test_lowp.reduction_inputs(dtype)["nan"][:3, :2]
    test_lowp.run(test_lowp.reductions, x, max_ulps=1)
    test_lowp.run(test_lowp.reductions, x.transpose(0, 1), max_ulps=1)


test_lowp_reductions_of_a_scalar = test_lowp.test_reductions_of_a_scalar
test_lowp_mlp_training_step = test_lowp.test_mlp_training_step_matches_eager
test_lowp_signbit = test_lowp.test_signbit_of_a_vectorized_16_bit_loop


# ---- special functions (Note: special functions, lower/math_functions.py) ---------------------

test_special_unary = _subset(test_ops_more.test_unary_special, dtype=lambda d: d == torch.float32)
test_special_unary_values = test_ops_more.test_unary_special_values
test_special_binary_values = test_ops_more.test_binary_special_values
test_special_integer_binary = test_ops_more.test_integer_binary
test_special_frexp_goes_to_aten = test_ops_more.test_frexp_special_values


def test_special_functions_in_float64_and_their_gradients():
    torch.manual_seed(0)
    x = torch.randn(300, dtype=torch.float64) * 4
    x[:6] = torch.tensor([0.0, -0.0, -3.0, 10.0, 1e-300, float("nan")], dtype=torch.float64)
    fns = {"digamma": torch.digamma, "trigamma": lambda x: torch.polygamma(1, x), "lgamma": torch.lgamma,
           "erfinv": lambda x: torch.erfinv(x / 13), "i0": torch.i0, "i1": torch.special.i1,
           "erfcx": torch.special.erfcx, "ndtri": lambda x: torch.special.ndtri(x.abs() / 13)}  # fmt: skip
    for fn in fns.values():
        test_ops_more.assert_matches_eager(fn, x, rtol=1e-11, atol=1e-11)
    leaf = (x[6:].abs() + 0.1).requires_grad_()
    (grad,) = torch.autograd.grad(torch.compile(lambda t: (torch.lgamma(t) + torch.digamma(t)).sum(),
                                                backend="ember")(leaf), leaf)  # fmt: skip
    exact = leaf.detach().requires_grad_()
    (want,) = torch.autograd.grad((torch.lgamma(exact) + torch.digamma(exact)).sum(), exact)
    torch.testing.assert_close(grad, want, rtol=1e-11, atol=1e-11)
    assert ember.metrics.fallback_calls == 0


def test_independent_reductions_share_a_looped_phase():
    """A column sum next to a weighted one, and layer norm's backward (sums of dy and dy * xhat
    over one row): the looped variant walks each row once for both (Note: independent reductions
    share a looped phase); a variance, which reads its mean, still walks the row twice."""
    x, w = torch.randn(64, 48), torch.randn(64, 48)
    check_lowered({"weighted": lambda x, w: (x * w).sum(0), "plain": lambda x, w: x.sum(0)}, x, w)
    assert ember.metrics.reduce_loops == 1
    ember.metrics.reset()
    check_lowered({"var": lambda x, w: x.var(1)}, x, w)
    assert ember.metrics.reduce_loops == 2


def test_launch_candidates_fit_their_rows_and_the_default_tuning_bound():
    """Every GPU candidate is a legal launch (powers of two, a persistent block holds its row, 1 to 16
    warps), none repeats, and no list is longer than the default EMBER_TUNING_CANDIDATES, so no
    candidate a list names is silently cut (the long-row chunks of 4096 and 8192 elements included)."""
    bound = ember.config.Config().tuning_candidates
    for variants in (["persistent", "looped"], ["looped"]):
        for rnumel in (1, 7, 64, 768, 1024, 1025, 4096, 8192, 16384, 32768, 50257, 1 << 20):
            for xnumel in (1, 16, 64, 4096, 1 << 20):
                found = triton_runtime.candidates(variants, xnumel, rnumel, False)
                assert 0 < len(found) <= bound and len(set(found)) == len(found), (variants, xnumel, rnumel, found)
                for c in found:
                    assert c.variant in variants and 1 <= c.num_warps <= 16, c
                    assert all(n & (n - 1) == 0 for n in (c.xblock, c.rblock, c.num_warps)), c
                    assert c.variant == "looped" or c.rblock >= rnumel, c
                if variants == ["looped"] and rnumel >= 16384:
                    assert {(c.rblock, c.num_warps) for c in found if c.xblock == 1} >= {(4096, 16), (8192, 16)}


def test_tuning_candidates_bound_what_a_first_call_compiles(monkeypatch):
    """EMBER_TUNING_CANDIDATES: the first call compiles and times at most that many
    configurations, the best guesses first (what the compile pool precompiles too)."""
    module = type("StandInModule", (), {"_sha256": "0" * 64})
    monkeypatch.setattr(triton_runtime.TritonLauncher, "recorded_winner", lambda self, device: None)

    def plan(tuned: int, variants: list[str]) -> list:
        launcher = triton_runtime.TritonLauncher(module, "k", variants, 1 << 16, 8192, [0], interpret=False,
                                                 tuned=tuned)  # fmt: skip
        return launcher.tuning_plan("stand-in GPU")

    for variants in (["pointwise"], ["persistent", "looped"]):
        every = triton_runtime.candidates(variants, 1 << 16, 8192, False)
        assert len(every) > 2 and plan(8, variants) == every[:8]
        assert plan(2, variants) == every[:2] and plan(1, variants) == every[:1]


def test_tuning_runs_candidates_on_copies_laid_out_as_the_outputs(monkeypatch):
    """Candidates are timed on private copies of the buffers a kernel writes, with the same
    strides: a kernel writing q of a fused projection (rows 3x its width apart) computes
    addresses over the whole stride, so a dense copy (`clone()`) is a third of the memory it
    writes, and timing wrote into other tensors (wrong GPT-2 gradients on an H100)."""
    import triton.testing

    module = type("StandInModule", (), {"_sha256": "0" * 64})
    launcher = triton_runtime.TritonLauncher(module, "k", ["pointwise"], 1 << 16, 0, [0], interpret=False)
    timed = []
    monkeypatch.setattr(launcher, "trial", lambda config, args, target: lambda: timed.append(args))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **_: fn() or 1.0)
    fused = torch.randn(2, 8, 3 * 64)
    q = fused[..., :64]  # written in place over its strided layout
    source = torch.randn(2, 8, 64)
    options = triton_runtime.candidates(["pointwise"], 1 << 16, 0, False)[:2]
    assert launcher.benchmark(options, (q, source), ("cuda", 90, 32)) in options
    for copy, untouched in timed:
        assert copy.stride() == q.stride() and torch.equal(copy, q) and copy.data_ptr() != q.data_ptr()
        assert copy.untyped_storage().nbytes() >= (fused.numel() - 2 * 64) * 4  # the addresses q's rows span
        assert untouched is source
