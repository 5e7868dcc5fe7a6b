"""Split reductions on the Triton path (Note: split reductions, lower/split_reductions.py),
through Triton's interpreter on CPU tensors as tests/test_triton.py runs it.

The threshold is lowered (EMBER_SPLIT_REDUCTIONS) so that small tensors split and CI stays
fast: the reduction tests run again as they are written, and the cases only splitting has
(chunks that run past the end, NaN in one chunk, ties across chunks, integer wrap-around,
partials shared between outputs) are checked against eager with kernel counts.
On a GPU machine (no TRITON_INTERPRET) the same tests run on CUDA tensors.
"""

import math
import os

import pytest
import torch

import ember
from ember.lower.split_reductions import SplitPolicy
from tests import test_reductions
from tests.helpers import INTERPRETED, check, needs_triton, use_triton
from tests.test_triton import _subset

pytestmark = needs_triton

SMALL = 32  # reductions of at least this many elements split (chunks of 2 or more)


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    use_triton(monkeypatch)
    monkeypatch.setenv("EMBER_SPLIT_REDUCTIONS", str(SMALL))


def _split(threshold: int):
    os.environ["EMBER_SPLIT_REDUCTIONS"] = str(threshold)  # restored by the fixture's monkeypatch
    torch._dynamo.reset()
    ember.metrics.reset()


# ---- the reduction tests again, every long-enough reduction split ---------------------------

test_sum_mean_amax_amin_prod = _subset(test_reductions.test_sum_mean_amax_amin_prod,
                                       name=lambda n: n in ("contiguous", "transposed", "nan", "inf"))  # fmt: skip
test_arg_and_indexed_extremes = _subset(
    test_reductions.test_arg_and_indexed_extremes, name=lambda n: n in ("contiguous", "nan", "broadcast")
)
test_var_std = _subset(test_reductions.test_var_std, correction=lambda c: c in (0, 1))
test_integer_and_bool_reductions = test_reductions.test_integer_and_bool_reductions
test_empty_reductions = test_reductions.test_empty_reductions
test_zero_dim_reductions = test_reductions.test_zero_dim_reductions
test_vector_norm = _subset(test_reductions.test_vector_norm, ord=lambda o: o in (2, math.inf))
test_any_all_float = test_reductions.test_any_all_float


# ---- the policy -----------------------------------------------------------------------------


def test_policy_splits_few_long_reductions_into_aligned_chunks():
    policy = SplitPolicy(32768)
    count, chunk = policy.splits(1, 64 * 2**20)
    assert count == 1024 and chunk * count == 64 * 2**20
    count, chunk = policy.splits(16, 2**20)  # the column sums of a (1M, 16) tensor
    assert count * 16 >= 1024 and chunk % 1024 == 0 and (count - 1) * chunk < 2**20 <= count * chunk
    assert policy.splits(1, 1000) is None  # short: one program is enough
    assert policy.splits(4096, 2**20) is None  # many outputs fill the GPU already
    assert policy.splits(1024, 2**15) is None  # several outputs a program, but short ones
    count, chunk = policy.splits(16, 4 * 2**20)  # (4M, 16): 512 programs of 32 partials (2 chunks' columns)
    assert count * 16 // 32 >= 512 and count * chunk == 4 * 2**20
    count, chunk = policy.splits(1024, 2**17)  # the column sums of a (131072, 1024) tensor
    assert count == 32 and count * chunk == 2**17
    assert SplitPolicy(0).splits(1, 2**30) is None  # 0 never splits
    count, chunk = SplitPolicy(32).splits(1, 997)
    assert (count - 1) * chunk < 997 <= count * chunk


# ---- what only splitting has ----------------------------------------------------------------


@pytest.mark.parametrize("n", [1000, 997])  # chunks that divide the extent, and a last chunk past the end
def test_full_reductions_split_in_two_kernels(n):
    torch.manual_seed(0)
    x = torch.randn(n)
    check(lambda x: x.sum(), x)
    assert ember.metrics.kernels_generated == 2  # partials, then their sum
    _split(0)
    check(lambda x: x.sum(), x)
    assert ember.metrics.kernels_generated == 1


def test_partials_of_one_tensor_are_one_kernel():
    torch.manual_seed(0)
    x = torch.randn(999)
    check(lambda x: (x.sum(), x.amax(), x.amin()), x)
    # one kernel reads x once for all three partials; then each output reduces its own
    assert ember.metrics.kernels_generated == 4
    assert ember.metrics.fallback_calls == 0


