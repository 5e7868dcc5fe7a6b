"""codegen/float_sums.py, Note: float32 sums in blocks: a float32 sum that lowering accumulates
in double is summed in float32 blocks added in double, for C++ kernels. The lowered kernel AST's
accumulators are counted by dtype; results against eager on float64-upcast inputs, and the error
on long adversarial sums against eager float32's own."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ember
import ember.compile_cpp
from ember.codegen.float_sums import AVX512_LANES, block_lengths
from ember.codegen.phases import full_rewrite
from ember.runtime.cpu import float_lanes
from ember.uop.dtypes import dtypes
from ember.uop.ops import BufferArg, Ops, RangeKind, UOp
from tests.helpers import check, compile_fn, cpu_kernels_only, data

BLOCK, ROW_BLOCK = block_lengths(AVX512_LANES)  # 256 and 1024 elements


def _accumulators(
    extents: tuple[int, ...], outputs: int = 1, column: bool = False, float_lanes: int = AVX512_LANES
) -> dict[str, int]:
    """DEFINE_ACCs by dtype after the C++ rewrite of out[o] = sum_r double(x[...]): a row sum over
    reduce ranges of `extents` (the last innermost), or with `column` a sum down the columns."""
    size = math.prod(extents) * outputs
    x = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg("p1", size))
    out = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg("p0", outputs))
    o = UOp.range(outputs, 0) if outputs > 1 else UOp.const(dtypes.index, 0)  # a whole tensor's sum: no loop
    ranges = [UOp.range(n, i + 1, RangeKind.REDUCE) for i, n in enumerate(extents)]
    position = UOp.const(dtypes.index, 0)
    for r, n in zip(ranges, extents):
        position = position * UOp.const(dtypes.index, n) + r
    row_length = UOp.const(dtypes.index, math.prod(extents))
    index = position * UOp.const(dtypes.index, outputs) + o if column else o * row_length + position
    load = UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, dtypes.float32, (x, index)),))
    total = UOp(Ops.REDUCE, dtypes.float64, (load.cast(dtypes.float64), *ranges), Ops.ADD)
    store = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, dtypes.float32, (out, o)), total.cast(dtypes.float32)))
    lowered = full_rewrite(UOp(Ops.SINK, dtypes.void, (store,)), float_lanes=float_lanes)
    accs = [u for u in lowered.toposort if u.op is Ops.DEFINE_ACC]
    return {
        name: sum(a.dtype is dtype for a in accs)
        for name, dtype in (("float32", dtypes.float32), ("float64", dtypes.float64))
    }


def test_a_row_up_to_a_block_is_one_float32_sum():
    assert _accumulators((256,), outputs=512) == {"float32": 1, "float64": 0}
    assert _accumulators((ROW_BLOCK,), outputs=4) == {"float32": 1, "float64": 0}
    assert _accumulators((4, 8, ROW_BLOCK // 32), outputs=4) == {"float32": 1, "float64": 0}
    assert _accumulators((BLOCK,)) == {"float32": 1, "float64": 0}


def test_a_long_sum_is_float32_blocks_added_in_double():
    assert _accumulators((8 * BLOCK,)) == {"float32": 1, "float64": 1}
    assert _accumulators((3000,)) == {"float32": 1, "float64": 1}  # blocks of a divisor (250)
    assert _accumulators((7, 200)) == {"float32": 1, "float64": 1}  # the inner dim is the block


def test_blocks_are_as_long_as_the_hosts_vectors_have_lanes():
    """16 elements a lane: 256 with AVX-512, 128 with AVX2, 64 with SSE or NEON (a row: 64 a lane)."""
    assert _accumulators((256,), float_lanes=8) == {"float32": 1, "float64": 1}  # two blocks of 128
    assert _accumulators((128,), float_lanes=8) == {"float32": 1, "float64": 0}
    assert _accumulators((128,), float_lanes=4) == {"float32": 1, "float64": 1}
    assert _accumulators((512,), outputs=4, float_lanes=8) == {"float32": 1, "float64": 0}
    assert _accumulators((1024,), outputs=4, float_lanes=8) == {"float32": 0, "float64": 1}  # a long row
    assert block_lengths(1) == (64, 64)  # never below MIN_BLOCK


def test_sums_without_a_block_stay_in_double():
    assert _accumulators((4099,)) == {"float32": 0, "float64": 1}  # prime: no block divides it
    assert _accumulators((1000, 7)) == {"float32": 0, "float64": 1}  # inner dim too short for a block
    assert _accumulators((ROW_BLOCK + 1,), outputs=4) == {"float32": 0, "float64": 1}  # a long row
    assert _accumulators((4096,), outputs=64, column=True) == {"float32": 0, "float64": 1}  # lane accumulators


@cpu_kernels_only
@pytest.mark.parametrize("shape", [(1 << 16,), (256, 512), (64, 3, 512), (4099,), (33, 1000), (7, 3000), (1000, 7)])
def test_sums_in_blocks_agree_with_eager(shape):
    x = data(shape, spread=1.0) + 0.25  # a sum far from 0: relative errors count
    check(lambda x: (x.sum(), x.mean(), (x * x).sum(), x.sum(-1), x.mean(-1, keepdim=True)), x)


@cpu_kernels_only
def test_statistics_of_one_tensor_walk_its_blocks_once():
    x = data((1 << 16,), spread=1.0) + 0.25
    check(lambda x: (x.sum(), x.mean(), (x * x).sum()), x)
    assert ember.metrics.kernels_generated == 1
    assert ember.metrics.reduce_loops == 2  # the blocks, and the float32 sums of each block side by side


@cpu_kernels_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_strided_and_other_dtypes(dtype):
    check(lambda x: (x.sum(), x.sum(0)), data((512, 256), dtype, spread=1.0).t(), rtol=1e-2, atol=1e-2)
    check(lambda x: x.sum(-1), data((8, 3 * BLOCK), dtype, spread=1.0)[:, ::3], rtol=1e-2, atol=1e-2)


@cpu_kernels_only
def test_special_values():
    x = data((4, 4 * BLOCK), spread=1.0)
    x[0, 5], x[1, BLOCK + 3], x[2, 7], x[2, 9] = math.nan, math.inf, math.inf, -math.inf
    check(lambda x: x.sum(-1), x)
    check(lambda x: x.sum(), x[:1])


@cpu_kernels_only
def test_a_variance_of_equal_values_is_zero():
    # the mean a variance reads stays in double: exact for equal values (group norm gives the bias)
    x = torch.tensor([[-8.0676] * 300, [100.3] * 300])
    check(lambda x: torch.var_mean(x, -1), x)
    check(lambda x: F.layer_norm(x, (300,)), x)


def _errors(fn, x: torch.Tensor) -> tuple[float, float]:
    exact = fn(x.double())
    return (compile_fn(fn)(x).double() - exact).abs().max().item(), (fn(x).double() - exact).abs().max().item()


def _adversarial(case: str) -> torch.Tensor:
    n = 1 << 22
    gen = torch.Generator().manual_seed(0)
    if case == "ones":
        x = torch.ones(n)
    elif case == "tenths":
        x = torch.full((n,), 0.1)
    elif case == "offset":
        x = torch.rand(n, generator=gen) + 1000
    elif case == "mixed_magnitudes":
        x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 6)
    else:  # neighbours cancel: large partial sums in each vector lane
        x = torch.randn(n, generator=gen) * 1e6
        x[1::2] = -x[::2] + torch.randn(n // 2, generator=gen)
    return x


CASES = ["ones", "tenths", "offset", "mixed_magnitudes", "cancelling"]


@cpu_kernels_only
@pytest.mark.parametrize("case", CASES)
def test_long_sums_are_as_accurate_as_eager_float32(case):
    _check_long_sums(case, _adversarial(case))


def _check_long_sums(case: str, x: torch.Tensor) -> None:
    ours, eager = _errors(lambda x: x.sum(), x)
    rounding = torch.finfo(torch.float32).eps * x.double().sum().abs().item()  # the float32 result's own
    assert ours <= max(eager, rounding), f"{case}: ember's error {ours:.3e}, eager float32's {eager:.3e}"
    rows = x.view(64, -1)
    ours, eager = _errors(lambda x: x.sum(-1), rows)
    rounding = torch.finfo(torch.float32).eps * rows.double().sum(-1).abs().max().item()
    assert ours <= max(eager, rounding), f"{case} rows: ember's error {ours:.3e}, eager float32's {eager:.3e}"


@cpu_kernels_only
@pytest.mark.skipif(float_lanes() != 16, reason="needs an AVX-512 host to build AVX2 kernels on")
@pytest.mark.parametrize("case", ["tenths", "cancelling"])
def test_long_sums_on_an_avx2_host_are_as_accurate_as_eager_float32(case, monkeypatch, tmp_path):
    """Kernels built as for an AVX2 host (no AVX-512: 8 lanes a vector, and blocks told so). With
    blocks of 256 whatever the host, 0.1 summed 4M times was off by 0.125 there, eager by 0.0625."""
    compiler = tmp_path / "g++-avx2"
    compiler.write_text('#!/bin/sh\nexec g++ "$@" -mno-avx512f\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("EMBER_CXX", str(compiler))
    monkeypatch.setattr(ember.compile_cpp, "float_lanes", lambda: 8)
    _check_long_sums(case, _adversarial(case))
