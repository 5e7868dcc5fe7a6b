"""FX graph passes (ember/passes): each pass on a graph before/after, results against eager
float64, counters in `ember.metrics.pass_rewrites`, and the user's pre/post hooks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import ember
from ember.errors import EmberError
from ember.passes import eliminate_dead_code, mkldnn
from ember.passes.matcher import FxPat, FxPatternMatcher
from ember.passes.noops import remove_noops
from tests.helpers import check, data, transposed


@pytest.fixture(autouse=True)
def _cpu_graphs(monkeypatch):
    """The passes rewrite CPU graphs (oneDNN, channels-last); CUDA graphs go through unchanged."""
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")


aten = torch.ops.aten
needs_mkldnn = pytest.mark.skipif(not mkldnn.applicable(), reason="torch built without oneDNN")


def targets(graph: torch.fx.Graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


def compiled(fn, **options):
    torch._dynamo.reset()
    return ember.compile(fn, dynamic=False, **options)


def graphs_after_passes(fn, *inputs, **options) -> list[torch.fx.Graph]:
    """The graphs lowering saw: captured by a post_passes hook (which runs last)."""
    seen: list[torch.fx.Graph] = []
    compiled(fn, post_passes=[seen.append], **options)(*inputs)
    return seen


# -- the matcher ------------------------------------------------------------------------------


def test_matcher_captures_literals_and_users():
    gm = make_fx(lambda x: (x * 1, x * True, torch.relu(x + 2)))(torch.randn(3))
    mul_one = FxPatternMatcher([(FxPat(aten.mul.Tensor, FxPat.var("x"), 1), lambda x: x)])
    assert mul_one.apply(gm.graph) == 1  # x*1 matched; x*True is not x*1
    assert targets(gm.graph).count(aten.mul.Tensor) == 1
    seen = []
    add_under_relu = FxPat(aten.relu.default, FxPat(aten.add.Tensor, FxPat.var("x"), FxPat.var("c"), one_user=True))
    FxPatternMatcher([(add_under_relu, lambda x, c, node: seen.append((x.op, c, node.target)))]).apply(gm.graph)
    assert seen == [("placeholder", 2, aten.relu.default)]


def test_matcher_overload_packets_and_declining_rules():
    gm = make_fx(lambda x: torch.sum(x, 0) + torch.sum(x))(torch.randn(3, 4))
    found = []
    FxPatternMatcher([(FxPat(aten.sum), lambda node: found.append(node.target))]).apply(gm.graph)
    assert sorted(map(str, found)) == ["aten.sum.default", "aten.sum.dim_IntList"]
    assert len(targets(gm.graph)) == 3  # rules returned None: nothing changed


# -- no-ops and DCE ---------------------------------------------------------------------------


def noop_chain(x: torch.Tensor) -> torch.Tensor:
    y = (x + 0) * 1 / 1 - 0
    y = y.to(torch.float32).view(x.shape).permute(1, 0).permute(1, 0)
    y = y.transpose(0, 1).transpose(0, 1).unsqueeze(0).squeeze(0)[:, :]
    return torch.sin(y) ** 1 + y.clone()


@pytest.mark.parametrize("x", [data((4, 6)), data((6, 4)).t(), torch.tensor([[float("nan"), -0.0, float("inf")]])])
def test_noops_removed(x):
    check(noop_chain, x)
    assert ember.metrics.pass_rewrites["noops"] >= 10
    (graph,) = graphs_after_passes(noop_chain, x)
    assert sorted(map(str, targets(graph))) == ["aten.add.Tensor", "aten.sin.default"]


def test_noops_keep_what_changes_the_value():
    def f(x, i):
        # promotion (int + 0.0 is float), broadcasting views, a real permute, a contiguous copy
        return i + 0.0, x.view(2, 12) * 1, x.permute(1, 0, 2), x.expand(2, 3, 4).transpose(0, 1).contiguous()

    check(f, data((2, 3, 4)), data((5,), torch.int64))
    (graph,) = graphs_after_passes(f, data((2, 3, 4)), data((5,), torch.int64))
    assert aten.add.Tensor in targets(graph) and aten.permute.default in targets(graph)


def test_noops_never_return_an_input_itself():
    x = data((3, 4))
    out = check(lambda x: (x * 1, (x + 0).view(12)), x)
    assert all(o.data_ptr() != x.data_ptr() for o in out)


def test_noops_keep_a_snapshot_of_a_mutated_input():
    def f(x):
        snapshot = x.clone()
        x.add_(1)
        return snapshot * 1, x

    x = data((5,))
    expected = x.clone()
    snapshot, mutated = compiled(f)(x)
    torch.testing.assert_close(snapshot, expected)
    torch.testing.assert_close(mutated, expected + 1)
    torch.testing.assert_close(x, expected + 1)


def test_noops_skip_graphs_that_mutate():
    def f(x):
        snapshot = x.clone()
        x.copy_(x * 2)
        return snapshot * 1

    gm = make_fx(f)(torch.randn(3))
    assert aten.copy_.default in targets(gm.graph)
    assert remove_noops(gm.graph) == 0


def test_dead_code_elimination():
    gm = make_fx(lambda x: torch.cos(x))(torch.randn(3))
    (x,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(x):
        gm.graph.call_function(aten.exp.default, (x,))
        gm.graph.call_function(aten.rand.default, ([3],))  # random: impure, stays
    assert eliminate_dead_code(gm.graph) == 1
    assert targets(gm.graph) == [aten.rand.default, aten.cos.default]
    assert remove_noops(gm.graph) == 0


def test_dce_of_what_a_user_pass_left_dead():
    def leave_dead_node(graph):
        x = next(n for n in graph.nodes if n.op == "placeholder")
        with graph.inserting_after(x):
            node = graph.call_function(aten.exp.default, (x,))
        node.meta["val"] = x.meta["val"]

    x = data((4,))
    torch.testing.assert_close(compiled(torch.sin, pre_passes=leave_dead_node)(x), torch.sin(x))
    assert ember.metrics.pass_rewrites["dce"] == 1


# -- user hooks -------------------------------------------------------------------------------


def test_hooks_run_in_order_around_embers_passes():
    calls = []

    def pre(graph):
        calls.append(("pre", type(graph), aten.mul.Tensor in targets(graph)))

    def post(graph):
        calls.append(("post", type(graph), aten.mul.Tensor in targets(graph)))

    x = data((8,))
    torch.testing.assert_close(compiled(lambda x: torch.sin(x * 1), pre_passes=[pre], post_passes=post)(x), x.sin())
    assert calls == [("pre", torch.fx.Graph, True), ("post", torch.fx.Graph, False)]


def sin_to_cos(graph):
    for node in graph.nodes:
        if node.target is aten.sin.default:
            node.target = aten.cos.default


def test_a_hook_rewrites_the_graph_and_the_cache_tells_them_apart():
    x = data((16,))
    torch.testing.assert_close(compiled(torch.sin, pre_passes=[sin_to_cos])(x), torch.cos(x))
    torch.testing.assert_close(compiled(torch.sin)(x), torch.sin(x))  # same graph in, different graph lowered
    torch.testing.assert_close(compiled(torch.sin, post_passes=[sin_to_cos])(x), torch.cos(x))


def test_a_failing_hook_is_named():
    def broken_pass(graph):
        raise ValueError("no thanks")

    message = r"stage 'passes'.*pre_passes\[0\] \(.*broken_pass\) raised ValueError: no thanks"
    with pytest.raises(Exception, match=message) as failure:
        compiled(torch.sin, pre_passes=[broken_pass])(data((3,)))
    assert isinstance(getattr(failure.value, "inner_exception", failure.value), EmberError)  # dynamo wraps it


def test_a_hook_that_breaks_the_graph_is_named():
    def use_before_definition(graph):
        sin = next(n for n in graph.nodes if n.target is aten.sin.default)
        with graph.inserting_after(sin):
            later = graph.call_function(aten.cos.default, (sin,))
        sin.args = (later,)

    with pytest.raises(Exception, match=r"post_passes\[0\] .*use_before_definition.* left an invalid graph"):
        compiled(torch.sin, post_passes=[use_before_definition])(data((3,)))


def test_a_failing_hook_falls_back_to_eager_unless_strict(monkeypatch):
    monkeypatch.setenv("EMBER_STRICT", "0")

    def broken_pass(graph):
        raise RuntimeError("boom")

    x = data((3,))
    with pytest.warns(UserWarning, match="broken_pass"):
        torch.testing.assert_close(compiled(torch.sin, pre_passes=[broken_pass])(x), torch.sin(x))
    assert ember.metrics.graphs_failed == 1


def test_hooks_must_be_callables():
    with pytest.raises(TypeError, match="pre_passes takes callables"):
        ember.compile(torch.sin, pre_passes=["sin_to_cos"])


def test_passes_can_be_turned_off():
    (graph,) = graphs_after_passes(lambda x: x * 1 + 1, data((3,)), passes=False)
    assert aten.mul.Tensor in targets(graph)
    assert not ember.metrics.pass_rewrites


def test_a_graph_cache_hit_skips_the_passes_and_counts_them():
    x = data((7,))
    compiled(lambda x: torch.sin(x * 1))(x)
    assert ember.metrics.pass_rewrites["noops"] == 1
    ember.metrics.reset()
    torch.testing.assert_close(compiled(lambda x: torch.sin(x * 1))(x), torch.sin(x))
    assert ember.metrics.graph_cache_hits == 1 and ember.metrics.pass_rewrites["noops"] == 1


def test_debug_dumps_the_graph_after_passes(tmp_path):
    compiled(lambda x: x * 1 + 1, debug=True, debug_dir=str(tmp_path))(data((3,)))
    (after,) = tmp_path.glob("*/fx_graph_after_passes.txt")
    (before,) = tmp_path.glob("*/fx_graph.txt")
    assert "aten.mul" in before.read_text() and "aten.mul" not in after.read_text()


# -- oneDNN rewrites and channels-last convolutions --------------------------------------------


def eval_model(*layers: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*layers).eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):  # non-trivial running statistics
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.2, 0.2)
    return model


def check_inference(model: nn.Module, *inputs, rtol: float = 1.3e-5, atol: float = 1e-5, **options):
    """The model compiled by ember against a float64 copy of it run eagerly (no autograd)."""
    with torch.no_grad():
        got = compiled(model, **options)(*inputs)
        expected = copy.deepcopy(model).double()(*[x.double() for x in inputs])
        eager = model(*inputs)
    assert got.shape == eager.shape and got.dtype == eager.dtype
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=atol, equal_nan=True)
    return got


@pytest.fixture
def small_linears(monkeypatch):
    """Rewrite the tests' small linears too (by default only those worth a oneDNN call); the
    graph cache, keyed by source and config, cannot tell the patched threshold apart."""
    monkeypatch.setattr(mkldnn, "LINEAR_MIN_MACS", 0)
    monkeypatch.setattr(mkldnn, "linear_scratchpad_bytes", lambda *args: 0)
    monkeypatch.setenv("EMBER_GRAPH_CACHE", "0")


@pytest.fixture
def free_scratchpad(monkeypatch):
    """oneDNN's scratchpad taken as free (Note: oneDNN's scratchpad): only the size rule decides."""
    monkeypatch.setattr(mkldnn, "linear_scratchpad_bytes", lambda *args: 0)
    monkeypatch.setenv("EMBER_GRAPH_CACHE", "0")


@needs_mkldnn
def test_small_linears_stay_with_aten(free_scratchpad):
    check_inference(eval_model(nn.Sequential(nn.Linear(64, 64), nn.Tanh())), data((128, 64)))
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == 0
    check_inference(eval_model(nn.Sequential(nn.Linear(64, 64), nn.Tanh())), data((256, 64)))
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == 2  # the linear, tanh its post-op


@needs_mkldnn
@pytest.mark.parametrize("activation, fused", [(nn.GELU(approximate="tanh"), True), (nn.Sigmoid(), True),
                                               (nn.Tanh(), True), (nn.ReLU(), False), (nn.GELU(), False)])  # fmt: skip
def test_linear_with_activation_is_one_onednn_call(activation, fused, small_linears):
    """A linear whose activation oneDNN applies as a post-op, read by another linear, is one call.
    Post-ops whose NaN/inf results differ from aten's (relu, exact gelu) stay ember kernels, which
    add the bias too, after aten's mm. The last linear (no bias, read by the caller) stays aten's:
    oneDNN would fuse nothing (Note: which library multiplies)."""
    model = eval_model(nn.Linear(24, 32), activation, nn.Linear(32, 8, bias=False))
    check_inference(model, data((6, 24)))
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == 2 * fused
    assert ember.metrics.pass_rewrites["matmul_bias"] == (not fused)
    assert ember.metrics.fallback_calls == 0
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, -0.0, 1.0] * 3)
    model[0].bias.data = special[:32] if len(special) >= 32 else torch.cat([special, special])[:32]
    check_inference(model, data((6, 24)))


@needs_mkldnn
def test_matmul_with_an_in_out_matrix(small_linears):
    """mm/addmm of an (in, out) matrix stored column-major: oneDNN reads its transpose as a
    row-major weight where it fuses an activation; and mm of two activations."""
    check(lambda b, x, w: torch.addmm(b, x, w), data((6,)), data((5, 4)), transposed((4, 6)))  # aten's addmm
    check(lambda x, y: torch.tanh(torch.mm(x, y.t().exp())), data((5, 4)), data((3, 4)))
    check(lambda x, y: torch.mm(x, y), data((5, 4)), transposed((4, 3)))  # nothing to fuse: aten's mm
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == 2  # tanh is a post-op
    assert ember.metrics.fallback_calls == 0


@needs_mkldnn
@pytest.mark.parametrize("rows", [5, 64])
def test_row_major_in_out_matrix_stays_with_aten(rows, small_linears):
    """GPT-2's Conv1D weight, (in, out) row-major: oneDNN would read it transposed, at up to
    twice aten's time (mkldnn.linear_of_matrix)."""
    check(lambda b, x, w: torch.addmm(b, x, w), data((6,)), data((rows, 4)), data((4, 6)))
    check(lambda x, w: torch.relu(torch.mm(x, w)), data((rows, 8)), data((8, 3)))
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == 0
    assert ember.metrics.fallback_calls == 0


