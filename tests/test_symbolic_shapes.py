"""Graphs with dynamic shapes compiled once, their kernels taking sizes as arguments (Note: symbolic
sizes, ember/uop/variables.py); what cannot be compiled so is compiled per shape, with a reason."""

import math
import os
import random

import pytest
import torch

import ember
from ember.uop.dtypes import dtypes
from ember.uop.ops import BufferArg, Ops, RangeKind, UOp, substitute
from ember.uop.symbolic import simplify
from ember.uop.variables import variable

# every test here compiles for the CPU's C++ kernels; the Triton path's are in tests/test_symbolic_triton.py
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def check_shapes(model, make_inputs, shapes, dynamic=True, atol=1e-4):
    """`model` compiled once, run at every shape against float64 eager; returns the outputs."""
    compiled = torch.compile(model, backend="ember", dynamic=dynamic)
    reference = _upcast(model)
    with torch.no_grad():
        for shape in shapes:
            inputs = make_inputs(*shape)
            got = compiled(*inputs)
            want = reference(*[x.double() if x.is_floating_point() else x for x in inputs])
            for g, w in zip(_tensors(got), _tensors(want)):
                torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-4, atol=atol)


def _upcast(model):
    import copy

    return copy.deepcopy(model).double() if isinstance(model, torch.nn.Module) else model


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def assert_compiled_once(graphs=1):
    assert ember.metrics.graphs_failed == 0
    assert dict(ember.metrics.symbolic_fallbacks) == {}
    assert ember.metrics.shape_specializations == 0
    assert ember.metrics.symbolic_graphs == graphs


# ---- models -----------------------------------------------------------------------------------------


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=128)
    return GPT2LMHeadModel(config).eval()


def llama():
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=300, max_position_embeddings=128)  # fmt: skip
    return LlamaModel(config).eval()


def test_gpt2_compiles_once_for_every_batch_and_length():
    model = gpt2()
    shapes = [(2, 17), (3, 23), (4, 31), (2, 40), (3, 9), (4, 64), (2, 5)]
    check_shapes(model, lambda b, s: [torch.randint(0, 500, (b, s))], shapes)
    assert_compiled_once()


def test_bert_compiles_once():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                        vocab_size=300, max_position_embeddings=128)  # fmt: skip
    model = BertModel(config).eval()
    check_shapes(model, lambda b, s: [torch.randint(0, 300, (b, s))], [(2, 11), (3, 29), (2, 50)])
    assert_compiled_once()


def test_llama_compiles_once():
    check_shapes(llama(), lambda b, s: [torch.randint(0, 300, (b, s))], [(2, 11), (3, 29), (2, 50)])
    assert_compiled_once()


def test_a_generate_loop_with_a_kv_cache_compiles_twice():
    """Prefill and decode: two graphs. The prefill graph's KV cache outputs feed the decode graph;
    were they views (of a buffer reused with another layout), dynamo would guard on their `_base`
    and compile the decode graph again once fed its own plain outputs (Note: outputs are never views)."""
    from transformers.cache_utils import DynamicCache

    model = gpt2()
    reference = _upcast(model)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="ember", dynamic=True)
    ids = want_ids = torch.randint(0, 500, (1, 7))
    cache, want_cache = DynamicCache(), DynamicCache()
    with torch.no_grad():
        for _ in range(6):
            out, want = compiled(ids, cache=cache), reference(want_ids, cache=want_cache)
            torch.testing.assert_close(out.logits, want.logits.float(), rtol=1e-4, atol=1e-4)
            ids = want_ids = want.logits[:, -1:].argmax(-1)
            cache, want_cache = out.past_key_values, want.past_key_values
    # two graphs, neither compiled per shape; torch 2.13 traces both with symbolic sizes, torch 2.11
    # the prefill with static ones (seen on the GPU machine: symbolic_graphs 1, graphs_compiled 2)
    assert ember.metrics.graphs_failed == 0 and ember.metrics.shape_specializations == 0
    assert ember.metrics.graphs_compiled == 2 and ember.metrics.symbolic_graphs >= 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_outputs_are_never_views_where_eager_gives_none():
    """A linear over a 3-d input is a matmul viewed back to 3-d, and a buffer of the graph may
    take over a freed one's storage: eager's result of either has no `_base`, nor has ember's."""
    w = torch.randn(8, 16)

    def f(x):
        y = torch.nn.functional.linear(x, w)  # (b, s, 8) from an (b*s, 8) matmul
        z = (y * 2).transpose(0, 1).contiguous()  # a buffer that can reuse a freed one of its size
        return y, z.sin()

    compiled = torch.compile(f, backend="ember", dynamic=True)
    for shape in [(2, 3, 16), (3, 5, 16)]:
        x = torch.randn(shape)
        for got, want in zip(compiled(x), f(x)):
            torch.testing.assert_close(got, want)
            assert got._base is None and want._base is None
    assert_compiled_once()


