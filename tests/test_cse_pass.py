"""The common-subexpression pass (ember/passes/cse.py): equal pure calls become one call, and
nothing that would change a result or an output's storage is merged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import ember
from ember.passes.cse import eliminate_common_subexpressions
from tests.helpers import check, data, transposed

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _cpu_graphs(monkeypatch):
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")


def targets(graph: torch.fx.Graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


def per_layer_bias(q: torch.Tensor, bias: torch.Tensor, layers: int = 3) -> torch.Tensor:
    """T5's pattern: every layer makes its own contiguous copy of one shared attention bias."""
    shared = bias.permute(2, 0, 1).unsqueeze(0)  # (1, heads, n, n) view of an (n, n, heads) gather
    for _ in range(layers):
        q = F.scaled_dot_product_attention(q, q, q, attn_mask=shared.contiguous())
    return q


@pytest.mark.parametrize("heads, n, dtype", [(2, 8, torch.float32), (4, 16, torch.float32), (3, 5, torch.float64)])
def test_a_bias_copied_per_layer_is_computed_once(heads, n, dtype):
    q, bias = data((1, heads, n, 8), dtype), data((n, n, heads), dtype, seed=1, spread=1.0)
    torch._dynamo.reset()
    ember.metrics.reset()
    check(per_layer_bias, q, bias)
    assert ember.metrics.pass_rewrites["cse"] >= 2  # the second and third copies
    assert ember.metrics.kernels_generated == 1  # one copy kernel, read by the three attention calls


@pytest.mark.parametrize("x", [data((6, 5)), transposed((6, 5)), data((7,), torch.int32)])
def test_equal_calls_merge_and_results_stay(x):
    def f(x):
        a, b = torch.abs(x) + 2, torch.abs(x) + 2  # equal chains: both calls of each merge
        return a * b, x.sum(0) + x.sum(0)

    gm = make_fx(f)(x)
    assert eliminate_common_subexpressions(gm.graph) == 3  # abs, add, sum
    assert targets(gm.graph).count(aten.abs.default) == 1
    gm.recompile()
    for got, want in zip(gm(x), f(x)):
        torch.testing.assert_close(got, want)
    check(f, x)


def test_constants_merge_only_when_exactly_equal():
    def f(i, x):
        # int + 1 stays int, int + 1.0 is float, int + True too; 0.0 and -0.0 multiply differently
        return i + 1, i + 1.0, i + True, x * 0.0, x * -0.0

    i, x = data((4,), torch.int64), torch.tensor([-1.0, 0.0, float("inf"), 2.0])
    gm = make_fx(f)(i, x)
    assert eliminate_common_subexpressions(gm.graph) == 0
    check(f, i, x)


def test_random_calls_and_mutating_graphs_are_left_alone():
    gm = make_fx(lambda x: (torch.rand_like(x), torch.rand_like(x)))(data((3,)))
    assert eliminate_common_subexpressions(gm.graph) == 0

    def mutating(x):
        before = x.clone()
        x.add_(1)
        return before * 2, x.clone() * 2

    gm = make_fx(mutating)(data((3,)))
    assert eliminate_common_subexpressions(gm.graph) == 0


def test_two_returned_copies_keep_their_own_storage():
    def f(x):
        y = x.t()
        return y.contiguous(), y.contiguous().view(-1), torch.exp(y.contiguous())

    x = data((4, 3))  # y is a transposed view: each contiguous() is a copy in eager
    out = check(f, x)
    assert out[0].data_ptr() != out[1].data_ptr()
    out[0].zero_()  # the caller owns each output: writing one leaves the other as it was
    torch.testing.assert_close(out[1], x.t().contiguous().view(-1))