class FeedForward(nn.Module):
    """ConvNeXt's and BERT's feed-forward: linear, exact gelu, linear, a layer scale, a residual add."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.fc2(nn.functional.gelu(self.fc1(x)))


@needs_mkldnn
@pytest.mark.parametrize("shape", [(6, 24), (2, 5, 24), (3, 1, 4, 24)])
def test_bias_is_added_by_the_kernel_that_reads_the_matmul(shape, small_linears):
    """Only ember's kernels read each linear's result, so both are aten's mm and their biases are
    added in the gelu and residual kernels: no addmm, no oneDNN call, two kernels (Note: which
    library multiplies)."""
    model = eval_model(FeedForward(24, 40))
    check_inference(model, data(shape))
    assert ember.metrics.pass_rewrites["matmul_bias"] == 2
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == 0
    assert ember.metrics.kernels_generated == 2
    with torch.no_grad():
        (graph,) = graphs_after_passes(model, data(shape))
    assert aten.addmm.default not in targets(graph) and targets(graph).count(aten.mm.default) == 2


@needs_mkldnn
def test_bias_added_by_a_kernel_keeps_nan_and_inf(small_linears):
    model = eval_model(FeedForward(24, 40))
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, -0.0, 1.0] * 5)
    model[0].fc1.bias.data = special
    for x in (data((6, 24)), transposed((24, 7)).t()):  # a transposed input too: mm reads it in place
        ember.metrics.reset()
        check_inference(model, x)
        assert ember.metrics.pass_rewrites["matmul_bias"] == 2


@needs_mkldnn
@pytest.mark.parametrize("rows", [5, 64])
def test_bias_of_a_row_major_in_out_matrix_is_added_by_the_kernel(rows, small_linears):
    """GPT-2's Conv1D (an addmm of a row-major (in, out) weight, which stays with aten) read by its
    gelu: mm, and the bias in the gelu's kernel."""
    check(lambda b, x, w: nn.functional.gelu(torch.addmm(b, x, w), approximate="tanh"), data((6,)),
          data((rows, 4)), data((4, 6)))  # fmt: skip
    assert ember.metrics.pass_rewrites["matmul_bias"] == 1 and ember.metrics.kernels_generated == 1