def test_an_unspecialized_float_is_computed_in_kernels():
    """Under dynamic=True dynamo passes a Python float (math.pi) as a 0-d float64 tensor, which
    AOTAutograd casts with prims.convert_element_type and divides with true_divide: both lowered,
    none a call to aten at every step (GPT-2's gelu)."""
    import math

    def f(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    check_shapes(f, lambda n: [torch.randn(n, 16)], [(3,), (7,), (12,)])
    assert_compiled_once()
    assert dict(ember.metrics.fallback_ops) == {}


def test_a_symbolic_linear_picks_its_matmul_at_every_call(monkeypatch, tmp_path):
    """A linear with a symbolic row count is oneDNN's from LINEAR_MIN_MACS multiply-adds and
    aten's mm below, with the post-op applied either way (passes/mkldnn.py linear_by_size); the
    graph calling it is kept in the graph cache by that function's name."""
    from ember.passes import mkldnn

    if not mkldnn.applicable():
        pytest.skip("no oneDNN")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(256, 64),
                                torch.nn.Sigmoid(), torch.nn.Linear(64, 64, bias=False), torch.nn.Tanh())  # fmt: skip
    rows = [(3,), (300,), (5,), (2000,)]  # 3 * 64 * 256 multiply-adds: aten; 300 * 64 * 256: oneDNN
    assert 3 * 64 * 256 < mkldnn.LINEAR_MIN_MACS <= 300 * 64 * 256
    check_shapes(model, lambda n: [torch.randn(n, 64)], rows)
    assert_compiled_once()
    assert dict(ember.metrics.fallback_ops) == {}
    torch._dynamo.reset()
    ember.metrics.reset()
    check_shapes(model, lambda n: [torch.randn(n, 64)], rows)
    assert ember.metrics.graph_cache_hits == 1


@pytest.mark.parametrize("attr", ["none", "sigmoid", "tanh", "swish", "relu", "gelu"])
@pytest.mark.parametrize("path", ["aten", "onednn"])
def test_linear_by_size_is_the_onednn_linear(attr, path, monkeypatch):
    from ember.passes import mkldnn

    if not mkldnn.applicable():
        pytest.skip("no oneDNN")
    monkeypatch.setattr(mkldnn, "LINEAR_MIN_MACS", 1 << 40 if path == "aten" else 1)
    torch.manual_seed(0)
    x, w, b = torch.randn(7, 16), torch.randn(12, 16), torch.randn(12)
    algorithm = "tanh" if attr == "gelu" else ""
    for bias in (b, None):
        want = torch.ops.mkldnn._linear_pointwise.default(x, w, bias, attr, [], algorithm)
        got = mkldnn.linear_by_size(x, w, bias, attr, [], algorithm)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got.is_contiguous()


def test_pointwise_and_reductions_over_every_dim():
    def f(x, y):
        z = torch.softmax(x * 2 + y, dim=-1)
        mean, var = torch.var_mean(z, dim=0)
        return z.sum(1), mean * var, torch.nn.functional.layer_norm(x, x.shape[-1:]).amax(0)

    shapes = [(3, 33), (5, 8), (17, 2), (9, 130)]
    check_shapes(f, lambda n, m: [torch.randn(n, m), torch.randn(n, m)], shapes)
    assert_compiled_once()


