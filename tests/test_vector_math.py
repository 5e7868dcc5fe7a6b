"""ember's inline float32 vector math (renderer/vector_math.py, Note: vector math): its error
bound over a dense sweep of every float32 bit pattern, and eager's NaN/inf/-0/denormal results."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.vector_math import bit_patterns, ulp_error
from ember.renderer.vector_math import MAX_ULP
from tests.helpers import check, compile_fn


@pytest.mark.parametrize("name", list(MAX_ULP))
def test_error_bound_over_a_dense_sweep_of_float32(name):
    fn = getattr(torch, name)
    x = bit_patterns(12345, 2**32, 997)  # 4.3M inputs spread over every exponent and sign
    got = compile_fn(lambda t: fn(t))(x)
    worst = ulp_error(got, fn(x.double())).max().item()
    assert worst <= MAX_ULP[name], f"{name}: {worst} ulp"


EDGES = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 1.17549435e-38, 1e-20,
         0.9277, 0.92770004, -0.9277, 3.9999998, 4.0, 4.0000005, 3.4028235e38, -3.4028235e38, 10.0, -10.0]  # fmt: skip


@pytest.mark.parametrize("name", list(MAX_ULP))
def test_special_values_as_eager(name):
    fn = getattr(torch, name)
    x = torch.tensor(EDGES, dtype=torch.float32)
    got, eager = compile_fn(lambda t: fn(t))(x), fn(x)
    assert torch.equal(got.isnan(), eager.isnan())
    finite = ~eager.isnan()
    assert torch.equal(got[finite].isinf(), eager[finite].isinf())
    assert torch.equal(got[finite].signbit(), eager[finite].signbit())  # -0 stays -0
    assert ulp_error(got, fn(x.double())).max().item() <= MAX_ULP[name]


@pytest.mark.parametrize("shape", [(7,), (33, 65), (0, 3), ()])
def test_gelu_with_inline_erf(shape):
    x = torch.randn(shape) * 3
    check(torch.nn.functional.gelu, x)
    check(lambda t: torch.nn.functional.gelu(t.t()), torch.randn(65, 33) * 3)  # strided
