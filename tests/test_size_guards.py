"""Guards on symbolic sizes that a forward compile adds for dynamo to check, the ones every compile
refuses, and the graph cache re-asserting them (Note: guards a compile adds, ember/size_guards.py)."""

import copy

import pytest
import sympy
import torch
from torch import nn

import ember
from ember.size_guards import decode, encode, guarding
from tests.test_symbolic_shapes import assert_compiled_once

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _size(shape_env, value: int, name: str):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    return shape_env.create_unspecified_symint_and_symbol(value, ConstantSource(name), DimDynamic.DYNAMIC)


def test_a_compile_admits_relations_and_refuses_what_fixes_a_size():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    n, m = _size(shape_env, 7, "n"), _size(shape_env, 12, "m")
    with guarding(shape_env, admit=True) as guards:
        assert bool(n > 5) and bool(n * 2 != m)
        assert bool(m % 4 == 0)  # an equality that leaves m free: any multiple of 4
        with pytest.raises(Exception, match="Guard attempted"):
            int(n)  # Eq(n, 7): a guard that fixes the size
        with pytest.raises(Exception, match="Guard attempted"):
            bool(n == m - 5)  # an equality between sizes ties one to the other
        with pytest.raises(Exception, match="Guard attempted"):
            bool((n - 6) * m == 12)  # true only at n = 7 (m = 12): it pins both
    n_, m_ = n.node.expr, m.node.expr
    assert [str(g) for g in guards.admitted] == [str(n_ > 5), str(sympy.Ne(2 * n_, m_)), str(guards.admitted[2])]
    assert isinstance(guards.admitted[2], sympy.Eq) and guards.admitted[2].free_symbols == {m_}
    recorded = [str(g.expr) for g in shape_env.guards]
    assert all(str(g) in recorded for g in guards.admitted)  # the environment has them: dynamo checks them
    with guarding(shape_env, admit=False), pytest.raises(Exception, match="Guard attempted"):
        bool(n < m)  # a backward (frozen environment) refuses every guard


def test_guards_survive_the_cache_encoding():
    from torch.utils._sympy.functions import FloorDiv, Max, PythonMod

    s0, s1 = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("s1", integer=True, positive=True)
    for guard in (FloorDiv(s0 - 1, 2) + 1 > 1, sympy.Ne(Max(s0, s1) * 3, 7), PythonMod(s0, 8) < s1 - 2):
        assert decode(encode(guard), {"s0": s0, "s1": s1}) == guard


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip


def _check(compiled, model, x, training=False, atol=1e-4):
    reference = copy.deepcopy(model).double()
    want = reference(x.double())
    got = compiled(x)
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=atol)
    if training:
        grads = torch.autograd.grad(got.square().sum(), list(model.parameters()))
        wants = torch.autograd.grad(want.square().sum(), list(reference.parameters()))
        for g, w in zip(grads, wants):
            torch.testing.assert_close(g, w.float(), rtol=1e-3, atol=1e-3)


def test_a_conv_net_compiles_once_over_image_sizes():
    """Channels-last convolutions (passes/layout.py) make torch's fake convolution ask whether a
    pooled image is more than one pixel high, `(s - 1)//2 + 1 > 1`: the forward compile adds that
    guard for dynamo, instead of compiling per image size. An image that breaks it (2 x 2)
    compiles a second symbolic graph, for every image that small. (The sizes are even: torch 2.11's
    max pool guards on the size's parity while dynamo traces, with any backend.)"""
    model = conv_net().eval()
    compiled = torch.compile(model, backend="ember", dynamic=True)
    with torch.no_grad():
        for batch, size in [(2, 24), (2, 40), (3, 64), (2, 34)]:
            _check(compiled, model, torch.randn(batch, 3, size, size))
        assert_compiled_once()
        assert ember.metrics.size_guards
        for batch, size in [(2, 2), (3, 2)]:
            _check(compiled, model, torch.randn(batch, 3, size, size))
    assert ember.metrics.symbolic_graphs == 2 and ember.metrics.shape_specializations == 0


def test_a_conv_net_trains_over_image_sizes():
    """Training BatchNorm scales its variance by n / (n - 1), a float of the sizes: kernels compute
    it from the size variables. Forward and backward compile once."""
    model = conv_net().train()
    compiled = torch.compile(model, backend="ember", dynamic=True)
    for batch, size in [(2, 24), (2, 40), (3, 18)]:
        _check(compiled, model, torch.randn(batch, 3, size, size), training=True, atol=1e-3)
    assert_compiled_once(graphs=2)


