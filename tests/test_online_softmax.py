"""A row's sum of exponentials computed in its maximum's pass on the Triton path (Note: a row's
exponential sum in one pass, codegen/online_softmax.py), through Triton's interpreter (or on a GPU,
as tests/test_split_reductions.py runs): softmax, log_softmax, logsumexp and cross_entropy against
float64 eager on rows longer than one block (so the looped variant runs), with infinities and NaNs
where the running maximum changes, and `ember.metrics.reduce_loops` showing that the looped variant
walks such a row once."""

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import check, check_lowered, needs_triton, use_triton
from tests.test_triton import force_launch

pytestmark = needs_triton


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    use_triton(monkeypatch)


@pytest.fixture(params=["row", "lane"])
def maximum(request, monkeypatch):
    """The running maximum a looped exp sum is taken against: the row's, or each lane's."""
    monkeypatch.setenv("EMBER_ONLINE_SOFTMAX", request.param)
    return request.param


def special_rows(width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows whose lanes meet -inf, +inf and NaN before, after and instead of finite values."""
    torch.manual_seed(0)
    x = torch.randn(11, width) * 3
    inf, nan = float("inf"), float("nan")
    x[1] = -inf  # eager: NaN for softmax's terms (-inf - -inf), -inf for logsumexp
    x[2, width // 2] = inf  # one +inf: NaN for softmax, +inf for logsumexp
    x[3, 5] = nan
    x[4, : width // 2] = -inf  # lanes that see only -inf first, then finite values
    x[4, width // 2 :] = -100 + torch.rand(width - width // 2)  # exp(-ref) would overflow float32
    x[5, [1, width - 1]] = inf
    x[6] = 80 + 20 * torch.rand(width)  # exp(x) overflows unless shifted
    x[7, width - 3] = 50  # the row's maximum arrives in the last chunk: every lane rescales
    x[8, :3] = inf  # +inf first, then finite values and a -inf
    x[8, 4] = -inf
    x[9, width - 1] = -inf
    x[9, 0] = nan
    x[10] = torch.arange(width, 0, -1) * 0.5  # the maximum first: no rescale after chunk one
    return x.to(dtype)


def exp_sum_ops() -> dict:
    return {
        "softmax": lambda x, t: torch.softmax(x, -1),
        "log_softmax": lambda x, t: torch.log_softmax(x, -1),
        "logsumexp": lambda x, t: torch.logsumexp(x, -1),
        "cross_entropy": lambda x, t: F.cross_entropy(x, t, reduction="none"),
    }


# (XBLOCK, RBLOCK): rows of 37 in chunks of 8, with tails in both; one lane of a chunk per element
@pytest.mark.parametrize("launch", [("looped", 2, 8), ("looped", 4, 16), ("persistent", 4, 64)], ids=str)
def test_exp_sums_match_float64_eager_with_infinities_and_nans(monkeypatch, launch, maximum):
    force_launch(monkeypatch, *launch)
    x, target = special_rows(37), torch.randint(0, 37, (11,))
    for name, fn in exp_sum_ops().items():
        torch._dynamo.reset()
        check_lowered({name: fn}, x, target)


def test_a_row_longer_than_any_block_walks_once_for_its_maximum_and_sum(maximum):
    """20000 elements: more than a persistent block holds, so the looped variant runs, with its
    usual launch; logsumexp and the loss's row statistics walk each row once, not twice."""
    x, target = special_rows(20000), torch.randint(0, 20000, (11,))
    check_lowered({"logsumexp": lambda x, t: torch.logsumexp(x, -1)}, x, target)
    assert ember.metrics.reduce_loops == 1
    ember.metrics.reset()
    check(lambda x, t: F.cross_entropy(x, t), x[[0, 4, 6, 7, 10]], target[:5])  # a finite mean
    # the rows' statistics once, and the mean over rows (a log per row: not written out, Note: a short sum unrolled)
    assert ember.metrics.reduce_loops == 2


def test_two_walks_when_switched_off(monkeypatch):
    """config.online_softmax "off": the maximum's walk, then the sum's, as written."""
    monkeypatch.setenv("EMBER_ONLINE_SOFTMAX", "off")
    force_launch(monkeypatch, "looped", 2, 8)
    x, target = special_rows(37), torch.randint(0, 37, (11,))
    check_lowered({"logsumexp": lambda x, t: torch.logsumexp(x, -1)}, x, target)
    assert ember.metrics.reduce_loops == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_logits(monkeypatch, dtype, maximum):
    """Softmax and the loss of 16-bit logits compute in float32: the exp sum is the same pair."""
    force_launch(monkeypatch, "looped", 2, 8)
    x, target = special_rows(37, dtype), torch.randint(0, 37, (11,))
    for name, fn in exp_sum_ops().items():
        torch._dynamo.reset()
        ember.metrics.reset()
        check_lowered({name: fn}, x, target, rtol=1e-2, atol=1e-2)
        assert ember.metrics.reduce_loops == 1, name


def test_a_sum_shifted_by_another_rows_maximum_keeps_two_walks(monkeypatch):
    """exp(y - max(x)) is not the pair: the sum waits for the maximum, as written."""
    force_launch(monkeypatch, "looped", 2, 8)
    x, y = special_rows(37), special_rows(37).flip(-1)
    check_lowered({"shifted": lambda x, y: (y - x.amax(-1, keepdim=True)).exp().sum(-1)}, x[[0, 7, 10]], y[[0, 7, 10]])
    assert ember.metrics.reduce_loops == 2


def test_float32_lane_sums_keep_long_rows_within_a_rounding(monkeypatch, maximum):
    """Each lane's running sum is float32 (Note: a row's exponential sum in one pass): in chunks of
    8, a lane of a 4096-wide row adds 512 terms. Equal values, a ramp whose maximum moves at every
    chunk (a rescale each time) and random rows stay within float32 roundings of float64 eager."""
    force_launch(monkeypatch, "looped", 2, 8)
    torch.manual_seed(0)
    width = 4096
    x = torch.stack([torch.ones(width), torch.arange(width) * 1e-3, torch.randn(width) * 4, torch.rand(width) - 20])
    got = ember.compile(lambda x: torch.logsumexp(x, -1))(x)
    want = torch.logsumexp(x.double(), -1)
    torch.testing.assert_close(got.double(), want, rtol=4e-7, atol=0.0)
