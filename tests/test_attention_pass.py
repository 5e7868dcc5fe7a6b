"""passes/attention.py: attention written out by hand becomes one flash-attention call, and
nothing else does. Results against eager float64; the rewrite counted in
`ember.metrics.pass_rewrites["attention"]`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import check, data


@pytest.fixture(autouse=True)
def _cpu_graphs(monkeypatch):
    """The rewrite targets the CPU's flash attention; CUDA graphs go through unchanged."""
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")


def attention_div(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def attention_mul(q, k, v):
    return F.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.3, dim=3) @ v


def attention_unscaled(q, k, v):
    return (q @ k.mT).softmax(-1) @ v


def heads(batch, seq, heads, dim, seed, dtype=torch.float32):
    """A [batch, heads, seq, dim] view of a [batch, seq, heads*dim] projection (as attention layers make)."""
    return data((batch, seq, heads * dim), dtype, seed=seed, spread=1.0).view(batch, seq, heads, dim).transpose(1, 2)


@pytest.mark.parametrize("fn", [attention_div, attention_mul, attention_unscaled])
@pytest.mark.parametrize("shape", [(2, 16, 4, 8), (1, 33, 2, 64), (3, 7, 1, 24)])
def test_written_out_attention_is_one_call(fn, shape):
    batch, seq, n_heads, dim = shape
    q, k, v = (heads(batch, seq, n_heads, dim, seed) for seed in range(3))
    check(fn, q, k, v)
    assert ember.metrics.pass_rewrites["attention"] == 1


def test_contiguous_operands_and_float64():
    q, k, v = (data((2, 3, 20, 16), torch.float64, seed=s, spread=1.0) for s in range(3))
    check(attention_div, q, k, v)
    assert ember.metrics.pass_rewrites["attention"] == 1


def test_longer_keys():
    q = data((2, 2, 12, 16), seed=0, spread=1.0)
    k, v = (data((2, 2, 40, 16), seed=s, spread=1.0) for s in (1, 2))
    check(attention_div, q, k, v)
    assert ember.metrics.pass_rewrites["attention"] == 1


def channel_attention(q, k, v):
    """DaViT's channel attention: softmax(k^T v) @ q^T, every operand transposed (last dim strided)."""
    return (torch.softmax(k.mT @ v * 0.2, dim=-1) @ q.mT).mT


@pytest.mark.parametrize("shape", [(2, 16, 3, 8), (1, 40, 2, 32)])
def test_operands_strided_in_the_head_dim_are_left_alone(shape):
    """The CPU flash kernel reads each operand's last dim as contiguous whatever its stride (eager's
    dispatch runs its math kernel for such operands): written-out attention over transposed operands
    keeps its pieces. Before, ember returned wrong values, different at each call."""
    q, k, v = (heads(*shape, seed) for seed in range(3))
    first = check(channel_attention, q, k, v)
    assert ember.metrics.pass_rewrites["attention"] == 0
    compiled = torch.compile(channel_attention, backend="ember", dynamic=False)
    assert all(torch.equal(first, compiled(q, k, v)) for _ in range(3))  # no reads of stale memory


def test_a_wider_value_is_left_alone():
    """The CPU flash attention wants one head size for q, k and v."""
    q = data((2, 2, 12, 16), seed=0, spread=1.0)
    k, v = data((2, 2, 40, 16), seed=1, spread=1.0), data((2, 2, 40, 24), seed=2, spread=1.0)
    check(attention_div, q, k, v)
    assert ember.metrics.pass_rewrites["attention"] == 0


def weights_too(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / 8.0, dim=-1)
    return weights @ v, weights