@pytest.mark.parametrize("shape, dim", [((300, 5), 0), ((5, 300), 1), ((3, 200, 2), (0, 1)), ((40, 2, 30), (0, 2))])
def test_few_outputs_split_rows_columns_and_mixed_dims(shape, dim):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    x.view(-1)[11] = math.nan
    check(lambda x: (x.sum(dim), x.amax(dim), x.mean(dim, keepdim=True)), x, rtol=1e-4)
    check(lambda x: x.t().sum(0) if x.ndim == 2 else x.transpose(0, 2).sum((0, 2)), x)  # strided reads
    assert ember.metrics.fallback_calls == 0


def test_skinny_column_sums_at_the_default_threshold(monkeypatch):
    """The column sums of a (70003, 16) tensor: partials of 16 neighbouring columns over chunks of
    rows, the last chunk past the end, in blocks of 32 partials (two chunks) as a GPU runs them."""
    from tests.test_triton import force_launch

    _split(32768)
    if INTERPRETED:
        force_launch(monkeypatch, "looped", 32, 64)
    torch.manual_seed(0)
    x = torch.randn(70003, 16) + 10
    x[7, 3] = math.inf
    check(lambda x: (x.sum(0), x.mean(0)), x)
    assert ember.metrics.kernels_generated == 3  # the partials of both (one read), then each final


def test_many_outputs_are_not_split():
    x = torch.randn(300, 40)
    check(lambda x: x.sum(1), x)
    assert ember.metrics.kernels_generated == 1


@pytest.mark.parametrize("values", ["nan_late", "nan_first", "inf", "neg_inf", "ties"])
def test_split_extremes_and_first_index_ties(values):
    torch.manual_seed(0)
    x = torch.randn(1001)
    if values == "nan_late":
        x[777] = x[900] = math.nan
    elif values == "nan_first":
        x[0] = math.nan
    elif values == "inf":
        x[[5, 600]] = math.inf
    elif values == "neg_inf":
        x[:] = -math.inf
    else:  # many equal maxima and minima in different chunks: eager returns the first
        x = torch.randint(0, 3, (1001,)).float()
    _split(256)  # 63 chunks of 16
    check(lambda x: (x.amax(), x.amin(), x.argmax(), x.argmin(), x.max(0), x.min(0)), x)
    assert ember.metrics.fallback_calls == 0