def test_views_of_symbolic_sizes():
    def f(x):
        b, s, h = x.shape
        heads = x.view(b, s, 4, h // 4).permute(0, 2, 1, 3)  # h // 4: a size divided
        return (heads * 2).reshape(b * 4, s, h // 4).transpose(1, 2).contiguous() + x.sum(-1).view(b, 1, s).repeat(
            4, 1, 1
        )

    check_shapes(f, lambda b, s: [torch.randn(b, s, 16)], [(2, 3), (3, 7), (4, 5)])
    assert_compiled_once()


def test_slices_counted_from_the_end_of_a_symbolic_size():
    """x[:, -k:] of a symbolic size known to be at least k starts at size - k in ember's kernels (XCiT's
    last-row slice of a repeated norm), not in aten's slice."""

    def f(x):
        flat = x.reshape(x.shape[0], -1)  # at least 4 elements a row: its last 3, every other one
        return x[:, -1:] * 2, x[:, -2:, 1:] + 1, flat[:, -3::2].exp()

    check_shapes(f, lambda b, s: [torch.randn(b, s, 5)], [(2, 3), (3, 7), (4, 2)])
    assert ember.metrics.fallback_calls == 0, dict(ember.metrics.fallback_ops)
    # each graph dynamo makes (its own guards on s against 2 recompile once) compiled with symbolic sizes
    assert not ember.metrics.symbolic_fallbacks and ember.metrics.shape_specializations == 0


def test_a_batchnorm_after_a_pointwise_convolution_compiles_once():
    """Whether folding BatchNorm into a 1 x 1 convolution's weight pays compares the weight with the
    output, whose size has the symbolic batch: a speed guess, made on the example's size, not a guard
    (EfficientFormerV2 and TinyViT compiled once per batch size before)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(96, 96, 1), torch.nn.BatchNorm2d(96), torch.nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1), model[1].running_var.uniform_(0.5, 2)
    check_shapes(model, lambda b: [torch.randn(b, 96, 4, 4)], [(2,), (3,), (5,)])
    assert_compiled_once()


def test_a_symbolic_view_an_extern_reads_is_not_copied():
    """Attention's heads made contiguous and viewed as (batch * heads, seq, dim) for bmm: the view
    is the kernel's buffer read in eager's strides (lower/views.py symbolic_view), not a copy."""

    def f(x, w):
        b, s, _ = x.shape
        q = (x @ w).view(b, s, 4, 8).permute(0, 2, 1, 3).contiguous() * 2
        q = q.view(b * 4, s, 8)
        return torch.bmm(q, q.transpose(1, 2)).softmax(-1)

    w = torch.randn(32, 32)
    ember.metrics.reset()
    check_shapes(f, lambda b, s: [torch.randn(b, s, 32), w], [(2, 3), (3, 7), (4, 5)])
    assert_compiled_once()
    assert ember.metrics.kernels_generated == 2  # the heads' copy and the softmax


def test_a_reshape_that_copies_is_not_read_as_a_view():
    """PoolFormer's group norm of a convolution: the convolution's result is channels-last (passes
    layout.py), so flattening it (group_norm's `view(b, groups, -1)`, a reshape after the pass)
    copies it in eager. Read as a view of the channels-last buffer in the reshape's contiguous
    strides, every batch size but the first was wrong by the values' own size."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), torch.nn.GroupNorm(1, 8)).eval()
    check_shapes(model, lambda b: [torch.randn(b, 3, 8, 8)], [(2,), (3,), (5,)])


def test_a_pooled_norm_reads_its_statistics_once_per_row():
    """PoolFormer's token mixer, pool(norm(x)) - norm(x): the pool reads the norm at positions clamped
    into the image, min(max(h + k - 1, 0), s - 1), and the norm's statistics at that position's
    row, (flat // (c*s*s)) % b. Until a clamp was known below s (uop/symbolic_division.py
    exclusive_bound) that row did not fold to the pool's own, so the kernel recomputed the
    statistics' reductions over the whole row for each element and window position: quadratic in
    the image, minutes per call at timm's sizes. The symbolic kernel opens the static one's loops."""

    class TokenMixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.GroupNorm(1, 8)
            self.pool = torch.nn.AvgPool2d(3, 1, 1, count_include_pad=False)

        def forward(self, x):
            y = self.norm(x)
            return x + self.pool(y) - y

    torch.manual_seed(0)
    model = TokenMixer().eval()
    with torch.no_grad():
        torch.compile(model, backend="ember")(torch.randn(2, 8, 6, 6))
    static_loops = ember.metrics.reduce_loops
    torch._dynamo.reset()
    ember.metrics.reset()
    check_shapes(model, lambda b, s: [torch.randn(b, 8, s, s)], [(2, 6), (3, 10), (2, 5), (4, 7)])
    assert_compiled_once()
    assert ember.metrics.reduce_loops == static_loops


def test_padding_to_a_multiple_compiles_once():
    """A length padded up to a multiple of 8 (s - s % 8 + 8, as sdpa pads an attention mask on the
    GPU): the pad's emptiness check asks no guard of the padded size (lower/values.py known_zero)."""
    import torch.nn.functional as F

    def f(x):
        return F.pad(x, (0, 8 - x.shape[-1] % 8), value=-1.0) * 2

    check_shapes(f, lambda b, s: [torch.randn(b, s)], [(2, 3), (3, 9), (4, 16)])
    assert_compiled_once()


@torch.library.custom_op("ember_test::row_sums_of_aligned_rows", mutates_args=())
def row_sums_of_aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """A stand-in for CUDA's memory-efficient attention, which refuses a bias whose rows are not
    16-byte aligned: eager pads the bias to a multiple of 8 and passes a slice of it."""
    if x.stride(-2) % 8:
        raise RuntimeError(f"rows not aligned: stride {x.stride(-2)}")
    return x.sum(-1)


@row_sums_of_aligned_rows.register_fake
def _(x):
    return x.new_empty(x.shape[:-1])


def test_a_slice_of_a_padded_row_reaches_an_extern_in_eagers_strides():
    """The slice [..., :s] of a row padded to s - s % 8 + 8 is a strided read of the padded
    buffer whose row stride is that expression; the extern gets that view, as in eager, not a
    copy with rows s apart (lower/values.py symbolic_affine_coefficients)."""
    import torch.nn.functional as F

    def f(x):
        s = x.shape[-1]
        return row_sums_of_aligned_rows(F.pad(x * 2, (0, 8 - s % 8))[..., :s])

    check_shapes(f, lambda b, s: [torch.randn(b, s, s)], [(2, 11), (3, 13), (2, 21)])
    assert_compiled_once()


def test_mark_dynamic_on_one_dim():
    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum(-1)

    compiled = torch.compile(f, backend="ember")
    w = torch.randn(16, 8)
    for n in (3, 6, 11, 40):
        x = torch.randn(n, 16)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x, w), f(x.double(), w.double()).float(), rtol=1e-4, atol=1e-4)
    assert_compiled_once()


