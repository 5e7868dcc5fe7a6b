"""passes/vector_matmul.py (Note: a vector times a matrix): a CPU float32 linear of one static row
becomes ember's reduction over the (out, in) weight; everything else keeps its matmul. Results
against float64 eager; what was rewritten from `ember.metrics`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import check, cpu_kernels_only, data

# sums of up to 2048 products of values up to about 16 (helpers.data's spread): float32 rounds each
# to about K * 2^-24 of the terms' size, whichever library sums them
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}

pytestmark = cpu_kernels_only  # a CPU pass: GPU graphs keep cuBLAS


def rewrites() -> int:
    return ember.metrics.pass_rewrites["vector_matmul"]


@pytest.mark.parametrize("out_features, in_features", [(300, 256), (1000, 777), (257, 2048)])
@pytest.mark.parametrize("bias", [True, False])
def test_one_row_linear_is_a_reduction(out_features, in_features, bias):
    x, w = data((1, in_features), seed=0), data((out_features, in_features), seed=1)
    if bias:
        check(F.linear, x, w, data((out_features,), seed=2), **TOLERANCE)
    else:
        check(F.linear, x, w, **TOLERANCE)
    assert rewrites() == 1
    assert ember.metrics.extern_calls == 0  # no aten matmul left


def test_one_row_of_a_3d_input():
    """A decode step's (1, 1, d) hidden state: the linear's matmul sees one row."""
    check(F.linear, data((1, 1, 128), seed=0), data((512, 128), seed=1), **TOLERANCE)
    assert rewrites() == 1


def test_nan_and_inf_propagate_as_eager():
    w = data((300, 256), seed=1)
    w[7, 3] = float("inf")
    w[9, 0] = float("nan")
    x = data((1, 256), seed=0)
    x[0, 5] = float("-inf")
    check(F.linear, x, w, **TOLERANCE)
    assert rewrites() == 1


def test_its_epilogue_fuses():
    """Bias and GELU read the reduction's result in the same kernel or the next: no extern."""
    check(lambda x, w, b: F.gelu(F.linear(x, w, b)), data((1, 256), seed=0), data((400, 256), seed=1),
          data((400,), seed=2), **TOLERANCE)  # fmt: skip
    assert rewrites() == 1 and ember.metrics.extern_calls == 0


def test_a_normalized_row_is_computed_once_for_a_wide_head():
    """The layer norm's output is realized, not recomputed for every row of the weight (Note:
    values recomputed under a broadcast, HEAVY_BROADCAST): two kernels, where inlined the norm
    and the product were one."""

    def decode_head(h, norm_w, norm_b, head):
        return F.linear(F.layer_norm(h, (256,), norm_w, norm_b), head)

    inputs = data((1, 256), seed=0), data((256,), seed=3), data((256,), seed=4), data((40000, 256), seed=1)
    check(decode_head, *inputs, **TOLERANCE)
    assert rewrites() == 1 and ember.metrics.kernels_generated == 2


@pytest.mark.parametrize(
    "case",
    ["two_rows", "weight_in_out", "float64", "small", "few_outputs"],
)
def test_left_to_the_matmul(case):
    """More than one row (BLAS reuses the weight from cache), a weight stored (in, out) (a column
    reduction, which oneDNN streams better), other dtypes, products too small to matter, and too
    few outputs to split among threads."""
    x, w = data((1, 256), seed=0), data((300, 256), seed=1)
    if case == "two_rows":
        check(F.linear, data((2, 256), seed=0), w, **TOLERANCE)
    elif case == "weight_in_out":
        check(torch.matmul, x, data((256, 300), seed=1), **TOLERANCE)
    elif case == "float64":
        check(F.linear, x.double(), w.double(), **TOLERANCE)
    elif case == "small":
        check(F.linear, x, data((16, 256), seed=1), **TOLERANCE)
    else:  # 100 x 4096: enough work, but too few outputs to share among a large machine's threads
        check(F.linear, data((1, 4096), seed=0), data((100, 4096), seed=1), **TOLERANCE)
    assert rewrites() == 0


def test_symbolic_rows_keep_the_matmul():
    """dynamic=True: the row count may be a prompt's, decided per call by the linear rules."""
    w = data((300, 256), seed=1)
    compiled = torch.compile(F.linear, backend="ember", dynamic=True)
    for rows in (3, 5):
        x = data((rows, 256), seed=rows)
        torch.testing.assert_close(compiled(x, w).double(), F.linear(x.double(), w.double()), **TOLERANCE)
    assert rewrites() == 0


def test_off_by_config(monkeypatch):
    monkeypatch.setenv("EMBER_VECTOR_MATMUL", "0")
    check(F.linear, data((1, 256), seed=0), data((300, 256), seed=1), **TOLERANCE)
    assert rewrites() == 0


def test_onednn_headroom_is_measured_on_eagers_graph():
    """oneDNN's scratchpad must fit under eager's peak (Note: oneDNN's scratchpad). The vector
    product is never materialized, so the headroom is measured before the rewrite: counted as
    eager's op by op, its (4000, 256) product would have raised eager's peak by 4 MB and let the
    other linear (a sigmoid post-op, 64 x 256 x 256) take a scratchpad that does not fit (66 KB at
    one thread, 64 KB of headroom: refused at any thread count)."""

    def two_linears(x1, wide, x2, w2, b2):
        return F.linear(x1, wide), torch.sigmoid(F.linear(x2, w2, b2))

    inputs = (data((1, 256), seed=0), data((4000, 256), seed=1), data((64, 256), seed=2), data((256, 256), seed=3),
              data((256,), seed=4))  # fmt: skip
    check(two_linears, *inputs, **TOLERANCE)
    assert rewrites() == 1
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == 0


def test_one_row_products_in_a_row_are_not_nested():
    """A LLaMA step on one token: the first layer's down projection feeds the second layer's
    RMSNorm and q projection, each a reduction over its outputs. Fused into the q projection's
    reduction it was computed again for each of its outputs (Note: the scheduler's
    inner_reduction_per_output; 1024 times over, 355 against 19 ms a token for 12 layers):
    refused, with its reason, and right."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                                      num_attention_heads=16, num_key_value_heads=4, vocab_size=1000,
                                      max_position_embeddings=64)  # fmt: skip
    model = transformers.LlamaModel(config).eval()
    reference = transformers.LlamaModel(config).eval().double()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 1000, (1, 1))
    with torch.no_grad():
        text = ember.explain(lambda i: model(input_ids=i).last_hidden_state, ids)
        got = torch.compile(model, backend="ember")(input_ids=ids).last_hidden_state
        want = reference(input_ids=ids).last_hidden_state
    assert "would be computed again for each of its outputs" in text
    assert ember.metrics.pass_rewrites["vector_matmul"] >= 14  # q, k, v, o, gate, up, down per layer
    torch.testing.assert_close(got.double(), want, **TOLERANCE)