@pytest.mark.parametrize("shape, dim", [((4001,), None), ((3, 1500), 1), ((1500, 2), 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_split_arg_extremes_read_their_input_once(shape, dim, dtype):
    """Note: an arg-extreme split in one pass. One kernel reads each chunk once for its extreme and
    the first position hitting it (NaN first), one combines them: not a kernel for the max and a
    second read of the input for its first hit. Ties between chunks go to the first chunk."""
    torch.manual_seed(0)
    x = torch.randint(0, 5, shape).to(dtype)  # many ties, in every chunk
    if dtype.is_floating_point:
        x.view(-1)[[900, 2100 % x.numel()]] = math.nan
    _split(256)
    for fn in (lambda x: x.argmax(dim), lambda x: x.argmin(dim)):
        ember.metrics.reset()
        check(fn, x)
        assert ember.metrics.kernels_generated == 2
        outputs = (math.prod(shape) // shape[dim] if dim is not None else 1) * 8
        assert ember.metrics.kernel_bytes < x.nbytes + x.nbytes // 2 + outputs  # the input once, partials small


def test_integer_sums_wrap_like_eager():
    torch.manual_seed(0)
    _split(128)
    big = torch.randint(2**60, 2**62, (500,), dtype=torch.int64)  # the int64 sum wraps around
    check(lambda x: (x.sum(), x.amax(), x.argmin(), (x % 7).prod()), big)
    small = torch.randint(-100, 100, (3, 400), dtype=torch.int32)
    check(lambda x: (x.sum(), x.sum(1), x.amin(1)), small)
    flags = torch.rand(700) > 0.999
    check(lambda x: (x.any(), x.all(), x.sum()), flags)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_split_var_mean_accuracy(dtype):
    torch.manual_seed(0)
    x = (torch.randn(2, 1500) * 1e-2 + 1000).to(dtype)  # a large mean: cancellation would show
    check(lambda x: (torch.var_mean(x), torch.var_mean(x, 1), torch.std(x, 1, correction=0)), x, rtol=1e-5)
    outliers = x.clone().flatten()
    outliers[::97] = 1e6  # far from every chunk's mean, at chunk starts too
    check(lambda x: (x.var(), torch.var_mean(x, correction=0)), outliers, rtol=1e-5)
    assert ember.metrics.fallback_calls == 0


def test_split_variance_reads_its_input_in_one_kernel():
    torch.manual_seed(0)
    x = torch.randn(3001)
    check(lambda x: torch.var_mean(x), x)
    # one kernel reads x for chunk sums and squared deviations from the chunk means; one combines
    # them into both results
    assert ember.metrics.kernels_generated >= 2


def test_split_mean_feeds_pointwise_consumers():
    torch.manual_seed(0)
    x = torch.randn(2000)
    check(lambda x: (x - x.mean(), ((x - x.mean()) ** 2).mean(), torch.nn.functional.mse_loss(x, x * 0.5)), x)
    assert ember.metrics.fallback_calls == 0


def test_empty_and_one_element_reductions_are_not_split():
    check(lambda x: (x.sum(), x.sum(1), x.mean(0)), torch.randn(0, 500))
    check(lambda x: (x.sum(0), x.prod(0)), torch.randn(500, 0))
    check(lambda x: (x.sum(), x.amax()), torch.randn(1))
    assert ember.metrics.fallback_calls == 0


def test_large_reduction_accuracy_at_the_default_threshold():
    _split(32768)
    x = torch.rand(100_000) + 1000
    check(lambda x: (x.sum(), x.mean()), x)
    assert ember.metrics.kernels_generated == 3  # partials of the sum, and two finals


# ---- nested reductions (Note: fusions that starve the GPU, schedule/fusion.py) -------------


@pytest.mark.parametrize("rows, classes", [(64, 10), (37, 130)])
def test_cross_entropy_runs_per_row_then_a_small_sum(rows, classes):
    torch.manual_seed(0)
    logits, target = torch.randn(rows, classes), torch.randint(0, classes, (rows,))
    logits[3, 2] = math.inf  # an inf logit, as eager: nan or inf loss
    check(lambda x, t: torch.nn.functional.cross_entropy(x, t), logits.clone(), target)
    check(lambda x, t: torch.nn.functional.cross_entropy(x, t), torch.randn(rows, classes), target)
    # the per-row terms in one kernel (whose rows are its programs), then their mean in another
    assert ember.metrics.kernels_generated >= 2 and ember.metrics.fallback_calls == 0
    assert ember.metrics.fusion_refusals >= 1
    _split(0)  # and with no splitting at all: still per row, then the mean
    check(lambda x, t: torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1), torch.randn(rows, classes), target)
    assert ember.metrics.kernels_generated >= 2


def test_nested_reduction_per_output_column():
    """The outer reduction keeps its output dim: one mean of row norms per batch."""
    torch.manual_seed(0)
    x = torch.randn(3, 50, 20)
    check(lambda x: x.norm(dim=-1).mean(dim=1), x, rtol=1e-5)
    check(lambda x: torch.logsumexp(x, -1).amax(1), x)
    assert ember.metrics.fallback_calls == 0


def test_large_member_is_not_left_to_a_reduction_with_few_programs():
    """A language model's saved log-softmax beside the loss: the (rows, classes) output is written
    by a kernel of its own, not by the one program that sums the loss."""
    torch.manual_seed(0)
    _split(32768)  # the default: the loss over 300 rows is not split
    logits = torch.randn(300, 200, requires_grad=True)  # 60000 elements: past STARVED_ELEMENTS
    target = torch.randint(0, 200, (300,))
    check(lambda x, t: torch.nn.functional.cross_entropy(x, t), logits, target)
    assert ember.metrics.fallback_calls == 0
    _split(32768)
    x = torch.randn(4, 20000)  # few rows, long: the means and the centered values apart
    check(lambda x: x - x.mean(1, keepdim=True), x)
    assert ember.metrics.kernels_generated >= 2


# ---- reductions across rows ---------------------------------------------------------------


def test_policy_splits_reductions_across_rows_by_their_elements():
    """An RMSNorm weight's gradient: 1024 column sums of 4096 rows (Note: split reductions)."""
    policy = SplitPolicy(32768)
    assert policy.splits(1024, 4096) is None  # along rows (a row per program): whole
    count, chunk = policy.splits(1024, 4096, across=True)
    assert count == 16 and chunk == 256  # 16 x 32 blocks of 32 columns: 512 programs
    assert policy.splits(1024, 512, across=True) is None  # 512K elements: one pass is enough
    assert policy.splits(4096, 4096, across=True) is None  # as many outputs fill the GPU
    assert policy.splits(1024, 4096, max_chunk=4096, across=True) is None  # var's one-pass chunks: as before
    assert SplitPolicy(0).splits(1024, 4096, across=True) is None


def _reduces(fn, *shapes):
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.ir import ComputedBuffer
    from ember.lower import lower_graph
    from ember.uop.ops import Ops

    inputs = [torch.randn(s) for s in shapes]
    graph, _ = lower_graph(make_fx(fn)(*inputs), inputs)
    steps = [s for s in graph.steps if isinstance(s, ComputedBuffer)]
    return [u for step in steps for u in step.body.toposort if u.op is Ops.REDUCE]


@pytest.mark.parametrize("fn, shapes, across", [
    (lambda x: x.sum(0), [(64, 32)], True),
    (lambda a, x, r: (a * (x * r)).sum(0), [(64, 32), (64, 32), (64, 1)], True),  # a per-row scale read along rows
    (lambda x: x.sum(1), [(64, 32)], False),
    (lambda x: x.t().sum(1), [(64, 32)], True),  # a transposed row sum reads down columns
    (lambda x: x.t().sum(0), [(64, 32)], False),
])  # fmt: skip
def test_reads_across_tells_column_sums_from_row_sums(fn, shapes, across):
    from ember.lower.split_reductions import reads_across

    (red,) = _reduces(fn, *shapes)
    assert reads_across(red) is across


def test_weight_gradient_column_sums_split_at_the_default_threshold():
    """1M elements summed across rows into 512 columns: partials over chunks of 256 rows, then the
    sums of 8 partials; a NaN and an inf in one chunk each."""
    _split(32768)
    torch.manual_seed(0)
    grad, x, scale = torch.randn(2048, 512), torch.randn(2048, 512), torch.rand(2048, 1)
    grad[100, 7], x[1500, 300] = math.nan, math.inf
    check(lambda g, x, s: (g * (x * s)).sum(0), grad, x, scale, rtol=1e-4)
    assert ember.metrics.kernels_generated == 2


def test_reductions_of_symbolic_extents_split():
    """Note: split reductions of symbolic extents. A full sum, column sums and a mean over a symbolic
    row count compile once, each as partials of a static number of chunks of a length computed from
    the sizes, then their reduction; a small size leaves most chunks empty."""
    from tests.helpers import to_test_device

    def f(x):
        return x.sum(), x.sum(0), (x * 2).mean(0, keepdim=True), x.amax()

    compiled = torch.compile(f, backend="ember", dynamic=True)
    torch.manual_seed(0)
    for rows in (3, 40, 517):
        x = torch.randn(rows, 6)
        x[rows // 2, 1] = math.inf
        got = compiled(to_test_device(x))
        for g, want in zip(got, f(x.double())):
            torch.testing.assert_close(g.cpu(), want.float(), rtol=1e-5, atol=1e-5)
    assert ember.metrics.symbolic_graphs == 1 and ember.metrics.shape_specializations == 0
    assert ember.metrics.kernels_generated == 5  # the partials (one read), then each output's final


def test_one_pass_splits_of_symbolic_extents_take_two_passes():
    """var and argmax over a symbolic row count cannot promise a chunk a program holds, so they
    split in two passes (Note: split reductions of symbolic extents): the mean's and the max's
    partials, then the squared deviations' and the first hits' partials that re-reduce them."""
    from tests.helpers import to_test_device

    compiled = torch.compile(lambda x: (x.var(0), x.argmax()), backend="ember")
    for rows in (5, 77, 300):
        x = torch.randn(rows, 16)
        x[rows // 2, 3] = x[rows - 1, 3] = x.max() + 1  # a tie: the first wins
        on_device = to_test_device(x)
        torch._dynamo.mark_dynamic(on_device, 0)  # (the copy a GPU run makes would not carry the mark)
        got = compiled(on_device)
        torch.testing.assert_close(got[0].cpu(), x.double().var(0).float(), rtol=1e-5, atol=1e-5)
        assert got[1].item() == x.argmax().item() == rows // 2 * 16 + 3
    assert ember.metrics.symbolic_graphs == 1 and ember.metrics.shape_specializations == 0
    assert ember.metrics.kernels_generated == 5  # the partials of both passes and the finals, fused where they can