def test_sizes_one_and_zero_get_graphs_of_their_own():
    def f(x):
        return torch.softmax(x, -1).sum(0) * 3

    compiled = torch.compile(f, backend="ember", dynamic=True)
    for shape in [(5, 7), (1, 7), (0, 7), (9, 7), (5, 1)]:
        x = torch.randn(shape)
        torch.testing.assert_close(compiled(x), f(x.double()).float(), rtol=1e-5, atol=1e-5)
    assert ember.metrics.symbolic_graphs >= 1 and ember.metrics.graphs_failed == 0


def test_training_forward_and_backward_compile_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
    )
    reference = _upcast(model)
    compiled = torch.compile(model, backend="ember", dynamic=True)
    for batch in (5, 9, 12, 30):
        x = torch.randn(batch, 32)
        compiled(x).square().mean().backward()
        reference(x.double()).square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad.float(), rtol=1e-4, atol=1e-5)
            p.grad, q.grad = None, None
    assert_compiled_once(graphs=2)  # the forward and the backward


def test_gpt2_training_never_specializes():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=128, attn_pdrop=0,
                        resid_pdrop=0, embd_pdrop=0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    reference = _upcast(model)
    compiled = torch.compile(model, backend="ember", dynamic=True)
    for b, s in [(2, 9), (3, 17), (2, 30)]:
        ids = torch.randint(0, 300, (b, s))
        compiled(ids, labels=ids).loss.backward()
        reference(ids, labels=ids).loss.backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad.float(), rtol=1e-4, atol=1e-5)
            p.grad, q.grad = None, None
    assert ember.metrics.graphs_failed == 0 and dict(ember.metrics.symbolic_fallbacks) == {}
    assert ember.metrics.shape_specializations == 0 and ember.metrics.symbolic_graphs >= 2  # forwards and backwards


def test_a_refused_graph_is_compiled_per_shape_with_its_reason(monkeypatch):
    monkeypatch.setenv("EMBER_VERIFY", "1")  # it compares static layouts: a refusal
    compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="ember", dynamic=True)
    for n in (3, 5):
        x = torch.randn(n)
        torch.testing.assert_close(compiled(x), torch.sin(x) * 2 + 1)
    assert ember.metrics.symbolic_graphs == 0
    assert ember.metrics.symbolic_fallbacks["verify compares static layouts"] == 1
    assert ember.metrics.shape_specializations == 2


