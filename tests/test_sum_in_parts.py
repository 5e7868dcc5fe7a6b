"""lower/reductions.py, Note: a long sum in parts: a float sum of a whole tensor into one value
is SUM_PARTS sums of consecutive parts (side-by-side accumulators in one loop), for C++ kernels.
The lowered IR's REDUCEs are counted; results against eager float64."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import ember
from ember.ir import ComputedBuffer
from ember.lower import lower_graph
from ember.lower.reductions import SUM_PARTS, SUM_PARTS_MIN
from ember.uop.ops import Ops
from tests.helpers import check, cpu_kernels_only, data


def reduces_lowered(fn, shape, ordered_reductions=True) -> int:
    """REDUCE UOps in the bodies that lowering gives `fn` on an input of `shape`."""
    gm = make_fx(fn, tracing_mode="fake")(torch.empty(shape))
    graph, _ = lower_graph(gm, [torch.empty(shape)], ordered_reductions=ordered_reductions)
    bodies = [step.body for step in graph.steps if isinstance(step, ComputedBuffer)]
    return sum(1 for body in bodies for u in body.toposort if u.op is Ops.REDUCE)


def test_a_long_sum_is_summed_in_parts():
    assert reduces_lowered(lambda x: x.sum(), (1 << 16,)) == SUM_PARTS
    assert reduces_lowered(lambda x: x.mean(), (256, 512)) == SUM_PARTS


def test_short_or_partial_or_block_sums_stay_whole():
    assert reduces_lowered(lambda x: x.sum(), (SUM_PARTS_MIN // 2,)) == 1
    assert reduces_lowered(lambda x: x.sum(dim=1), (256, 512)) == 1  # 256 outputs: chains side by side already
    assert reduces_lowered(lambda x: x.amax(), (1 << 16,)) == 1
    assert reduces_lowered(lambda x: x.sum(), (1 << 16,), ordered_reductions=False) == 1  # Triton splits its own
    assert reduces_lowered(lambda x: x.sum(), (3, 1 << 15)) == 1  # the outer dim does not split in 4


@cpu_kernels_only
@pytest.mark.parametrize("shape", [(1 << 16,), (256, 512), (64, 3, 512)])
def test_sums_in_parts_agree_with_eager(shape):
    # float64: a float32 sum's parts are summed in float32 blocks besides (tests/test_float_sums.py)
    x = data(shape, torch.float64, spread=1.0) + 0.25  # a sum far from 0: relative errors count
    check(lambda x: (x.sum(), x.mean(), (x * x).sum()), x)
    assert ember.metrics.kernels_generated == 1
    assert ember.metrics.reduce_loops == len(shape)  # the parts share one loop nest (one loop per reduced dim)
    check(lambda x: (x.sum(), x.mean(), (x * x).sum()), x.float())


@cpu_kernels_only
def test_strided_and_double_inputs():
    check(lambda x: x.sum(), data((512, 256), spread=1.0).t())
    check(lambda x: x.sum(), data((1 << 16,), torch.float64, spread=1.0))
    check(lambda x: x.var(), data((1 << 16,), spread=1.0) + 3.0, rtol=1e-5, atol=1e-6)
