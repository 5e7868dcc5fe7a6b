"""Stage `codegen`, step 2: the kernel AST through named rewrite phases.

    early     simplify index math (symbolic rules); float16/bfloat16 math in float32;
              identical reductions collapse (codegen/shared_loops.py)
    optimize  choose loop order from the store's strides; tile transposed reads (codegen/tiling.py)
    lower     REDUCE -> accumulator declared outside its loops, updated inside, read after
              (an array of lane accumulators for column reductions: codegen/lanes.py);
              independent accumulators of one scope share a loop (Note: shared reduce loops)

Each phase is a PatternMatcher (or a small function over the whole AST when it needs a
global view, like loop order).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ember.codegen.lanes import MAX_LANES, innermost_loop, lane_copy, lane_range
from ember.codegen.low_precision import pm_low_precision
from ember.codegen.shared_loops import merge_identical_reductions, share_reduce_loops
from ember.codegen.tiling import tile_loops
from ember.uop.dtypes import dtypes
from ember.uop.ops import AccArg, CheckArg, Ops, RangeArg, ScatterArg, UOp, normalize_const, reduce_identity, substitute
from ember.uop.pattern import PatternMatcher, UPat, graph_rewrite
from ember.uop.symbolic import linear_terms, pm_symbolic


def full_rewrite(sink: UOp, max_lanes: int = MAX_LANES) -> UOp:
    """`max_lanes`: the most lane accumulators a reduction may keep (0: scalar accumulators only)."""
    sink = graph_rewrite(sink, pm_low_precision)  # early: Note: low-precision floats
    sink = graph_rewrite(sink, pm_symbolic)  # early
    sink = merge_identical_reductions(sink)  # early
    sink = graph_rewrite(sink, pm_unique_reduce_ranges, ctx={})  # early
    sink = order_loops(sink)  # optimize
    sink = tile_loops(sink)  # optimize: Note: 2-D tiles
    lowering = ReduceLowering(itertools.count(), innermost_loop(sink), max_lanes)
    sink = graph_rewrite(sink, pm_lower_reduce, ctx=lowering)  # lower
    sink = share_reduce_loops(sink)  # lower
    sink = check_integer_division(sink)  # lower
    sink = graph_rewrite(sink, pm_symbolic + pm_checks)  # lower: fold what reduce lowering exposed
    return sink


def check_integer_division(sink: UOp) -> UOp:
    """Integer division by zero raises in eager: each integer IDIV/MOD whose divisor may be
    zero reports it, as eager does: RuntimeError("ZeroDivisionError") (Note: kernel errors,
    renderer/cpp.py)."""
    error = CheckArg("RuntimeError", "ZeroDivisionError: integer division by zero")
    mapping = {
        u: UOp(Ops.CHECK, u.dtype, (u, u.src[1].alu(Ops.CMPNE, u.src[1].const_like(0))), error)
        for u in sink.toposort
        if u.op in (Ops.IDIV, Ops.MOD) and u.dtype.is_int and u.dtype is not dtypes.index
        and not (u.src[1].vmin > 0 or u.src[1].vmax < 0)
    }  # fmt: skip
    return substitute(sink, mapping) if mapping else sink


pm_checks = PatternMatcher(
    [
        (UPat(Ops.CHECK, src=(UPat.var("x"), UPat.const(True))), lambda x: x),  # CHECK(x, True) -> x
    ]
)


# ---- early: every REDUCE owns its ranges ------------------------------------------------


def give_fresh_ranges(ctx: dict[UOp, UOp], red: UOp) -> UOp | None:
    """The linearizer places a reduce range by the one REDUCE it belongs to. A reduction
    read at two positions in one kernel is two REDUCEs over the same ranges: copy them."""
    ranges = red.src[1:]
    if all(ctx.setdefault(r, red) is red for r in ranges):
        return None
    fresh = {r: UOp.range(r.src[0].arg, r.arg.axis + (len(ctx) + 1) * FRESH_AXIS_STRIDE, reduce=True) for r in ranges}
    return UOp(Ops.REDUCE, red.dtype, (substitute(red.src[0], fresh), *fresh.values()), red.arg)


FRESH_AXIS_STRIDE = 1 << 30

pm_unique_reduce_ranges = PatternMatcher(
    [
        (UPat(Ops.REDUCE, name="red"), give_fresh_ranges),  # REDUCE over claimed ranges -> REDUCE over copies
    ]
)


# ---- optimize: loop order --------------------------------------------------------------


def order_loops(sink: UOp) -> UOp:
    """Renumber loop ranges so the one with the largest store stride is outermost, as a
    row-major walk of each output keeps both the writes and most reads sequential."""
    loops = [u for u in sink.toposort if u.op is Ops.RANGE and not u.arg.reduce]
    if len(loops) < 2 or any(u.op in (Ops.REDUCE, Ops.SCAN) or isinstance(u.arg, ScatterArg) for u in sink.toposort):
        return sink  # reductions stay hoisted only while their loops stay outermost; scatters chose theirs
    stride = {r: 0 for r in loops}
    for store in (s for s in sink.src if s.op is Ops.STORE):
        for r, coefficient in _coefficients(store.src[0].src[1]).items():
            if r in stride:
                stride[r] = max(stride[r], abs(coefficient))
    order = sorted(loops, key=lambda r: (-stride[r], r.arg.axis))
    if order == sorted(loops, key=lambda r: r.arg.axis):
        return sink
    mapping = {r: UOp(Ops.RANGE, r.dtype, r.src, RangeArg(i, False)) for i, r in enumerate(order)}
    # renumbering may collide with a reduce range's axis: move reduce axes past every loop
    base = len(order)
    for i, r in enumerate(u for u in sink.toposort if u.op is Ops.RANGE and u.arg.reduce):
        mapping[r] = UOp(Ops.RANGE, r.dtype, r.src, RangeArg(base + i, True))
    return substitute(sink, mapping)


def _coefficients(index: UOp) -> dict[UOp, int]:
    """Multiplier of each RANGE in a sum of products (ranges elsewhere count as 1)."""
    found: dict[UOp, int] = {}
    terms, _ = linear_terms(index)
    for term, k in terms:
        if term.op is Ops.RANGE:
            found[term] = found.get(term, 0) + k
        else:
            for r in term.ranges:
                found.setdefault(r, 1)
    return found


# ---- lower: reductions to accumulators ----------------------------------------------


@dataclass(frozen=True)
class ReduceLowering:
    ids: itertools.count  # accumulator ids
    innermost_loop: UOp | None
    max_lanes: int


def lower_reduce(ctx: ReduceLowering, red: UOp) -> UOp:
    """REDUCE(value, *ranges) -> ACC_READ(acc, ACC_UPDATE(acc, value, *ranges)), where the
    accumulator is declared in the scope of the result (so it restarts for each output).
    A column reduction keeps one accumulator per lane of the innermost loop instead
    (Note: lane accumulators, codegen/lanes.py)."""
    value, reduce_ranges = red.src[0], red.src[1:]
    identity = normalize_const(red.dtype, reduce_identity(red.arg, red.dtype))
    acc_id = next(ctx.ids)
    lane = lane_range(red, ctx.innermost_loop, ctx.max_lanes)
    outer = tuple(sorted(red.ranges - {lane}, key=lambda r: r.arg.axis))
    if lane is None:
        acc = UOp(Ops.DEFINE_ACC, red.dtype, outer, AccArg(red.arg, identity, acc_id))
        return UOp(Ops.ACC_READ, red.dtype, (acc, UOp(Ops.ACC_UPDATE, red.dtype, (acc, value, *reduce_ranges))))
    copy = lane_copy(lane, acc_id)
    acc = UOp(Ops.DEFINE_ACC, red.dtype, outer, AccArg(red.arg, identity, acc_id, lane.src[0].arg))
    update = UOp(Ops.ACC_UPDATE, red.dtype, (acc, substitute(value, {lane: copy}), *reduce_ranges, copy))
    return UOp(Ops.ACC_READ, red.dtype, (acc, update, lane))


def lower_scan(ctx: ReduceLowering, scan: UOp) -> UOp:
    """SCAN(value, r, *other ranges) -> ACC_RUNNING(acc, ACC_UPDATE(acc, value, r)): the
    accumulator is declared inside the other ranges' loops and outside the scan loop r, and read
    inside it after each update (Note: scans, lower/scans.py). Scans over one range share its loop."""
    value, scan_range = scan.src[:2]
    if scan_range.op is not Ops.RANGE:  # a scanned dim of size 1
        return value
    arg = AccArg(scan.arg, normalize_const(scan.dtype, reduce_identity(scan.arg, scan.dtype)), next(ctx.ids))
    outer = tuple(sorted(scan.ranges - {scan_range}, key=lambda r: r.arg.axis))
    acc = UOp(Ops.DEFINE_ACC, scan.dtype, outer, arg)
    return UOp(Ops.ACC_RUNNING, scan.dtype, (acc, UOp(Ops.ACC_UPDATE, scan.dtype, (acc, value, scan_range))))


pm_lower_reduce = PatternMatcher(
    [
        (UPat(Ops.REDUCE, name="red"), lower_reduce),  # REDUCE -> DEFINE_ACC + ACC_UPDATE + ACC_READ
        (UPat(Ops.SCAN, name="scan"), lower_scan),  # SCAN -> DEFINE_ACC + ACC_UPDATE + ACC_RUNNING
    ]
)