def test_a_float_of_sizes_in_a_kernel_and_an_extern():
    def f(x):
        n = x.shape[0]
        return x * (n / (n - 1)) + 0.5 / n, torch.full((3,), n / 4)

    compiled = torch.compile(f, backend="ember", dynamic=True)
    for n in (3, 8, 21):
        x = torch.randn(n, 5)
        for got, want in zip(compiled(x), f(x.double())):
            torch.testing.assert_close(got, want.float())
    assert_compiled_once()


def test_a_cached_graph_asserts_the_guards_it_was_compiled_under(tmp_path, monkeypatch):
    """A process that loads a graph compiled under guards asserts them again, so that its dynamo
    checks them too: an image that breaks one is compiled, not served the cached graph."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    model = conv_net().eval()
    with torch.no_grad():
        torch.compile(model, backend="ember", dynamic=True)(torch.randn(2, 3, 40, 36))
        compiled_under = dict(ember.metrics.size_guards)
        torch._dynamo.reset()  # as a new process: dynamo's guards are gone, the graph cache stays
        ember.metrics.reset()
        compiled = torch.compile(model, backend="ember", dynamic=True)
        _check(compiled, model, torch.randn(2, 3, 48, 44))
        assert ember.metrics.graph_cache_hits == 1 and dict(ember.metrics.size_guards) == compiled_under
        _check(compiled, model, torch.randn(2, 3, 48, 2))
        assert ember.metrics.symbolic_graphs == 2  # a guard broke: dynamo compiled the frame again


def test_a_cached_graph_is_not_served_where_its_guards_break():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    n = _size(shape_env, 7, "n")
    with guarding(shape_env, admit=True) as guards:
        assert not guards.reassert([encode(n.node.expr > 9)])
        assert not guards.reassert([encode(n.node.expr > 5), ["symbol", "s_unknown"]])
        assert not shape_env.guards  # nothing asserted by a refused entry
        assert guards.reassert([encode(n.node.expr > 5)])
    assert [str(g.expr) for g in shape_env.guards] == [str(n.node.expr > 5)]


def test_an_equality_that_leaves_the_size_free_is_a_guard():
    """`ceil(n / 32) == 1`, which an allocation of that size asks at n = 7, holds for every n up to
    32: admitted, it serves those sizes from one symbolic graph, and a longer input makes dynamo
    compile the frame again, symbolic once more (the timm models ghostnetv2 and mobilevit_xxs ask
    such equalities of their feature maps' sizes; refused, they compiled per shape)."""
    import math

    def f(x):
        return x.new_ones(math.ceil(x.shape[0] / 32)) * 2 + x.sum()

    compiled = torch.compile(f, backend="ember", dynamic=True)
    for n in (7, 9, 30, 40, 50):
        x = torch.randn(n)
        torch.testing.assert_close(compiled(x), f(x.double()).float())
    assert_compiled_once(graphs=2)
    assert any(guard.startswith("Eq(") for guard in ember.metrics.size_guards)


def test_a_frozen_environment_admits_nothing():
    """Once dynamo has built a frame's guards it freezes the shape environment: a guard added then
    would never be checked, so even a forward compile refuses it."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    n = _size(shape_env, 7, "n")
    shape_env.freeze()
    with guarding(shape_env, admit=True) as guards:
        with pytest.raises(Exception, match="Guard attempted"):
            bool(n > 5)
        assert not guards.reassert([encode(n.node.expr > 5)])


def test_a_refused_guard_is_not_a_torch_warning(caplog):
    """A refusal is ember's decision, counted as the reason to compile per shape: torch's "failed
    during evaluate_expr" warning for it is dropped, on the compiling thread only."""
    import logging
    import math

    def f(x):
        return x.new_ones(math.ceil((x.shape[0] - 6) / 1)) * 2  # Eq(ceil(n - 6), 1) pins n = 7: refused

    compiled = torch.compile(f, backend="ember", dynamic=True)
    with caplog.at_level(logging.WARNING, logger="torch.fx.experimental.symbolic_shapes"):
        for n in (7, 9):
            torch.testing.assert_close(compiled(torch.randn(n)), f(torch.randn(n)))
    assert ember.metrics.symbolic_fallbacks
    assert not [r for r in caplog.records if "failed during evaluate_expr" in r.getMessage()]
    logging.getLogger("torch.fx.experimental.symbolic_shapes").warning("failed during evaluate_expr(elsewhere)")
    assert [r for r in caplog.records if "failed during evaluate_expr" in r.getMessage()]