def masked(q, k, v):
    scores = q @ k.transpose(-2, -1) / 8.0
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def broadcast_key(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v  # k, v: one head for all


def softmax_over_queries(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v


@pytest.mark.parametrize("fn", [weights_too, masked, softmax_over_queries])
def test_other_graphs_are_left_alone(fn):
    q, k, v = (heads(2, 16, 4, 8, seed) for seed in range(3))
    check(fn, q, k, v)
    assert ember.metrics.pass_rewrites["attention"] == 0


def test_broadcast_heads_are_left_alone():
    q = heads(2, 16, 4, 8, 0)
    k, v = (data((2, 1, 16, 8), seed=s, spread=1.0) for s in (1, 2))
    check(broadcast_key, q, k, v)
    assert ember.metrics.pass_rewrites["attention"] == 0


def test_training_keeps_the_pieces():
    """The forward saves the weights for the backward: the pattern's weights have another reader."""
    q, k, v = (heads(2, 16, 4, 8, seed).detach().requires_grad_() for seed in range(3))
    torch._dynamo.reset()
    compiled = torch.compile(attention_div, backend="ember", dynamic=False)
    compiled(q, k, v).sum().backward()
    grads = [t.grad for t in (q, k, v)]
    reference = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_div(*reference).sum().backward()
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got.double(), want.grad, rtol=1.3e-5, atol=1e-5)
    assert ember.metrics.pass_rewrites["attention"] == 0


# ---- grouped-query attention (Note: grouped-query attention reads its shared heads) ----------


def repeat_kv(x, repeats):
    """LLaMA's repeat_kv: each of x's heads `repeats` times in a row."""
    batch, kv_heads, length, dim = x.shape
    return (
        x[:, :, None, :, :]
        .expand(batch, kv_heads, repeats, length, dim)
        .reshape(batch, kv_heads * repeats, length, dim)
    )


def gqa(repeats, causal=False):
    def attend(q, k, v, *mask):
        return F.scaled_dot_product_attention(
            q, repeat_kv(k, repeats), repeat_kv(v, repeats), attn_mask=mask[0] if mask else None, is_causal=causal
        )

    return attend


GQA_SHAPES = [(1, 128, 2, 4, 64), (2, 33, 3, 2, 16), (3, 7, 1, 8, 24), (2, 16, 4, 2, 8)]  # B, L, Hkv, R, E


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("batch", "seq", "kv_heads", "repeats", "dim"), GQA_SHAPES)
def test_repeated_key_value_heads_are_read_shared(batch, seq, kv_heads, repeats, dim, dtype):
    q = heads(batch, seq, kv_heads * repeats, dim, 0, dtype)
    k, v = (heads(batch, seq, kv_heads, dim, seed, dtype) for seed in (1, 2))  # strided: views of projections
    check(gqa(repeats), q, k, v)
    assert ember.metrics.pass_rewrites["grouped_query_attention"] == 1
    assert ember.metrics.kernels_generated == 0  # no copies of k and v


def test_repeated_heads_with_masks():
    q, k, v = heads(2, 20, 8, 16, 0), heads(2, 20, 2, 16, 1), heads(2, 20, 2, 16, 2)
    mask = data((2, 1, 20, 20), seed=3, spread=1.0)
    check(gqa(4), q, k, v, mask)
    assert ember.metrics.pass_rewrites["grouped_query_attention"] == 1
    check(gqa(4, causal=True), q, k.contiguous(), v)
    assert ember.metrics.pass_rewrites["grouped_query_attention"] == 2  # counted over both graphs


def test_repeated_heads_strided_in_the_head_dim_are_left_repeated():
    """The shared heads the GQA rule would hand the flash kernel must be contiguous in the head dim."""
    q = heads(2, 16, 8, 8, 0)
    k, v = (data((2, 2, 8, 16), seed=s, spread=1.0).mT for s in (1, 2))  # [B, Hkv, L, E] with E strided
    check(gqa(4), q, k, v)
    assert ember.metrics.pass_rewrites["grouped_query_attention"] == 0


def tiled_heads(q, k, v):
    """k's heads repeated in turn (head h reads kv head h % Hkv), not each in a row: not GQA's order."""
    return F.scaled_dot_product_attention(q, k.repeat(1, 4, 1, 1), v.repeat(1, 4, 1, 1))


def repeated_key_read_twice(q, k, v):
    keys = repeat_kv(k, 4)
    return F.scaled_dot_product_attention(q, keys, repeat_kv(v, 4)), keys.sum()


@pytest.mark.parametrize("fn", [tiled_heads, repeated_key_read_twice])
def test_other_repeats_are_left_alone(fn):
    q, k, v = heads(2, 16, 8, 8, 0), heads(2, 16, 2, 8, 1), heads(2, 16, 2, 8, 2)
    check(fn, q, k, v)
    assert ember.metrics.pass_rewrites["grouped_query_attention"] == 0


def test_training_keeps_the_repeated_heads():
    q, k, v = (heads(2, 16, h, 8, seed).detach().requires_grad_() for seed, h in ((0, 8), (1, 2), (2, 2)))
    torch._dynamo.reset()
    compiled = torch.compile(gqa(4), backend="ember", dynamic=False)
    compiled(q, k, v).sum().backward()
    reference = [t.detach().double().requires_grad_() for t in (q, k, v)]
    gqa(4)(*reference).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), reference):
        torch.testing.assert_close(got.double(), want.grad, rtol=1.3e-5, atol=1e-5)
