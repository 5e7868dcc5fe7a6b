"""0-d CPU inputs that Triton kernels take by value (Note: host scalars by value,
ember/schedule/host_scalars.py).

Eager mixes 0-d CPU tensors into GPU ops, and dynamo gives a graph a model's float attributes as
such inputs under `dynamic=True`. Through the interpreter (CI) the graph's tensors are on the CPU
too; on a GPU machine (EMBER_TEST_DEVICE=cuda) the tensors are on the GPU and the scalars stay on
the CPU, as a user's are. Each test calls one compiled function with several values, so a value
baked into a kernel or a wrapper would show, and compares with eager in float64; the count of
inputs taken by value comes from `ember.metrics`.
"""

from __future__ import annotations

import pytest
import torch

import ember
from ember.ir import Buffer, Layout, LoweredGraph
from ember.schedule.host_scalars import scalar_inputs
from ember.uop.dtypes import dtypes
from tests.helpers import INTERPRETED, compile_fn, needs_triton, upcast, use_triton

pytestmark = needs_triton
DEVICE = "cpu" if INTERPRETED else "cuda"


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    use_triton(monkeypatch)


def run_with_values(fn, tensors: list[torch.Tensor], values: list[list[torch.Tensor]]) -> None:
    """`fn(*tensors, *scalars)` compiled once and called with each list of 0-d CPU scalars."""
    compiled = compile_fn(fn)
    on_device = [t.to(DEVICE) for t in tensors]
    for scalars in values:
        got = compiled(*on_device, *scalars)
        expected = fn(*[upcast(t) for t in tensors], *[upcast(s) for s in scalars])
        for g, e in zip(got, expected):
            assert g.device.type == DEVICE
            torch.testing.assert_close(g.cpu().double(), e.double(), rtol=1.3e-5, atol=1e-5, equal_nan=True)


def scaled_sum_and_shift(x, scale, shift):
    return (x * scale + shift).sum(-1) * scale, torch.sigmoid(x) / scale


def test_float64_and_int64_scalars_go_by_value():
    ember.metrics.reset()
    x = torch.randn(5, 37)
    f64, i64 = torch.float64, torch.int64
    values = [[torch.tensor(v, dtype=f64), torch.tensor(k, dtype=i64)] for v, k in [(0.25, 3), (-1.5, -7), (1e15, 0)]]
    run_with_values(scaled_sum_and_shift, [x], values)
    assert ember.metrics.scalar_inputs_by_value == 2
    assert ember.metrics.graphs_compiled == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_special_values_by_value(dtype):
    """inf, -inf, NaN and -0.0 pass through the argument as they are."""
    x = torch.randn(3, 8).t()  # a transposed input, for good measure
    values = [[torch.tensor(v, dtype=dtype), torch.tensor(1, dtype=torch.int64)]
              for v in (float("inf"), float("-inf"), float("nan"), -0.0, 3.0)]  # fmt: skip
    run_with_values(scaled_sum_and_shift, [x], values)


@pytest.mark.skipif(DEVICE != "cpu", reason="eager's matmul takes no CPU tensor with CUDA ones")
def test_a_scalar_an_extern_reads_stays_a_tensor():
    """The matmul (an aten call) reads the scalar itself: it stays a tensor and the kernels read
    it from memory (no input goes by value), with the right values."""

    def fn(x, scale):
        return x @ scale.expand(6, 3), torch.sigmoid(x) * scale

    ember.metrics.reset()
    run_with_values(fn, [torch.randn(4, 6)], [[torch.tensor(v)] for v in (0.5, -2.0)])
    assert ember.metrics.scalar_inputs_by_value == 0


def test_what_goes_by_value():
    """The rule itself: 0-d CPU inputs of the dtypes Triton takes, read by kernels only; none
    under CUDA graphs (a recorded launch would keep the value)."""

    def buffer(name, dtype, size=()):
        return Buffer(name, dtype, Layout(size, tuple(1 for _ in size)), kind="input")

    inputs = [buffer("s", dtypes.float64), buffer("b", dtypes.bool), buffer("v", dtypes.float32, (1,))]
    graph = LoweredGraph(inputs=inputs, constants={})
    on_cpu = frozenset({"s", "b", "v"})
    assert scalar_inputs(graph, [], on_cpu, cuda_graphs=False) == {"s"}
    assert scalar_inputs(graph, [], on_cpu, cuda_graphs=True) == frozenset()
    assert scalar_inputs(graph, [], frozenset(), cuda_graphs=False) == frozenset()
