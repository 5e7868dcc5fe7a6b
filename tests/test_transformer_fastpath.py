"""The transformer fast-path ops (lower/transformer_fastpath.py) against eager's fused kernels.

Eager's reference runs on the test device, where the fused kernels differ by device (gelu is
exact on the CPU, the tanh approximation on CUDA): each result is compared with eager's fast
path on float64 copies of the module and inputs, and with eager's own dtype for shape, dtype and
where NaN appears. Every supported case must leave no aten fallback behind.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.lower import transformer_fastpath
from tests.helpers import test_device as device

aten = torch.ops.aten
NEG_INF = float("-inf")


def encoder(dim=32, heads=4, ffn=64, norm_first=True, activation=F.relu, batch_first=True, seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        dim, heads, ffn, dropout=0.0, activation=activation, batch_first=batch_first, norm_first=norm_first
    )
    return layer.eval().to(device())


def attention(dim=32, heads=4, seed=0):
    torch.manual_seed(seed)
    return torch.nn.MultiheadAttention(dim, heads, dropout=0.0, batch_first=True).eval().to(device())


def randn(*shape, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype).to(device())


def as_float64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    return x


def traced_ops(fn, *inputs, **kwargs) -> set[str]:
    """The names of the functions in the graph dynamo captures from `fn` under no_grad."""
    names: set[str] = set()

    def capture(gm, example_inputs):
        names.update(getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=capture, dynamic=False)(*inputs, **kwargs)
    return names


def run(module, *inputs, call=None, fused: str | None = "_transformer_encoder_layer_fwd", **kwargs):
    """(ember's result, eager's in the same dtype, eager's on float64 copies), all under no_grad,
    of `call(module, *inputs, **kwargs)` (by default the module's forward). `fused`: the fast-path
    op dynamo's graph must hold (else the test would not test the decomposition)."""
    call = call or (lambda m, *xs, **kw: m(*xs, **kw))
    fn = lambda *xs, **kw: call(module, *xs, **kw)  # noqa: E731
    ops = traced_ops(fn, *inputs, **kwargs)
    assert fused is None or fused in ops, f"dynamo's graph has no {fused}: {sorted(ops)}"
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ember", dynamic=False)
    with torch.no_grad():
        got = compiled(*inputs, **kwargs)
        same = call(module, *inputs, **kwargs)
        wide = copy.deepcopy(module).double()
        precise = call(wide, *map(as_float64, inputs), **{k: as_float64(v) for k, v in kwargs.items()})
    return got, same, precise


def assert_matches(got, same, precise, rtol=1e-4, atol=2e-5):
    got, same, precise = (x if isinstance(x, tuple) else (x,) for x in (got, same, precise))
    for g, s, p in zip(got, same, precise, strict=True):
        if s is None:  # eager's undefined tensor (need_weights=False); compiled code answers an empty one
            assert g is None or g.numel() == 0
            continue
        assert g.shape == s.shape and g.dtype == s.dtype and g.device == s.device
        assert torch.equal(g.isnan(), s.isnan()), "NaN where eager has none, or the reverse"
        # values where eager is finite in both precisions (a NaN input may reach other positions
        # through CUDA's fused attention kernels, which skip NaN in their running max, than through
        # the float64 math path)
        finite = ~s.isnan() & ~p.isnan()
        torch.testing.assert_close(g.double()[finite], p.double()[finite], rtol=rtol, atol=atol)


def assert_decomposed():
    assert ember.metrics.graphs_failed == 0
    assert ember.metrics.fallback_calls == 0, f"went to aten: {dict(ember.metrics.fallback_ops)}"


def check_encoder(layer, x, **masks):
    assert_matches(*run(layer, x, **masks))
    assert_decomposed()


# -- the encoder layer ----------------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", [F.relu, F.gelu, "relu", "gelu", torch.nn.ReLU(), torch.nn.GELU()],
                         ids=["F.relu", "F.gelu", "str-relu", "str-gelu", "ReLU", "GELU"])  # fmt: skip
def test_encoder_layer_norm_placement_and_activation(norm_first, activation):
    check_encoder(encoder(norm_first=norm_first, activation=activation), randn(2, 8, 32))


@pytest.mark.parametrize(
    "batch, length, dim, heads, ffn",
    [(1, 1, 8, 2, 16), (3, 5, 16, 2, 24), (2, 17, 48, 6, 40), (4, 64, 64, 8, 128)],
)
def test_encoder_layer_shapes(batch, length, dim, heads, ffn):
    check_encoder(encoder(dim, heads, ffn, activation=F.gelu), randn(batch, length, dim))


def test_encoder_layer_float64():
    layer = encoder(activation=F.gelu).double()
    check_encoder(layer, randn(2, 8, 32, dtype=torch.float64))


def test_encoder_layer_non_contiguous_input():
    x = randn(8, 3, 32).transpose(0, 1)  # (3, 8, 32) seen through a transpose
    check_encoder(encoder(), x)


def test_encoder_layer_nonfinite_input_matches_eager():
    x = randn(2, 8, 32)
    x[1, 3, 5] = float("nan")
    check_encoder(encoder(), x)


def test_encoder_layer_sequence_first_takes_the_slow_path():
    """batch_first=False never reaches the fused op; the graph is the module's own ops."""
    layer = encoder(batch_first=False)
    assert "_transformer_encoder_layer_fwd" not in traced_ops(layer, randn(8, 2, 32))
    assert_matches(*run(layer, randn(8, 2, 32), fused=None))
    assert ember.metrics.fallback_calls == 0


# -- masks ----------------------------------------------------------------------------------


def padding(batch, length, padded, dtype=torch.bool):
    """A key padding mask hiding the last `padded[b]` positions of each sequence b."""
    mask = torch.arange(length).expand(batch, length) >= torch.tensor([length - p for p in padded])[:, None]
    if dtype is torch.bool:
        return mask.to(device())
    return torch.zeros(batch, length, dtype=dtype).masked_fill(mask, NEG_INF).to(device())


def causal(length, dtype=torch.bool):
    mask = torch.ones(length, length, dtype=torch.bool).triu(1)
    if dtype is torch.bool:
        return mask.to(device())
    return torch.zeros(length, length, dtype=dtype).masked_fill(mask, NEG_INF).to(device())


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32], ids=["bool", "float"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_layer_key_padding_mask(dtype, norm_first):
    check_encoder(encoder(norm_first=norm_first), randn(3, 8, 32), src_key_padding_mask=padding(3, 8, [0, 3, 7], dtype))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32], ids=["bool", "float"])