def test_a_size_decision_refuses_instead_of_guarding():
    """A graph whose lowering needs a concrete size (here: a reshape to a size only the
    data's shape tells) never guards on it silently: the symbolic compile either serves every
    shape or is refused with a reason, and every output is right."""

    def f(x):
        return x.reshape(-1, 6).softmax(-1) * x.shape[0]

    compiled = torch.compile(f, backend="ember", dynamic=True)
    for n in (4, 8, 12, 6):
        x = torch.randn(n, 3)
        torch.testing.assert_close(compiled(x), f(x.double()).float(), rtol=1e-5, atol=1e-5)
    assert ember.metrics.graphs_failed == 0
    assert ember.metrics.symbolic_graphs + ember.metrics.shape_specializations >= 1


# ---- the index rules for symbolic divisors ----------------------------------------------------------


def _evaluate(u: UOp, values: dict[UOp, int]) -> int:
    folded = simplify(substitute(u, {k: UOp.const(dtypes.index, v) for k, v in values.items()}))
    assert folded.op is Ops.CONST, folded
    return folded.arg


def test_division_by_size_variables_keeps_every_value():
    """Randomized: reshape-like index math over size variables, simplified, equals the original
    at random sizes and positions (C semantics: non-negative operands)."""
    rng = random.Random(0)
    s0, s1 = variable("s0", 2, 1 << 40), variable("s1", 2, 1 << 40)
    b = UOp.range(s0 * s1, 0)
    r = UOp.range(s1, 1, RangeKind.LOOP)
    c = UOp.range(UOp.const(dtypes.index, 64), 2)
    k = UOp.range(UOp.const(dtypes.index, 3), 3, RangeKind.REDUCE)
    one, zero = UOp.const(dtypes.index, 1), UOp.const(dtypes.index, 0)
    clamped = (r + k - one).alu(Ops.MAX, zero).alu(Ops.MIN, s1 - one)  # min(max(r + k - 1, 0), s1 - 1)
    flat = b * 64 + c
    expressions = [
        ((flat // (s1 * 64)) % s0) * (s1 * 64) + ((flat // 64) % s1) * 64 + flat % 64,
        (b // s1) * s1 + b % s1,
        (r * 64 + c) // 64 % s1,
        (b * s1 + r) // s1,
        (b * s1 + r) % s1,
        ((b // s1) % s0) * s1 * 3 + (b % s1) * 3,
        (c * s1 + clamped) // (s1 * 64),  # a pooling window's row: 0 (clamped < s1)
        (b * (s1 * 64) + c * s1 + clamped) // (s1 * 64) % s0,
        (c * s1 + clamped) % (s1 * 64),
    ]
    for e in expressions:
        simplified = simplify(e)
        for _ in range(40):
            v0, v1 = rng.randint(2, 9), rng.randint(2, 9)
            sizes = {s0: v0, s1: v1}
            at = {**sizes, b: rng.randrange(v0 * v1), r: rng.randrange(v1), c: rng.randrange(64), k: rng.randrange(3)}
            assert _evaluate(simplified, at) == _evaluate(e, at), (e, simplified, at)


def test_reshape_reads_fold_back_to_strided_reads():
    s0, s1 = variable("s0", 2, 1 << 40), variable("s1", 2, 1 << 40)
    b = UOp.range(s0 * s1, 0)
    c = UOp.range(UOp.const(dtypes.index, 64), 2)
    flat = b * 64 + c
    index = ((flat // (s1 * 64)) % s0) * (s1 * 64) + ((flat // 64) % s1) * 64 + flat % 64
    assert not any(u.op in (Ops.IDIV, Ops.MOD) for u in simplify(index).toposort)


def test_a_clamped_window_position_folds_to_its_row():
    """A pooling window's position clamped into the image, min(max(h + k - 1, 0), s - 1), is below s:
    the row of an (n, 8, s, s) tensor read there, viewed as (n, 8*s*s), is the window's own."""
    s, n = variable("s", 2, 1 << 40), variable("n", 2, 1 << 40)
    one, zero = UOp.const(dtypes.index, 1), UOp.const(dtypes.index, 0)
    b, channel, h, w = UOp.range(n, 0), UOp.range(UOp.const(dtypes.index, 8), 1), UOp.range(s, 2), UOp.range(s, 3)
    kh, kw = (UOp.range(UOp.const(dtypes.index, 3), i, RangeKind.REDUCE) for i in (4, 5))

    def clamp(x):
        return (x - one).alu(Ops.MAX, zero).alu(Ops.MIN, s - one)

    row_size = s * s * 8
    flat = b * row_size + channel * (s * s) + clamp(h + kh) * s + clamp(w + kw)
    assert simplify((flat // row_size) % n) is b


def test_a_read_across_padded_rows_is_a_strided_read():
    """axis0 * (s - s % 8 + 8) + axis1 (a slice of rows padded to a multiple of 8) is a strided
    read whose row stride is that expression, evaluating to the padded length at every s."""
    from ember.lower.values import symbolic_affine_coefficients

    s = variable("s", 2, 1 << 40)
    eight = UOp.const(dtypes.index, 8)
    padded = s - s % eight + eight
    rows, columns = UOp.range(s, 0), UOp.range(s, 1)
    found = symbolic_affine_coefficients(simplify(rows * padded + columns), {rows: 0, columns: 1})
    assert found is not None
    offset, strides = found
    assert offset == 0 and strides[1] == 1
    for n in (2, 7, 8, 11, 16, 250):
        assert _evaluate(strides[0], {s: n}) == n - n % 8 + 8


def test_element_forms_agree_at_symbolic_strides():
    """The element a kernel stores, written two ways at a symbolic stride, is one element: what lets
    a symbolic kernel store in place over a dying input (codegen/kernel.py choose_inplace) as a
    static one does (GPT-2's gelu over its matmul's result)."""
    from ember.uop.symbolic import element_form

    s0 = variable("s0", 2, 1 << 40)
    r0, r1 = UOp.range(s0, 0), UOp.range(s0, 1, RangeKind.LOOP)
    r2 = UOp.range(UOp.const(dtypes.index, 1024), 2)
    k = UOp.const(dtypes.index, 1024)
    read = (r1 + s0 * r0) * k + r2
    stored = r0 * (s0 * k) + r1 * k + r2
    assert element_form(read) == element_form(stored)
    assert element_form(read) != element_form(stored + UOp.const(dtypes.index, 1))
    c = UOp.const
    assert element_form((r2 * 64 + r1) * k) == element_form(r2 * c(dtypes.index, 65536) + r1 * k)  # static strides


# ---- the graph cache ---------------------------------------------------------------------------------

NEW_PROCESS = (
    "import sys, torch, ember\n"
    "f = lambda x, y: torch.softmax(x @ y, -1).sum(0)\n"
    "n = int(sys.argv[1])\n"
    "x, y = torch.randn(n, 8), torch.randn(8, n + 3)\n"
    "got = torch.compile(f, backend='ember', dynamic=True)(x, y)\n"
    "torch.testing.assert_close(got, f(x.double(), y.double()).float())\n"
    "m = ember.metrics\n"
    "print('METRICS', m.symbolic_graphs, m.graph_cache_hits, m.gcc_runs)\n"
)


def test_a_new_process_with_a_new_shape_loads_the_graph(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "EMBER_CACHE_DIR": str(tmp_path / "cache")}

    def run(n: int) -> list[str]:
        done = subprocess.run([sys.executable, "-c", NEW_PROCESS, str(n)], env=env, capture_output=True, text=True,
                              check=True)  # fmt: skip
        return next(line for line in done.stdout.splitlines() if line.startswith("METRICS")).split()[1:]

    assert run(6)[:2] == ["1", "0"]
    assert run(11) == ["1", "1", "0"]  # another shape: the same symbolic graph, loaded whole


def test_symbolic_shapes_off_never_loads_a_symbolic_graph(monkeypatch, tmp_path):
    """`symbolic_shapes` is not in the cache key: it decides which graph reaches compile_graph
    (the symbolic one, or a static one per shape), and each is keyed by its own code and layouts,
    so neither setting is ever served the other's entry."""

    def f(x):
        return torch.softmax(x * 2, -1).sum(0)

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))

    def run(symbolic: str) -> tuple[int, int, int]:
        monkeypatch.setenv("EMBER_SYMBOLIC_SHAPES", symbolic)
        torch._dynamo.reset()
        ember.metrics.reset()
        check_shapes(f, lambda n: [torch.randn(n, 7)], [(5,), (9,)])
        m = ember.metrics
        return m.symbolic_graphs, m.shape_specializations, m.graph_cache_hits

    assert run("1") == (1, 0, 0)
    assert run("0") == (0, 2, 0)
    assert run("1") == (1, 0, 1)
    assert run("0") == (0, 2, 2)


def test_a_slice_from_the_end_of_a_symbolic_size():
    """x[-3:] of a symbolic size runs in aten (its start needs the size's value), as a view of
    the input: the kernel after it must not store into it."""

    def f(x):
        return x[-3:] * 2

    compiled = torch.compile(f, backend="ember", dynamic=True)
    for n in (5, 8, 13):
        x = torch.randn(n, 6)
        before = x.clone()
        torch.testing.assert_close(compiled(x), f(before))
        assert torch.equal(x, before)
    assert_compiled_once()


def test_the_reason_is_in_the_debug_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_VERIFY", "1")
    monkeypatch.setenv("EMBER_DEBUG", "1")
    monkeypatch.setenv("EMBER_DEBUG_DIR", str(tmp_path))
    compiled = torch.compile(lambda x: x.cos() + 1, backend="ember", dynamic=True)
    x = torch.randn(5)
    torch.testing.assert_close(compiled(x), x.cos() + 1)
    assert "verify compares static layouts" in (tmp_path / "symbolic_fallbacks.txt").read_text()


def test_a_new_guard_raises_while_refused():
    """What makes a symbolic compile safe: a stage that branches on a symbolic size raises
    instead of adding a guard that the compiled graph would not check."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from ember.size_guards import guarding

    shape_env = ShapeEnv()
    n = shape_env.create_unspecified_symint_and_symbol(7, ConstantSource("n"), DimDynamic.DYNAMIC)
    with guarding(shape_env, admit=False), pytest.raises(Exception, match="Guard attempted"):
        bool(n > 5)
    assert bool(n > 5)  # afterwards the environment guards again
    assert not shape_env.frozen


def test_the_size_cap_of_32_bit_indexes_is_the_largest_that_fits():
    """A Triton kernel indexes in int32 while every size is at most its cap (Note: symbolic blocks,
    ember/codegen/blocks.py): with s0 * s1 * 1000 an index, the cap is the largest power of two C
    with C * C * 1000 within int32 (less the blocks' padding)."""
    from ember.codegen.blocks import BlockLimits, KernelShape, narrow_size_cap

    s0, s1 = variable("s0", 2, 2**62), variable("s1", 2, 2**62)
    index = s0 * s1 * 1000
    sink = UOp(Ops.SINK, dtypes.void, (index,))
    cap = narrow_size_cap(sink, KernelShape((), (), (), s0 * s1, 0), BlockLimits())
    limit = 2**31 - 1 - 2 * BlockLimits().persistent_row
    assert cap * cap * 1000 <= limit < (2 * cap) * (2 * cap) * 1000
    bounded = substitute(index, {s0: variable("s0", 2, cap), s1: variable("s1", 2, cap)})
    assert bounded.vmax <= limit
    # a size that no cap bounds (an index past int32 at the smallest sizes): none
    huge = UOp(Ops.SINK, dtypes.void, (s0 * (2**31),))
    assert narrow_size_cap(huge, KernelShape((), (), (), s0, 0), BlockLimits()) == 0


def test_a_pooling_window_over_symbolic_channels_last_walks_the_channels_innermost():
    """A max pool of NHWC activations with a symbolic image size: the output's strides are
    ((s + 3)//4)**2 * 32, (s + 3)//4 * 32, 32 and 1. Loop order ranks them as sizes grow, so the
    channels are innermost and the window keeps one accumulator per channel (Note: lane
    accumulators), as in the static kernel; ranked at the smallest size all but the channels'
    tied at 32, and the channels ended outside the image's rows (9x slower on a ResNet stem)."""
    from ember.codegen.phases import full_rewrite

    s = variable("s", 2, 2**20)
    side = (s + 3) // 4
    n, c, h, w = (UOp.range(size, i) for i, size in enumerate((4, 32, side, side)))
    k = UOp.range(3, 4, RangeKind.REDUCE)
    x = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg("p1", 1 << 20))
    out = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg("p0", 1 << 20))
    thirty_two = UOp.const(dtypes.index, 32)
    read = n * side * side * thirty_two * 4 + h * side * thirty_two * 4 + (w * 2 + k) * thirty_two + c
    load = UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, dtypes.float32, (x, read)),))
    written = n * side * side * thirty_two + h * side * thirty_two + w * thirty_two + c
    store = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, dtypes.float32, (out, written)),
                                         UOp(Ops.REDUCE, dtypes.float32, (load, k), Ops.MAX)))  # fmt: skip
    (acc,) = [u for u in full_rewrite(UOp(Ops.SINK, dtypes.void, (store,))).toposort if u.op is Ops.DEFINE_ACC]
    assert acc.arg.lanes == 32