@needs_mkldnn
def test_bias_read_by_an_extern_or_the_caller_stays_in_the_matmul(small_linears):
    """A linear that attention reads, and one whose result is also returned, keep their biases:
    aten's addmm adds them (no kernel reads those results whole), not oneDNN, which costs more
    than addmm's bias pass (Note: which library multiplies)."""

    def attention(x, w, b):
        q = nn.functional.linear(x, w, b).view(2, 8, 2, 4).transpose(1, 2)
        return nn.functional.scaled_dot_product_attention(q, q, q)

    def returned(x, w, b):
        y = nn.functional.linear(x, w, b)
        return y, y.relu()

    for fn in (attention, returned):
        check(fn, data((2, 8, 8)), data((8, 8)), data((8,)))
        assert ember.metrics.pass_rewrites["matmul_bias"] == 0
        assert ember.metrics.pass_rewrites["mkldnn_linear"] == 0
        assert ember.metrics.extern_calls == 1 + (fn is attention)  # addmm (and attention)
        ember.metrics.reset()


@needs_mkldnn
def test_relu_post_op_is_opt_in(small_linears):
    model = eval_model(nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 4),
                       nn.ReLU())  # fmt: skip
    check_inference(model, data((2, 16)), mkldnn_relu=True)
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == 2 and ember.metrics.pass_rewrites["mkldnn_convolution"] == 1
    with torch.no_grad():
        (graph,) = graphs_after_passes(model, data((2, 16)), mkldnn_relu=True)
    assert aten.relu.default not in targets(graph)