def test_encoder_layer_attention_mask(dtype):
    check_encoder(encoder(activation=F.gelu), randn(2, 8, 32), src_mask=causal(8, dtype))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32], ids=["bool", "float"])
def test_encoder_layer_both_masks(dtype):
    """Both masks are merged into one (B, H, L, L) mask of type 2."""
    layer, x = encoder(), randn(3, 8, 32)
    check_encoder(layer, x, src_mask=causal(8, dtype), src_key_padding_mask=padding(3, 8, [0, 2, 5], dtype))


def test_encoder_layer_per_head_attention_mask():
    """A 3-d (B * H, L, L) attention mask, viewed as (B, H, L, L) by merge_masks."""
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(2 * 4, 8, 8, generator=gen) < 0.3) & ~torch.eye(8, dtype=torch.bool)
    check_encoder(encoder(), randn(2, 8, 32), src_mask=mask.to(device()))


def test_encoder_layer_float_mask_hides_every_nonzero():
    """The native kernels turn a float mask into a bool one: -1 or 0.5 hides a key as -inf
    does, unlike the slow path, which adds the mask to the scores."""
    mask = torch.zeros(2, 8)
    mask[0, 2], mask[1, 5], mask[1, 6] = -1.0, 0.5, float("nan")
    check_encoder(encoder(), randn(2, 8, 32), src_key_padding_mask=mask.to(device()))


def test_encoder_layer_fully_masked_sequence_is_nan():
    layer, x = encoder(), randn(2, 8, 32)
    mask = padding(2, 8, [8, 1])
    got, same, precise = run(layer, x, src_key_padding_mask=mask)
    assert same[0].isnan().all() and not same[1].isnan().any()  # what eager's fused kernel gives
    assert_matches(got, same, precise)
    assert_decomposed()