def test_sizes_from_python_division_of_sizes():
    """math.ceil(n / 32) and math.floor(n / 5) of a symbolic size are torch's CeilToInt and
    FloorToInt of a true division (as an optimizer's foreach chunking, or efficient attention's
    padded logsumexp, computes them): index sizes."""

    def f(x):
        n = x.shape[0]
        return x.new_ones(math.ceil(n / 32)).cumsum(0), x[: n // 3 + math.floor(n / 5)] * 2

    check_shapes(f, lambda n: [torch.randn(n)], [(40,), (65,), (129,)])
    assert_compiled_once()


def test_slice_scatter_with_symbolic_bounds_is_a_kernel():
    """slice_scatter where the size or a bound is symbolic: the gradient of a language model's
    shifted logits (`logits[:, :-1]`) scatters into zeros up to `s - 1`, and a KV cache writes
    new rows at `past:`. Before, aten's slice_scatter ran it (a fallback in every GPT-2 backward)."""

    def f(base, src, new):
        n = base.shape[1]
        a = torch.slice_scatter(base, src, 1, 0, n - 1)  # rows 0 .. n-2
        cache = torch.cat([base, new], 1)
        b = torch.slice_scatter(cache, new * 2, 1, n)  # a cache's new rows, from a symbolic start
        c = torch.slice_scatter(base, (base * 3)[:, 1::2], 1, 1, None, 2)  # a step
        return a, b * 2, c

    def inputs(batch, n):
        base = torch.randn(batch, n, 3)
        base[0, 0, 0] = float("nan")
        return base, torch.randn(batch, n - 1, 3), torch.randn(batch, 5, 3)

    compiled = torch.compile(f, backend="ember", dynamic=True)
    for shape in [(2, 7), (3, 11), (2, 9)]:  # (odd lengths: the step slice guards on parity)
        args = inputs(*shape)
        for g, w in zip(compiled(*args), f(*(x.double() for x in args))):
            torch.testing.assert_close(g, w.float(), equal_nan=True)  # (NaN where base is kept, none where written)
    assert_compiled_once()
    assert dict(ember.metrics.fallback_ops) == {}


def test_a_float_of_sizes_in_pointwise_math_is_a_kernel():
    """`x * (m / n)` and interpolate's scale (out / in) are floats of sizes (SymFloats) under
    dynamic shapes: kernels read them as float64 values of the size variables, as Python computes
    them. Before, every op taking one ran aten's (21 muls in timm's ghostnetv2)."""
    import torch.nn.functional as F

    def f(x, y):
        scaled = x * (y.shape[0] / x.shape[0]) - (x.shape[0] / 3)
        return scaled + F.interpolate(y[None, None], size=x.shape[-1], mode="linear")[0, 0]

    compiled = torch.compile(f, backend="ember", dynamic=True)
    for n, m in [(6, 9), (7, 13), (10, 4)]:
        x, y = torch.randn(n), torch.randn(m)
        x[0] = float("inf")
        torch.testing.assert_close(compiled(x, y), f(x.double(), y.double()).float())
    assert_compiled_once()
    assert dict(ember.metrics.fallback_ops) == {}


def test_a_second_half_written_into_the_first_is_a_kernel():
    """`n - n//2`, the length of `x[:, n//2:]`, is known to be at least 1 for n >= 2 (its bounds:
    ember/uop/ops.py `_less_own_quotient`), so a slice_scatter of it is a kernel, not aten's,
    at odd and even n."""

    def f(x):
        n = x.shape[1]
        half = n - n // 2
        return torch.slice_scatter(x, x[:, n // 2 :] * 3, 1, 0, half) + 1

    compiled = torch.compile(f, backend="ember", dynamic=True)
    for n in (6, 7, 9, 12):
        x = torch.randn(2, n, 3)
        x[1, -1, 0] = float("inf")
        torch.testing.assert_close(compiled(x), f(x.double()).float())
    assert_compiled_once()
    assert dict(ember.metrics.fallback_ops) == {}
