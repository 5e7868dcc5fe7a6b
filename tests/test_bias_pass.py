"""passes/bias.py: a product's or a GPU convolution's bias added by the ember kernels that read the
result (Note: bias in ember's kernels).

Which graphs are rewritten is checked on fake CUDA tensors (no GPU needed); that a rewritten
graph computes what the original did is checked by running both eagerly on CPU tensors, biases
with NaN and infinities included; with EMBER_TEST_DEVICE=cuda, the compiled models run on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import ember
from ember.config import Config
from ember.lower.decompositions import decomposition_table
from ember.passes import run_passes
from tests.helpers import check, data

aten = torch.ops.aten
SPECIAL = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, -0.0, 1.0])


def traced_on(device: str, fn, *shapes, dtype: torch.dtype = torch.float32):
    """fn's aten graph, traced on fake tensors of `device` (a CUDA graph without a GPU)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = [torch.empty(s, device=device, dtype=dtype) for s in shapes]
        return make_fx(fn, decomposition_table=decomposition_table())(*inputs)  # as AOTAutograd gives it


def rewritten(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, dict]:
    after, rewrites = run_passes(gm, Config())
    return after, rewrites


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))


def linear_layer_norm(x, w, b):
    return F.layer_norm(F.linear(x, w, b), (x.shape[-1],))


def linear_matmul(x, w, b):
    return F.linear(x, w, b).transpose(1, 2) @ x


def conv1d_split_matmul(x, w, b):
    """GPT-2's attention input: an (in, out) weight's addmm, split into query, key and value."""
    q, k, v = torch.addmm(b, x.view(16, 8), w).view(2, 8, 6).split(2, dim=-1)
    return q @ k.transpose(1, 2) @ v


def linear_returned(x, w, b):
    y = F.linear(x, w, b)
    return y, y.relu()


def conv_layer_norm(x, w, b):
    y = F.conv2d(x, w, b, padding=1).permute(0, 2, 3, 1)
    return F.layer_norm(y, (y.shape[-1],))


def conv_relu(x, w, b):
    return F.conv2d(x, w, b, padding=1).relu()


def conv_returned(x, w, b):
    return F.conv2d(x, w, b, padding=1)


LINEAR = ((2, 8, 8), (8, 8), (8,))
CONV = ((2, 3, 6, 6), (4, 3, 3, 3), (4,))


def test_gpu_products_read_by_kernels_lose_their_bias():
    """On the GPU a reduction reader counts (a layer norm's statistics read the product as a
    pointwise op does); an extern (another product), or the caller, does not."""
    cases = ((linear_gelu, 1, LINEAR), (linear_layer_norm, 1, LINEAR), (linear_matmul, 0, LINEAR),
             (conv1d_split_matmul, 0, ((2, 8, 8), (8, 6), (6,))), (linear_returned, 0, LINEAR))  # fmt: skip
    for fn, expected, shapes in cases:
        after, rewrites = rewritten(traced_on("cuda", fn, *shapes))
        assert rewrites.get("matmul_bias", 0) == expected, fn.__name__
        assert (aten.addmm.default in targets(after)) == (not expected), fn.__name__


def test_half_precision_products_keep_their_bias():
    """A float16/bfloat16 product rounded before its bias is added would round twice."""
    for dtype in (torch.float16, torch.bfloat16):
        _, rewrites = rewritten(traced_on("cuda", linear_gelu, *LINEAR, dtype=dtype))
        assert rewrites.get("matmul_bias", 0) == 0, dtype


def test_cpu_products_count_only_pointwise_readers():
    """The CPU rule stays what was measured there (MKL's bias pass against a pointwise reader's)."""
    _, rewrites = rewritten(traced_on("cpu", linear_layer_norm, *LINEAR))
    assert rewrites.get("matmul_bias", 0) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_convolutions_read_by_kernels_lose_their_bias(dtype):
    """In any float dtype: eager's cuDNN convolution rounds its result before adding the bias too."""
    for fn, expected in ((conv_relu, 1), (conv_layer_norm, 1), (conv_returned, 0)):
        after, rewrites = rewritten(traced_on("cuda", fn, *CONV, dtype=dtype))
        assert rewrites.get("convolution_bias", 0) == expected, fn.__name__
        convolutions = [n for n in after.graph.nodes if n.target is aten.convolution.default]
        assert len(convolutions) == 1 and (convolutions[0].args[2] is None) == bool(expected), fn.__name__


def test_cpu_convolutions_keep_their_bias():
    _, rewrites = rewritten(traced_on("cpu", conv_relu, *CONV))
    assert rewrites.get("convolution_bias", 0) == 0


def test_rewritten_graphs_compute_what_the_traced_ones_did():
    """The GPU rewrites run eagerly on CPU tensors: the bias broadcast along the right dim, with
    NaN and infinities in it, and a transposed convolution's bias on its output channels."""

    def conv_transpose_relu(x, w, b):
        return F.conv_transpose2d(x, w, b, stride=2).relu()

    cases = [(linear_gelu, LINEAR), (linear_layer_norm, LINEAR), (conv_relu, CONV), (conv_layer_norm, CONV),
             (conv_transpose_relu, ((2, 4, 5, 5), (4, 3, 3, 3), (3,)))]  # fmt: skip
    for fn, shapes in cases:
        after, rewrites = rewritten(traced_on("cuda", fn, *shapes))
        assert sum(rewrites.values()) >= 1, fn.__name__
        inputs = [data(s) for s in shapes]
        inputs[-1] = SPECIAL.repeat(4)[: shapes[-1][0]] if fn is conv_relu or fn is linear_gelu else inputs[-1]
        want = fn(*inputs)
        got = after(*inputs)
        torch.testing.assert_close(got, (want,) if isinstance(got, tuple) else want, equal_nan=True)


def convnext_block(x, conv_w, conv_b, w1, b1, w2, b2):
    """ConvNeXt's block in short: a depthwise convolution, a channels-last layer norm, a linear,
    gelu, a linear, a residual add."""
    y = F.conv2d(x, conv_w, conv_b, padding=1, groups=x.shape[1]).permute(0, 2, 3, 1)
    y = F.layer_norm(y, (y.shape[-1],))
    return x + F.linear(F.gelu(F.linear(y, w1, b1)), w2, b2).permute(0, 3, 1, 2)


def test_a_convolution_block_compiles_right():
    """End to end (on the GPU with EMBER_TEST_DEVICE=cuda, where the biases go to ember's kernels),
    biases with NaN and infinities included."""
    weights = [data((8, 1, 3, 3), seed=1), data((8,), seed=2), data((32, 8), seed=3, spread=0.5),
               data((32,), seed=4), data((8, 32), seed=5, spread=0.5), data((8,), seed=6)]  # fmt: skip
    check(convnext_block, data((2, 8, 5, 5)), *weights, rtol=1e-4, atol=1e-4)
    weights[1] = SPECIAL.clone()
    weights[3] = SPECIAL.repeat(4)
    check(convnext_block, data((2, 8, 5, 5)), *weights, rtol=1e-4, atol=1e-4)
    assert ember.metrics.fallback_calls == 0