@needs_mkldnn
def test_linear_on_batched_transposed_and_empty_inputs(small_linears):
    model = eval_model(nn.Linear(16, 12), nn.ReLU())
    check_inference(model, data((2, 5, 16)))
    check_inference(model, data((16, 7)).t())
    check_inference(model, data((0, 16)))
    check_inference(model, torch.tensor([[float("nan"), float("inf")] + [1.0] * 14]))


@needs_mkldnn
def test_linear_in_other_dtypes_and_training_is_left_alone(small_linears):
    model = eval_model(nn.Linear(8, 4), nn.ReLU()).double()
    check(model, data((3, 8), torch.float64))
    assert ember.metrics.pass_rewrites["mkldnn_linear"] == 0
    model = eval_model(nn.Linear(8, 4), nn.ReLU())  # with autograd: forward saves, backward uses mm
    x = data((3, 8)).requires_grad_()
    compiled_model = compiled(model)
    compiled_model(x).sum().backward()
    expected = x.detach().clone().requires_grad_()
    model(expected).sum().backward()
    torch.testing.assert_close(x.grad, expected.grad)


@needs_mkldnn
@pytest.mark.parametrize("bias", [False, True])
def test_convolution_batchnorm_relu_is_one_onednn_call(bias):
    model = eval_model(nn.Conv2d(3, 8, 3, padding=1, bias=bias), nn.BatchNorm2d(8), nn.ReLU(),
                       nn.Conv2d(8, 4, 3, stride=2, groups=2, dilation=2, bias=bias), nn.BatchNorm2d(4),
                       nn.AdaptiveAvgPool2d(1))  # fmt: skip
    check_inference(model, data((2, 3, 10, 12)), atol=3e-5)
    assert ember.metrics.pass_rewrites["mkldnn_convolution"] == 2
    assert ember.metrics.pass_rewrites["channels_last"] == 2
    assert ember.metrics.fallback_calls == 0
    with torch.no_grad():
        (graph,) = graphs_after_passes(model, data((2, 3, 10, 12)))
    assert targets(graph).count(torch.ops.mkldnn._convolution_pointwise.default) == 2
    assert aten.convolution.default not in targets(graph)
    assert aten.relu.default in targets(graph)  # oneDNN's relu post-op maps NaN to 0: opt-in only