def test_encoder_layer_fully_masked_query_row_is_nan():
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[3] = True  # query 3 sees no key
    layer, x = encoder(), randn(2, 8, 32)
    got, same, precise = run(layer, x, src_mask=mask.to(device()))
    assert same[:, 3].isnan().all() and not same[:, :3].isnan().any()
    assert_matches(got, same, precise)
    assert_decomposed()


# -- multi-head attention -------------------------------------------------------------------


MHA = "_native_multi_head_attention"


def test_multi_head_attention_module_takes_the_slow_path_under_dynamo():
    """Dynamo traces nn.MultiheadAttention's slow path whatever eager does; the fused op comes
    only from direct calls (as below) or from code compiled around the encoder layer's op."""
    mha, x = attention(), randn(2, 8, 32)
    assert MHA not in traced_ops(lambda x: mha(x, x, x), x)


@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_multi_head_attention_weights(need_weights, average, dtype):
    def fn(mha, x):
        return native_attention(mha, x, x, x, need_weights=need_weights, average=average)

    got, same, precise = run(attention().to(dtype), randn(2, 8, 32, dtype=dtype), call=fn, fused=MHA)
    assert_matches(got, same, precise)
    assert_decomposed()
    if need_weights:
        heads = () if average else (4,)
        assert got[1].shape == (2, *heads, 8, 8)


def native_attention(mha, q, k, v, mask=None, mask_type=None, need_weights=True, average=True):
    """The fused op as nn.MultiheadAttention's fast path calls it, or with distinct query, key and
    value."""
    return torch._native_multi_head_attention(
        q, k, v, mha.embed_dim, mha.num_heads, mha.in_proj_weight, mha.in_proj_bias,
        mha.out_proj.weight, mha.out_proj.bias, mask, need_weights, average, mask_type,
    )  # fmt: skip


def test_multi_head_attention_distinct_query_key_value():
    q, k, v = randn(2, 6, 32, seed=1), randn(2, 6, 32, seed=2), randn(2, 6, 32, seed=3)
    assert_matches(*run(attention(), q, k, v, call=native_attention, fused=MHA))
    assert_decomposed()


def test_multi_head_attention_shared_key_value():
    q, kv = randn(2, 6, 32, seed=1), randn(2, 6, 32, seed=2)
    assert_matches(*run(attention(), q, kv, call=lambda mha, q, kv: native_attention(mha, q, kv, kv), fused=MHA))
    assert_decomposed()


def mha_mask(kind: str, dtype: torch.dtype):
    """(mask, mask_type) for a (3, 7) input with 2 heads; each kind fully hides something."""
    if kind == "key-padding":
        return padding(3, 7, [0, 2, 7], dtype), 1  # the last sequence sees nothing: NaN
    if kind == "attention":
        mask = causal(7, dtype).clone()
        mask[4] = True if dtype is torch.bool else NEG_INF  # query 4 sees nothing
        return mask, 0
    gen = torch.Generator().manual_seed(5)
    full = torch.rand(3, 2, 7, 7, generator=gen) < 0.4
    full[1, 0, 2] = True
    return (full if dtype is torch.bool else torch.zeros(full.shape).masked_fill(full, -2.5)).to(device()), 2


@pytest.mark.parametrize("kind", ["key-padding", "attention", "merged"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32], ids=["bool", "float"])
@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
def test_multi_head_attention_masks(kind, dtype, need_weights, average):
    mask, mask_type = mha_mask(kind, dtype)

    def fn(mha, x, mask):
        return native_attention(mha, x, x, x, mask, mask_type, need_weights, average)

    assert_matches(*run(attention(dim=16, heads=2), randn(3, 7, 16), mask, call=fn, fused=MHA))
    assert_decomposed()


# -- what stays whole -----------------------------------------------------------------------


