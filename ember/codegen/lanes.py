"""Stage `codegen`, part of the `lower` phase: which reductions keep one accumulator per lane.

Note: lane accumulators (column reductions)
    A reduction over an outer axis (`x.sum(dim=0)` of a row-major [N, C] tensor) read in
    the natural order has the reduce loop innermost and loads `C` elements apart: no
    vectors, a cache line per element. When the kernel's innermost loop `L` is contiguous
    in the reduced value's loads and the innermost reduce range is not, the reduction keeps
    an array accumulator indexed by `L` (`AccArg.lanes`), and the loop nest becomes

        acc[0:C] = identity                  (declared where the scalar one would be)
        for n in N:                          the reduce loop(s)
            for l' in C: acc[l'] += x[n, l'] (a lane copy of L: contiguous, `omp simd`)
        for l in C: out[l] = acc[l]

    The lane copy `l'` is a RANGE of kind LANE, which nests inside every reduce range, so
    the linearizer nests it inside the reduce loops. With no loop around it, the reduce loop
    is the kernel's outermost, and the renderer splits it over threads with an OpenMP array
    reduction (per-thread partial arrays, then a combine).
"""

from __future__ import annotations

from ember.uop.ops import Ops, RangeKind, UOp
from ember.uop.symbolic import linear_terms

MAX_LANES = 4096  # the array lives on the stack: 32 KiB of doubles at most
MIN_LANES = 4  # fewer lanes than a vector: not worth the array


def innermost_loop(sink: UOp) -> UOp | None:
    loops = [u for u in sink.toposort if u.op is Ops.RANGE and not u.arg.reduce]
    return max(loops, key=lambda r: r.arg.nesting) if loops else None


def lane_range(red: UOp, innermost: UOp | None, max_lanes: int) -> UOp | None:
    """The loop that `red` should keep one accumulator per iteration of, or None for a
    scalar accumulator (Note: lane accumulators)."""
    lanes = innermost.src[0].static_size if innermost is not None else None  # none for a symbolic size
    if innermost is None or innermost not in red.ranges or lanes is None or not MIN_LANES <= lanes <= max_lanes:
        return None
    value, reduce_ranges = red.src[0], red.src[1:]
    if any(u.op is Ops.DEFINE_ACC and innermost in u.src for u in value.toposort):
        return None  # a reduction nested per lane would put loops inside the lane loop
    inner_reduce = max(reduce_ranges, key=lambda r: r.arg.nesting)
    along_lane = along_reduce = 0
    for load in (u for u in value.toposort if u.op is Ops.LOAD and inner_reduce in u.ranges):
        # only loads streamed through by the reduction count: a per-lane parameter
        # (a batch norm's weight read by a mean over H, W) is loaded once either way
        strides = _unit_strides(load.src[0].src[1])
        along_lane += innermost in strides
        along_reduce += inner_reduce in strides
    return innermost if along_lane > along_reduce else None


def lane_copy(lane: UOp, acc_id: int) -> UOp:
    """The reduce-flagged copy of `lane` that indexes the accumulator inside the reduce loops."""
    return UOp.range(lane.src[0].arg, acc_id, RangeKind.LANE)


def _unit_strides(index: UOp) -> set[UOp]:
    terms, _ = linear_terms(index)
    return {term for term, k in terms if term.op is Ops.RANGE and abs(k) == 1}