@needs_mkldnn
@pytest.mark.parametrize("activation", [nn.Sigmoid(), nn.Tanh()])
def test_convolution_with_activation(activation):
    model = eval_model(nn.Conv2d(4, 6, 3), activation)
    check_inference(model, data((1, 4, 7, 9)).to(memory_format=torch.channels_last))
    assert ember.metrics.pass_rewrites["mkldnn_convolution"] == 1


def convolution_weights(graph: torch.fx.Graph) -> list:
    return [n.args[1] for n in graph.nodes if n.op == "call_function" and n.target in
            (aten.convolution.default, torch.ops.mkldnn._convolution_pointwise.default)]  # fmt: skip


@pytest.mark.parametrize("kernel, groups, stride, dilation", [(3, 1, 1, 1), (3, 2, 2, 2), (5, 1, 2, 1), (1, 1, 1, 1),
                                                              (3, 4, 1, 1)])  # fmt: skip
def test_spatial_convolution_weights_are_channels_last(kernel, groups, stride, dilation):
    """A kernel larger than 1 x 1 reads an OHWI weight (Note: channels-last weights, layout.py);
    a 1 x 1 or depthwise weight is OHWI already."""
    model = eval_model(nn.Conv2d(4, 8, kernel, stride=stride, dilation=dilation, groups=groups), nn.Tanh(),
                       nn.Conv2d(8, 4, kernel, padding=kernel // 2, groups=groups))  # fmt: skip
    for shape in [(1, 4, 11, 11), (3, 4, 12, 9)]:
        check_inference(model, data(shape), atol=2e-5)
    with torch.no_grad():
        (graph,) = graphs_after_passes(model, data((1, 4, 11, 11)))
    weights = [w.meta["val"] for w in convolution_weights(graph)]
    assert len(weights) == 2 and all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
    copied = [w for w in convolution_weights(graph) if w.op == "call_function"]
    convolutions = [m for m in model if isinstance(m, nn.Conv2d)]
    plain = [m for m in convolutions if not m.weight.is_contiguous(memory_format=torch.channels_last)]
    assert len(copied) == len(plain) == (0 if kernel == 1 else 1 if groups == 4 else 2)


def convolution_inputs(graph: torch.fx.Graph) -> list:
    """Per convolution of `graph`, in order: (its input is NHWC, its weight is OHWI-only, it is oneDNN's)."""
    found = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target in (aten.convolution.default,
                                                    torch.ops.mkldnn._convolution_pointwise.default):  # fmt: skip
            x, w = n.args[0].meta["val"], n.args[1].meta["val"]
            nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
            found.append((nhwc, not w.is_contiguous(), n.target is not aten.convolution.default))
    return found


@pytest.mark.parametrize("size", [16, 144])
def test_the_weight_bound_last_convolutions_stay_nchw(size):
    """Note: convolutions that stay NCHW (layout.py). On 16 x 16 images the last two convolutions
    (weights of 147K elements each, 18 and 288 times their outputs) read NCHW activations and
    their OIHW weights through aten. The second is weight-bound too (9 times its output), but a
    convolution after it is not, so it stays NHWC: one change of layout. On 144 x 144 no weight
    is 4 times its output: all NHWC."""
    model = eval_model(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 1024, 3, stride=4, padding=1),
                       nn.ReLU(), nn.Conv2d(1024, 32, 1), nn.Tanh(), nn.Conv2d(32, 512, 3, padding=1), nn.ReLU(),
                       nn.Conv2d(512, 32, 3, padding=1), nn.AdaptiveAvgPool2d(1))  # fmt: skip
    x = data((1, 3, size, size))
    check_inference(model, x, atol=3e-5)
    with torch.no_grad():
        (graph,) = graphs_after_passes(model, x)
    found = convolution_inputs(graph)
    assert [nhwc for nhwc, _, _ in found] == ([True, True, True, False, False] if size == 16 else [True] * 5), found
    if size == 16:  # the NCHW ones keep their OIHW weights and aten's convolution
        assert [(ohwi, onednn) for _, ohwi, onednn in found[3:]] == [(False, False)] * 2, found


@needs_mkldnn
@pytest.mark.parametrize("size, folded", [(2, 0), (16, 1)])
def test_batchnorm_is_folded_into_a_weight_no_larger_than_the_output(size, folded):
    """A 1 x 1 convolution's BatchNorm stays an ember kernel where folding it would cost a pass
    over a weight larger than the output (Note: when folding BatchNorm into the weight pays); a
    3 x 3 weight is copied into OHWI anyway, so its BatchNorm always folds."""
    model = eval_model(nn.Conv2d(64, 256, 1), nn.BatchNorm2d(256), nn.ReLU())
    check_inference(model, data((1, 64, size, size)), atol=3e-5)
    assert ember.metrics.pass_rewrites["mkldnn_convolution"] == folded
    ember.metrics.reset()
    model = eval_model(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU())
    check_inference(model, data((1, 64, 2, 2)), atol=3e-5)
    assert ember.metrics.pass_rewrites["mkldnn_convolution"] == 1


@needs_mkldnn
def test_convolution_epilogue_read_twice_is_not_folded():
    conv = eval_model(nn.Conv2d(3, 4, 3))

    def f(x):
        y = conv(x)
        return torch.relu(y), y * 2

    with torch.no_grad():
        x = data((1, 3, 6, 6))
        got = compiled(f)(x)
        expected = f(x)
    torch.testing.assert_close(got, expected)
    assert ember.metrics.pass_rewrites["mkldnn_convolution"] == 0


def test_a_result_read_by_two_stores_is_not_overwritten_in_place():
    """Two outputs of one kernel read an extern's result: neither may write over it
    (codegen/kernel.py choose_inplace)."""

    def f(a, b):
        y = a @ b
        return torch.relu(y), y * 2

    check(f, data((4, 5)), data((5, 3)))


@pytest.mark.parametrize("tail", [nn.Identity(), nn.ReLU()])
def test_channels_last_keeps_output_layouts(tail):
    """A convolution whose result the graph returns: copied back to eager's layout."""
    model = eval_model(nn.Conv2d(3, 4, 3, padding=1), tail)
    x = data((2, 3, 5, 5))
    out = check_inference(model, x)
    assert out.stride() == model(x).stride()
    assert ember.metrics.pass_rewrites["channels_last"] == 1


def test_channels_last_is_undone_when_the_forward_saves_activations():
    model = eval_model(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Conv2d(4, 2, 3), nn.Tanh())
    x = data((1, 3, 7, 7))
    compiled(model)(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert ember.metrics.pass_rewrites["channels_last"] == 0
    model.zero_grad()
    model(x).sum().backward()
    for got, expected in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_a_view_of_an_nhwc_activation_becomes_a_reshape():
    """Eager flattens a convolution's NCHW result with a view ((N, C, H, W) -> (N * C, H * W));
    the same view of the NHWC result this pass makes does not exist (ResNet-50's training graph
    fell back to eager on it): it becomes a reshape, and the convolution still reads NHWC."""

    class Flattened(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(36, 4)

        def forward(self, x):
            return self.head(torch.relu(self.conv(x)).view(16, 36))

    check_inference(Flattened().eval(), data((2, 3, 6, 6)))
    assert ember.metrics.pass_rewrites["channels_last"] == 1


def test_channels_last_convnet_matches_eager_without_onednn_fusion():
    model = eval_model(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                       nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))  # fmt: skip
    check_inference(model, data((2, 3, 9, 9)), mkldnn_fusion=False)
    assert ember.metrics.pass_rewrites["channels_last"] == 2
    assert ember.metrics.pass_rewrites["mkldnn_convolution"] == 0


@needs_mkldnn
def test_convolution_training_step_matches_eager():
    model = eval_model(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    x = data((2, 3, 6, 6))
    compiled(model)(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, expected in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


class TwoBranches(nn.Module):
    """A stem, a pooling, then two convolutions reading the pooled activations (ResNet's first
    block and its shortcut)."""

    def __init__(self, pool: nn.Module):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), pool)
        self.left, self.right = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return torch.tanh(self.left(y)) + self.right(y)


@pytest.mark.parametrize("pool", [nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(2), nn.MaxPool2d(2, 1)])
def test_pooling_of_nhwc_activations_stays_nhwc(pool):
    """Eager pools NHWC activations into NHWC ones, so both convolutions read the pooled values
    with no copy (layout.py), which lowering stores NHWC (lower/graph.py _channels_last_layout),
    walked channels innermost (one accumulator per channel lane)."""
    model = eval_model(TwoBranches(pool))
    for shape in [(1, 4, 12, 12), (2, 4, 9, 11)]:
        check_inference(model, data(shape), atol=2e-5)
        with torch.no_grad():
            (graph,) = graphs_after_passes(model, data(shape))
        copies = [n for n in graph.nodes if n.target is aten.clone.default
                  and n.kwargs.get("memory_format") == torch.channels_last]  # fmt: skip
        assert copies and all(n.args[0].op == "placeholder" for n in copies)  # the input and the weights only
