"""A fast subset of the OpInfo conformance sweep (tests/conformance.py), run in `make test`.

About fifty ops of PyTorch's op database, spanning pointwise ops, reductions, views,
indexing and pooling, each on its first two float32 sample inputs, in this process: every one must
match eager, reach ember as a graph and use no fallback extern. The full sweep is
`make conformance DTYPE=float32`; ops that still fail there are not listed here.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.conformance import load_ops, run_op

POINTWISE = [
    "add", "mul", "div.no_rounding_mode", "abs", "exp", "log", "sigmoid", "nn.functional.gelu", "clamp", "where",
    "maximum", "pow", "remainder", "addcmul", "acosh", "digamma", "copysign", "signbit", "nn.functional.elu",
    "round.decimals_3",
]  # fmt: skip
REDUCTIONS = [
    "sum", "mean", "amax", "prod", "argmax", "var", "max.reduction_with_dim", "any", "logsumexp",
    "linalg.vector_norm", "softmax", "nn.functional.layer_norm",
]  # fmt: skip
VIEWS = ["transpose", "permute", "reshape", "expand", "squeeze", "unsqueeze", "flatten", "diagonal", "unfold"]
POOLING = ["nn.functional.avg_pool2d", "nn.functional.max_pool2d", "nn.functional.adaptive_max_pool2d"]
INDEXING = [
    "gather", "index_select", "cat", "flip", "roll", "nn.functional.pad.constant", "take_along_dim",
    "nn.functional.embedding", "slice_scatter",
]  # fmt: skip
OPS = POINTWISE + REDUCTIONS + VIEWS + INDEXING + POOLING
SAMPLES = 2


@functools.cache
def float32_ops() -> dict:
    return load_ops(torch.float32, OPS)


@pytest.mark.parametrize("key", OPS)
def test_opinfo_float32(key):
    result = run_op(float32_ops()[key], torch.float32, SAMPLES)
    assert result.status == "pass", f"{key}: {result.status}: {result.reason}"
    assert result.graphs > 0, f"{key}: no graph reached ember"
    assert not result.fallback_ops, f"{key}: fallback externs {dict(result.fallback_ops)}"