def test_empty_batch_falls_back_to_the_fused_op():
    layer, x = encoder(), randn(0, 8, 32)
    got, same, _ = run(layer, x)
    assert got.shape == same.shape == (0, 8, 32)
    assert ember.metrics.graphs_failed == 0
    assert ember.metrics.fallback_ops["aten._transformer_encoder_layer_fwd.default"] == 1


def test_training_graphs_never_see_the_fused_ops():
    """A training step (train mode, grad) runs the module's slow path: no fused op to decompose;
    eval mode with grad enabled is the slow path too."""
    for train in (True, False):
        layer = encoder().train(train)
        x = randn(2, 8, 32).requires_grad_()
        torch._dynamo.reset()
        ember.metrics.reset()
        out = torch.compile(layer, backend="ember")(x)
        out.sum().backward()
        want = layer(x.detach().requires_grad_())
        torch.testing.assert_close(out, want, rtol=1e-4, atol=2e-5)
        assert ember.metrics.graphs_compiled == 2 and ember.metrics.fallback_calls == 0


def encoder_args(layer, x, mask=None, mask_type=None):
    attn = layer.self_attn
    return (
        x, attn.embed_dim, attn.num_heads, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
        attn.out_proj.bias, False, layer.norm_first, layer.norm1.eps, layer.norm1.weight, layer.norm1.bias,
        layer.norm2.weight, layer.norm2.bias, layer.linear1.weight, layer.linear1.bias, layer.linear2.weight,
        layer.linear2.bias, mask, mask_type,
    )  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [
        "empty",
        "float16",
        "bfloat16",
        "wrong-mask-shape",
        "mask-type-none",
        "2d-mask-of-type-2",
        "3d-mask",
        "nested",
        "broadcast-qkv-bias",
    ],
)
def test_unsupported_cases_are_declined(case):
    """NotImplemented: the tracer keeps the aten op, which ember calls."""
    layer = encoder().cpu()
    x, mask, mask_type = torch.randn(2, 8, 32), None, None
    if case == "empty":
        x = torch.randn(2, 0, 32)
    elif case in ("float16", "bfloat16"):
        dtype = getattr(torch, case)
        layer, x = layer.to(dtype), x.to(dtype)
    elif case == "wrong-mask-shape":
        mask, mask_type = torch.zeros(2, 7, dtype=torch.bool), 1
    elif case == "mask-type-none":
        mask = torch.zeros(2, 8, dtype=torch.bool)
    elif case == "2d-mask-of-type-2":
        mask, mask_type = torch.zeros(8, 8, dtype=torch.bool), 2
    elif case == "3d-mask":
        mask, mask_type = torch.zeros(8, 8, 8, dtype=torch.bool), 2
    elif case == "nested":
        x = torch.nested.nested_tensor([torch.randn(3, 32), torch.randn(5, 32)])
    elif case == "broadcast-qkv-bias":
        layer.self_attn.in_proj_bias = torch.nn.Parameter(torch.zeros(1))
    with torch.no_grad():
        args = encoder_args(layer, x, mask, mask_type)
        assert transformer_fastpath.transformer_encoder_layer_fwd(*args) is NotImplemented
        mha = layer.self_attn
        mha_args = (x, x, x, 32, 4, mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight, mha.out_proj.bias, mask)
        assert transformer_fastpath.native_multi_head_attention(*mha_args, True, True, mask_type) is NotImplemented


@pytest.mark.parametrize("use_gelu", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("mask_type", [None, 0, 1, 2])
def test_decomposition_equals_the_native_op(use_gelu, norm_first, mask_type):
    """The decomposition run eagerly against aten's kernel on the test device, argument for
    argument (on CUDA that kernel's gelu is the tanh approximation, on the CPU exact)."""
    layer = encoder(norm_first=norm_first)
    x = randn(2, 8, 32)
    hidden = torch.rand(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)) < 0.3
    masks = {None: None, 0: causal(8), 1: padding(2, 8, [0, 3]), 2: hidden.to(device())}
    args = list(encoder_args(layer, x, masks[mask_type], mask_type))
    args[7] = use_gelu
    with torch.no_grad():
        want = aten._transformer_encoder_layer_fwd(*args)
        got = transformer_fastpath.transformer_encoder_layer_fwd(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5, equal_nan=True)
