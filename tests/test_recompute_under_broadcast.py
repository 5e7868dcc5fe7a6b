"""lower/graph.py, Note: values recomputed under a broadcast: a value with a transcendental that
consumers read broadcast is computed once (its own kernel), not once per broadcast element;
asserted on ember.metrics kernel counts, results against eager float64."""

from __future__ import annotations

import pytest
import torch

import ember
from tests.helpers import check, data


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(q, k, inv_freq):
    """LLaMA's rotary embedding: cos/sin of [S, D] positions, applied to q [B, H, S, D] and k [B, Hkv, S, D]."""
    positions = torch.arange(q.shape[-2], dtype=torch.float32, device=q.device)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize("heads, kernels", [((4, 4), 2), ((8, 2), 3)])
def test_rotary_cos_sin_computed_once(heads, kernels):
    q_heads, kv_heads = heads
    q, k = data((2, q_heads, 128, 32), seed=0), data((2, kv_heads, 128, 32), seed=1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    check(rotary, q, k, inv_freq, rtol=1e-4, atol=1e-4)
    # cos and sin in one kernel of [128, 32], read by q's and k's kernels (one kernel when they have
    # the same heads; else two, launched as one: Note: horizontal fusion); inlined, they were computed
    # again for every batch and head in those
    assert ember.metrics.kernels_generated + ember.metrics.horizontal_kernels_saved == kernels


def test_a_value_read_at_its_own_size_stays_inlined():
    check(lambda x, y: (x.exp() * y, x.exp() + y), data((64, 32), seed=0), data((64, 32), seed=1))
    assert ember.metrics.kernels_generated == 1


def test_a_cheap_broadcast_value_stays_inlined():
    """No transcendental: reloading it would cost more than recomputing it."""
    check(lambda w, x: x * (w * 2 + 1), data((32,), seed=0), data((64, 16, 32), seed=1))
    assert ember.metrics.kernels_generated == 1


def test_a_broadcast_read_by_one_small_consumer_stays_inlined():
    """Twice over in all (under RECOMPUTED_TIMES): not worth a kernel of its own."""
    check(lambda w, x: x * w.exp(), data((1 << 15,), seed=0), data((2, 1 << 15), seed=1))
    assert ember.metrics.kernels_generated == 1


def test_a_small_broadcast_value_stays_inlined():
    """Computed again 6 x 60 times: cheaper than a kernel call of its own."""
    check(lambda x: x * x[:, :1].sigmoid(), data((4, 6, 5, 3), seed=0))
    assert ember.metrics.kernels_generated == 1


def test_rotary_cos_sin_computed_once_with_symbolic_sizes():
    """The same decision for a graph with symbolic sizes, taken at the example's sizes: without it
    a symbolic LLaMA's rotary kernel computed cos and sin for every head (about 3x the static
    graph's kernel time at (2, 50)). Checked at the example and at another sequence length."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    compiled = torch.compile(rotary, backend="ember", dynamic=True)
    for seq in (128, 96):
        q, k = data((2, 4, seq, 32), seed=0), data((2, 4, seq, 32), seed=1)
        got = compiled(q, k, inv_freq)
        want = rotary(q.double(), k.double(), inv_freq.double())
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
    assert ember.metrics.symbolic_graphs == 1
    assert ember.metrics.kernels_generated + ember.metrics.horizontal_kernels_saved == 2
