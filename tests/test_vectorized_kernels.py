"""Patterns from the transformer models whose C++ loops must vectorize, against eager on
float64: sin and cos of one value (rotary embeddings; Note: cos through an alias), masked
fills with bool masks (attention masks), and reductions read through a broadcast."""

import math
from pathlib import Path

import pytest
import torch

import ember
from ember.runtime.cpu import simd_math_functions
from tests.helpers import check, cpu_kernels_only


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    flat = x.view(-1)
    if flat.numel() >= 4:
        flat[1] = math.nan
        flat[2] = math.inf
        flat[-1] = -math.inf
    return x


def rotary(q, freqs):
    """LLaMA's rotary embedding: sin and cos of the same angles, rotate_half by a cat."""
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    half = q.shape[-1] // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return q * cos + rotated * sin


SHAPES = [(1, 2, 7, 16), (2, 4, 33, 64), (1, 1, 1, 2), (3, 2, 128, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sin_and_cos_of_one_value(shape, dtype):
    x = torch.randn(shape, dtype=dtype) * 10
    check(lambda x: (x.sin() * 2 + x.cos(), x.cos() - x.sin()), x)
    assert ember.metrics.kernels_generated == 1
    assert ember.metrics.fallback_calls == 0


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sin_and_cos_with_nan_and_inf(shape):
    x = _with_specials(torch.randn(shape) * 100)
    check(lambda x: torch.stack((x.sin(), x.cos())), x)
    assert ember.metrics.fallback_calls == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rotary_embedding(shape, dtype):
    q = torch.randn(shape, dtype=dtype)
    positions = torch.arange(shape[-2], dtype=dtype)[:, None]
    inverse = 1.0 / (10000 ** (torch.arange(0, shape[-1], 2, dtype=dtype) / shape[-1]))
    check(rotary, q, positions * inverse, rtol=1e-4, atol=1e-4)
    assert ember.metrics.fallback_calls == 0


def test_rotary_embedding_on_strided_and_broadcast_inputs():
    q = torch.randn(2, 33, 4, 32).transpose(1, 2)  # (batch, heads, seq, dim), not contiguous
    freqs = torch.randn(33, 16).expand(2, 1, 33, 16)
    check(rotary, q, freqs, rtol=1e-4, atol=1e-4)
    assert ember.metrics.fallback_calls == 0


@cpu_kernels_only
@pytest.mark.skipif(not {("sin", 1), ("cos", 1)} <= set(simd_math_functions()), reason="no vector sin/cos here")
def test_sin_and_cos_of_one_value_call_no_scalar_sincos(tmp_path, monkeypatch):
    """gcc merges sin(x) and cos(x) into sincos, which has no vector version: the kernel
    must not import it (Note: cos through an alias)."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 1024)
    check(lambda x: x.sin() * x.cos(), x)
    objects = list((tmp_path / "kernels").rglob("*.so"))
    assert ember.metrics.kernels_generated == 1 and len(objects) == 1
    imported = Path(objects[0]).read_bytes()
    assert b"sincos" not in imported and b"cexpi" not in imported
    assert b"v_sinf" in imported and b"v_cosf" in imported  # libmvec's vector versions
