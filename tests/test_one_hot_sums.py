"""A sum over one dim of a value nonzero at one position only is a select (Note: a one-hot sum is
a select, lower/one_hot_sums.py): results against float64 eager (NaN and infinities in the other
columns, positions out of range, several dtypes and shapes) on the C++ and Triton backends, and
the reduction's loops and kernel gone (ember.metrics)."""

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import check, compile_fn, cpu_kernels_only, data, needs_triton, test_device, use_triton

BACKENDS = [pytest.param("cpp", marks=cpu_kernels_only), pytest.param("triton", marks=needs_triton)]
SHAPES = [(5, 7), (1, 13), (0, 6), (9, 2), (3, 0)]


def _backend(monkeypatch, backend: str) -> None:
    if backend == "triton":
        use_triton(monkeypatch)
    monkeypatch.setenv("EMBER_GRAPH_CACHE", "0")  # count what this compile decides


def _targets(rows: int, classes: int) -> torch.Tensor:
    """Positions in range and out of it (negative, the size itself, far past it)."""
    picks = [0, classes - 1, -1, classes, classes + 1000, 2, -7]
    return torch.tensor([picks[i % len(picks)] for i in range(rows)], dtype=torch.int64)


def _one_hot(t: torch.Tensor, classes: int) -> torch.Tensor:
    return torch.arange(classes, device=t.device) == t[:, None]


def _weights(rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-row weights with infinities and NaN among them."""
    w = data((rows,), dtype, seed=3)
    specials = [float("inf"), float("nan"), float("-inf")] if dtype.is_floating_point else []
    for i, special in enumerate(specials):
        if 1 + 2 * i < rows:
            w[1 + 2 * i] = special
    return w


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64], ids=str)
def test_one_hot_sums_are_selects(monkeypatch, backend, shape, dtype):
    """sum_r where(r == t, w, 0) and sum_r (r == t) * w: w where t is in range, else 0, and NaN for
    an infinite or NaN w in the product form (0 * inf in the other columns), as eager's sum gives."""
    _backend(monkeypatch, backend)
    rows, classes = shape
    t, w = _targets(rows, classes), _weights(rows, dtype)
    ops = {
        "where": lambda t, w: torch.where(_one_hot(t, classes), w[:, None], 0).sum(-1),
        "product": lambda t, w: (_one_hot(t, classes) * w[:, None]).sum(-1),
        "scaled": lambda t, w: (_one_hot(t, classes).to(w.dtype) * (w[:, None] * 3)).sum(-1, keepdim=True),
    }
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if dtype is torch.bfloat16 else {}  # w * 3 rounds to bfloat16
    for fn in ops.values():
        check(fn, t, w, **tolerance)
    assert ember.metrics.fallback_calls == 0
    if backend == "cpp" and classes >= 2:
        assert ember.metrics.reduce_loops == 0  # every sum a select


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_picked_element_that_varies_along_the_sum(monkeypatch, backend):
    """sum_r where(r == t, x[r], 0) is the gather x[t] (where drops the other columns, NaN or not);
    sum_r (r == t) * x[r] is not: 0 * x is NaN wherever x is infinite or NaN, which only a walk of
    the row finds, so that sum stays a reduction, and eager's NaN reaches the result."""
    _backend(monkeypatch, backend)
    x, t = data((6, 9)), _targets(6, 9)
    x[0, 4], x[1, 8], x[3, 0], x[0, 0] = float("inf"), float("nan"), float("-inf"), float("nan")
    check(lambda x, t: torch.where(_one_hot(t, 9), x, 0.0).sum(-1), x, t)
    if backend == "cpp":
        assert ember.metrics.reduce_loops == 0  # a gather
    check(lambda x, t: (_one_hot(t, 9) * x).sum(-1), x, t)
    if backend == "cpp":
        assert ember.metrics.reduce_loops == 1  # a walk of the row


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_index_checked_in_every_column_keeps_the_reduction(monkeypatch, backend):
    """A gather at a position read per column raises for a bad index in any column, picked or not."""
    _backend(monkeypatch, backend)
    x, t = data((4, 5)), torch.tensor([0, 2, 4, 1])
    index = torch.tensor([[0, 1, 2, 3, 4]] * 4)
    fn = compile_fn(lambda x, i, t: torch.where(_one_hot(t, 5), torch.gather(x, 1, i), 0.0).sum(-1))
    device = test_device()
    torch.testing.assert_close(fn(x.to(device), index.to(device), t.to(device)).cpu(), x[torch.arange(4), t])
    index[3, 4] = 9  # not in the picked column of row 3
    with pytest.raises(RuntimeError):
        fn(x.to(device), index.to(device), t.to(device))


def _backward_metrics(fn, x: torch.Tensor, *rest) -> tuple[torch.Tensor, int, int]:
    """The gradient of `fn` compiled by ember, with the kernels and reduce loops of its backward."""
    x = x.detach().to(test_device()).requires_grad_()
    loss = compile_fn(fn)(x, *(r.to(test_device()) for r in rest))
    ember.metrics.reset()
    loss.backward()
    return x.grad.cpu(), ember.metrics.kernels_generated, ember.metrics.reduce_loops


def _eager_gradient(fn, x: torch.Tensor, *rest) -> torch.Tensor:
    x = x.detach().double().requires_grad_()
    fn(x, *rest).backward()
    return x.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(64, 600), (7, 5), (1, 40)], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_backward_is_one_pointwise_kernel(monkeypatch, backend, shape, reduction):
    """log_softmax's gradient sums nll_loss's gradient over each row: one nonzero element, so no
    reduction remains and the backward is one kernel (on Triton, 64 rows of 600 were two: the
    sum's 64 programs may not compute the 38400 gradients, Note: fusions that starve the GPU)."""
    _backend(monkeypatch, backend)
    rows, classes = shape
    x = data(shape, seed=1)
    t = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(2))
    t[rows // 2] = -100  # ignore_index
    x[0, (int(t[0]) + 1) % classes] = float("inf")  # NaN gradient for row 0, as eager's

    def loss(x, t):
        return F.cross_entropy(x, t, reduction=reduction)

    got, kernels, loops = _backward_metrics(loss, x, t)
    torch.testing.assert_close(got.double(), _eager_gradient(loss, x, t), rtol=1e-5, atol=1e-6, equal_nan=True)
    assert kernels == 1
    if backend == "cpp":
        assert loops == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_logits_upcast_for_the_loss(monkeypatch, backend):
    """A language model's loss: bfloat16 logits cast to float32, the gradient cast back."""
    _backend(monkeypatch, backend)
    x = data((12, 300), torch.bfloat16, seed=5)
    t = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(6))
    t[3] = -100

    def loss(x, t):
        return F.cross_entropy(x.float(), t)

    got, kernels, _ = _backward_metrics(loss, x, t)
    expected = _eager_gradient(loss, x, t)
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-4)  # one bfloat16 rounding
    assert kernels == 1
