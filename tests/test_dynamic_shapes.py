"""Graphs with symbolic shapes (torch.compile's automatic dynamic shapes, dynamic=True) compiled
once per concrete shape (Note: dynamic shapes by specialization): the path a graph takes where
its symbolic compile refuses (tests/test_symbolic_shapes.py tests that one), forced here with
symbolic_shapes off."""

import pytest
import torch

import ember
from tests.helpers import test_device, to_test_device


@pytest.fixture(autouse=True)
def _per_shape(monkeypatch):
    monkeypatch.setenv("EMBER_SYMBOLIC_SHAPES", "0")


def upcast(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model).double()


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))


@pytest.mark.parametrize("dynamic", [None, True])
def test_changing_batch_sizes_compile_instead_of_running_eagerly(dynamic):
    torch._dynamo.reset()
    model = mlp().to(test_device()).eval()
    reference = upcast(model)
    compiled = torch.compile(model, backend="ember", dynamic=dynamic)
    ember.metrics.reset()
    with torch.no_grad():
        for batch in [4, 7, 16, 7, 1]:
            x = to_test_device(torch.randn(batch, 32))
            torch.testing.assert_close(compiled(x), reference(x.double()).float(), rtol=1e-4, atol=1e-4)
    assert ember.metrics.graphs_failed == 0
    assert ember.metrics.fallback_calls == 0
    assert ember.metrics.shape_specializations >= 2  # 7 and 16 at least (dynamo gives size 1 its own graph)


def test_training_with_changing_shapes_gives_eagers_gradients():
    torch._dynamo.reset()
    model = mlp().to(test_device())
    reference = upcast(model)
    compiled = torch.compile(model, backend="ember")
    ember.metrics.reset()
    for batch in [5, 9, 12]:
        x = to_test_device(torch.randn(batch, 32))
        compiled(x).square().mean().backward()
        reference(x.double()).square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad.float(), rtol=1e-4, atol=1e-5)
            p.grad, q.grad = None, None
    assert ember.metrics.graphs_failed == 0
    assert ember.metrics.shape_specializations >= 2  # a forward and a backward per new shape


def test_sequence_lengths_and_scalar_sizes():
    torch._dynamo.reset()

    def attention_scores(q, k):
        scale = q.shape[-1] ** -0.5
        return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1).sum(1)

    compiled = torch.compile(attention_scores, backend="ember", dynamic=True)
    ember.metrics.reset()
    for length in [3, 10, 17]:
        q, k = (to_test_device(torch.randn(2, length, 16)) for _ in range(2))
        want = attention_scores(q.double(), k.double()).float()
        torch.testing.assert_close(compiled(q, k), want, rtol=1e-4, atol=1e-5)
    assert ember.metrics.graphs_failed == 0 and ember.metrics.shape_specializations == 3


def test_past_the_limit_new_shapes_run_eagerly_with_one_warning(monkeypatch):
    monkeypatch.setenv("EMBER_STRICT", "0")
    monkeypatch.setenv("EMBER_SHAPE_SPECIALIZATIONS", "2")
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="ember", dynamic=True)
    ember.metrics.reset()
    with pytest.warns(UserWarning, match="more than 2 input shapes") as caught:
        for n in [3, 4, 5, 6, 5, 3]:
            x = to_test_device(torch.randn(n))
            torch.testing.assert_close(compiled(x), torch.sin(x) * 2 + 1)
    assert sum("more than 2 input shapes" in str(w.message) for w in caught) == 1
    assert ember.metrics.shape_specializations == 2


def test_strict_raises_past_the_limit(monkeypatch):
    monkeypatch.setenv("EMBER_SHAPE_SPECIALIZATIONS", "1")
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.cos() + 1, backend="ember", dynamic=True)
    compiled(to_test_device(torch.randn(3)))
    with pytest.raises(RuntimeError, match="more than 1 shapes"):
        compiled(to_test_device(torch.randn(4)))


def test_non_contiguous_and_empty_inputs_specialize_on_strides():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (x * 3).exp().sum(-1), backend="ember", dynamic=True)
    for x in [torch.randn(4, 6), torch.randn(6, 5).t(), torch.randn(0, 3), torch.randn(3, 8)[:, ::2]]:
        x = to_test_device(x)
        torch.testing.assert_close(compiled(x), (x.double() * 3).exp().sum(-1).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_pool_with_indices_before_a_convolution(dtype):
    """A convolution reading a max pool's value (a getitem of max_pool2d_with_indices' pair, ResNet's
    stem): the channels-last pass recomputes the getitem's fake value from the pair, which holds the
    only fake tensors in sight once the graph is specialized outside AOTAutograd's tracing."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    model = torch.nn.Sequential(conv, torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1), torch.nn.Conv2d(8, 4, 3))
    model = model.to(test_device(), dtype).eval()
    reference = upcast(model)
    compiled = torch.compile(model, backend="ember")
    ember.metrics.reset()
    with torch.no_grad():
        for batch, size in [(2, 16), (3, 24), (2, 33)]:
            x = to_test_device(torch.randn(batch, 3, size, size, dtype=dtype))
            torch.testing.assert_close(compiled(x), reference(x.double()).to(dtype), rtol=1e-4, atol=1e-4)
    assert ember.metrics.graphs_failed == 0 and ember.metrics.shape_specializations >= 2
