"""Graphs whose sizes depend on tensor values (Note: data-dependent sizes, ember/data_dependent.py):
refused up front with the op and the user's line, run eagerly (unless strict) at every shape, and
a value taken out of a tensor that is never a size still compiles. Also: a shape specialization
whose graph cannot be re-run on fake tensors falls back like any failing graph."""

import warnings

import pytest
import torch

import ember
from ember import shape_specialization


def select_positive(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    idx = torch.nonzero(x > 0)
    return (x[x > 0] * 2).sum() + idx.float().mean() + torch.masked_select(y, y > 0.5).exp().sum()


def range_of_max(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return torch.arange(n.max().item()).float().sum() + x.sum()


def scaled_by_sum(x: torch.Tensor) -> torch.Tensor:
    return x * x.sum().item() + 1


@pytest.fixture
def captured_sizes():
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        yield


def test_a_data_dependent_size_is_refused_naming_its_op_and_line(captured_sizes):
    compiled = torch.compile(select_positive, backend="ember")
    with pytest.raises(Exception, match=r"stage 'frontend', op 'nonzero'") as raised:
        compiled(torch.randn(64), torch.rand(64))
    message = str(raised.value)
    assert "depends on tensor values" in message and "capture_dynamic_output_shape_ops" in message
    assert "test_data_dependent.py" in message and "torch.nonzero(x > 0)" in message


def test_a_size_made_by_item_is_refused_naming_item(captured_sizes):
    compiled = torch.compile(range_of_max, backend="ember")
    with pytest.raises(Exception, match=r"op '_local_scalar_dense': \.item\(\)") as raised:
        compiled(torch.randn(16), torch.tensor([3, 5]))
    assert "torch.arange(n.max().item())" in str(raised.value)


def test_a_refused_graph_runs_eagerly_at_every_shape(captured_sizes, monkeypatch):
    """The first call compiles static shapes, the second recompiles with symbolic ones: before
    the check, that second graph went to the per-shape path and crashed re-running nonzero."""
    monkeypatch.setenv("EMBER_STRICT", "0")
    compiled = torch.compile(select_positive, backend="ember")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for size in (64, 100, 7, 33):
            x, y = torch.randn(size), torch.rand(size)
            x[0] = 1.0  # at least one positive element: the mean of no indices is NaN in either
            want = select_positive(x.double(), y.double())
            torch.testing.assert_close(compiled(x, y).double(), want, rtol=1e-5, atol=1e-5)
    refusals = [w for w in caught if "depends on tensor values" in str(w.message)]
    assert refusals and ember.metrics.graphs_failed == len(refusals)
    assert ember.metrics.kernels_generated == 0


def test_a_value_taken_out_of_a_tensor_still_compiles(captured_sizes):
    compiled = torch.compile(scaled_by_sum, backend="ember")
    for size in (16, 40):
        x = torch.randn(size)
        torch.testing.assert_close(compiled(x).double(), scaled_by_sum(x.double()), rtol=1e-5, atol=1e-5)
    assert ember.metrics.graphs_failed == 0 and ember.metrics.kernels_generated > 0


def _fake_run_fails(gm, args):
    raise RuntimeError("cannot run on fake tensors")


@pytest.mark.parametrize("strict", ["1", "0"])
def test_a_specialization_that_cannot_be_traced_falls_back(monkeypatch, strict):
    """Per-shape compiles (symbolic sizes off): re-running the graph at a new shape's fake
    tensors failing is a failing graph: strict raises naming the stage, else one warning and
    eager results at that shape."""
    monkeypatch.setenv("EMBER_SYMBOLIC_SHAPES", "0")
    monkeypatch.setenv("EMBER_STRICT", strict)
    monkeypatch.setattr(shape_specialization, "static_graph", _fake_run_fails)
    compiled = torch.compile(lambda x: (x.sin() * 2).sum(0), backend="ember", dynamic=True)
    x = torch.randn(6, 5)
    if strict == "1":
        with pytest.raises(Exception, match=r"stage 'specialize'.*cannot run on fake tensors"):
            compiled(x)
        return
    with pytest.warns(UserWarning, match=r"stage 'specialize'"):
        got = compiled(x)
    # float32 results against float64 eager, to float32's tolerance: on an AVX-512 machine eager's
    # float32 sum was 1.8e-7 off the float64 one, past float64's tolerance
    expected = (x.double().sin() * 2).sum(0).float()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(compiled(x), expected)  # no second warning needed
    assert ember.metrics.graphs_failed == 1
