"""A fast, fixed slice of the OpInfo conformance sweep (tests/conformance.py), run in `make test`.

About fifty ops of PyTorch's op database, spanning pointwise ops, reductions, views,
indexing and pooling, each on its first two float32 sample inputs, in this process: every one must
match eager, reach ember as a graph and use no fallback extern. Then a slice of the layout
sweep: twenty ops of those families, their first two samples with every tensor input in each
non-contiguous layout (tests/conformance_layouts.py), in float32 and bfloat16. The full sweep
is `make conformance` (all ops, all samples, all layouts; `DTYPE=`, `VARIANTS=`).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.conformance import load_ops, run_op
from tests.conformance_layouts import VARIANTS, relayout

POINTWISE = [
    "add", "mul", "div.no_rounding_mode", "abs", "exp", "log", "sigmoid", "nn.functional.gelu", "clamp", "where",
    "maximum", "pow", "remainder", "addcmul", "acosh", "digamma", "copysign", "signbit", "nn.functional.elu",
    "round.decimals_3", "lerp", "addcdiv",
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


# the layout slice: each family once or twice, ops whose kernels index their inputs differently
LAYOUT_OPS = [
    "add", "where", "exp", "sum", "amax", "softmax", "var", "cumsum", "gather", "index_select", "cat",
    "nn.functional.embedding", "scatter_add", "index_put", "matmul", "nn.functional.avg_pool2d",
    "nn.functional.max_pool2d", "nn.functional.layer_norm", "flip", "nn.functional.conv2d",
]  # fmt: skip
LAYOUTS = [v for v in VARIANTS if v != "contiguous"]


@functools.cache
def layout_ops(dtype: torch.dtype) -> dict:
    return load_ops(dtype, LAYOUT_OPS)


@pytest.mark.parametrize("variant", LAYOUTS)
@pytest.mark.parametrize("key", LAYOUT_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opinfo_layouts(dtype, key, variant):
    if key not in layout_ops(dtype):
        pytest.skip(f"{key} has no OpInfo samples in {dtype}")
    result = run_op(layout_ops(dtype)[key], dtype, SAMPLES, variant)
    assert result.status in ("pass", "skip"), f"{key} [{variant}]: {result.status}: {result.reason}"
    assert result.status == "pass" or result.reason == "no samples in this layout", result.reason


def test_layout_variants_keep_shape_dtype_and_values_and_survive_cloning():
    from tests.conformance import clone

    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    index = torch.tensor([[0, 2], [1, 1]])
    for variant in LAYOUTS:
        (y, i), changed = relayout((x, index), variant)
        assert changed and y.shape == x.shape and y.dtype == x.dtype
        if variant != "expanded":  # an expand repeats its first slice: other values, on purpose
            assert torch.equal(y, x)
        copy = clone(y)
        assert copy.stride() == y.stride() and copy.storage_offset() == y.storage_offset(), variant
        assert torch.equal(copy, y) and copy.data_ptr() != y.data_ptr()
    assert relayout((x,), "transposed")[0][0].stride() == (60, 20, 1, 4)
    assert relayout((x,), "sliced")[0][0].stride() == (960, 160, 20, 2)
    assert relayout((x,), "expanded")[0][0].stride()[0] == 0
    assert relayout((x,), "offset")[0][0].storage_offset() == 3
    assert relayout((x,), "channels_last")[0][0].is_contiguous(memory_format=torch.channels_last)
    assert not relayout((torch.ones(3),), "transposed")[1]  # nothing to transpose: not run
