"""A value that reads many buffers and has several readers is realized, not recomputed by each
(Note: a sum of many buffers is realized, lower/graph.py); counted in ember.metrics.kernel_bytes."""

from __future__ import annotations

import pytest
import torch

import ember
from tests.helpers import check, data, transposed


def residual_stream(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    """A LLaMA-style stack: RMSNorm, a matmul, the result added to the residual stream."""
    for w in weights:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = x + normed @ w
    return x


def compiled_bytes(fn, *inputs) -> int:
    torch._dynamo.reset()
    ember.metrics.reset()
    check(fn, *inputs, rtol=1e-4, atol=1e-4)
    return ember.metrics.kernel_bytes


@pytest.mark.parametrize("rows, width, layers", [(64, 128, 6), (32, 256, 8), (48, 64, 10)])
def test_residual_stream_is_read_once_per_reader(rows, width, layers):
    x = data((rows, width), spread=1.0)
    weights = [data((width, width), seed=i + 1, spread=0.05) for i in range(layers)]
    # per layer: the norm reads the stream twice (its mean, then to normalize) and writes its
    # result; the next stream is realized from two buffers. Recomputing the stream from every
    # earlier layer's output in each norm read about six tensors' worth a layer
    assert compiled_bytes(residual_stream, x, *weights) <= 5 * layers * rows * width * 4


@pytest.mark.parametrize("x", [data((16, 32)), transposed((16, 32))])
def test_a_sum_of_many_buffers_with_one_reader_stays_inlined(x):
    def f(x, a, b, c, d, e):
        return (x + a + b + c + d + e).sum(-1)

    others = [data((16, 32), seed=i + 1) for i in range(5)]
    assert compiled_bytes(f, x, *others) == 6 * 16 * 32 * 4 + 16 * 4  # one kernel: each input once, the sums
    assert ember.metrics.kernels_generated == 1


def test_a_sum_of_many_buffers_with_two_readers_is_computed_once():
    def f(x, a, b, c, d):
        h = x + a + b + c + d
        return h.sum(0), h.sum(1), h * 2

    inputs = [data((24, 40), seed=i) for i in range(5)]
    check(f, *inputs)
    assert ember.metrics.kernel_bytes <= (5 + 1) * 24 * 40 * 4 + (24 + 40) * 4 + 2 * 24 * 40 * 4
