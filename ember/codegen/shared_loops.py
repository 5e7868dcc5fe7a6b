"""Stage `codegen`, parts of the `early` and `lower` phases: reductions share their loops.

Note: shared reduce loops
    Each REDUCE comes out of lowering with fresh reduce ranges of its own, so a kernel that
    computes several statistics of one row (layer norm's mean next to rms norm's sum of
    squares and logsumexp's max) walks the row once per statistic, and a statistic that two
    ops need (the mean of `var_mean` and of `layer_norm`) is computed twice. Two rewrites fix
    that, without changing what any accumulator adds up or in which order:

    early  identical reductions collapse: two REDUCEs with one combine, one result type,
           ranges of the same extents and the same value once their ranges are renamed
           are one REDUCE (hash-consing then shares everything computed from it).
    lower  independent accumulators share one loop: ACC_UPDATEs declared in one scope
           (same outer ranges, same lane count) over reduce ranges of the same extents,
           none reading another's result, get the same reduce ranges (and lane copy), so
           the linearizer places their updates in one loop nest (Note: scopes and loop
           nests). Each keeps its own accumulator and its own reduction clause.

    An accumulator whose value holds a nested reduction, and scans (whose loops carry a
    running value), keep their own loops; but double sums of float32 block sums (Note: float32
    sums in blocks, codegen/float_sums.py) share their block loop, and then, declared in one
    scope, their blocks' sums share the inner loop (the rewrite repeats until nothing is
    shared). `reduce_loop_count` counts the reduce loops a program opens
    (`ember.metrics.reduce_loops`).
"""

from __future__ import annotations

from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, UOp, substitute

# ---- early: identical reductions are one ---------------------------------------------


def merge_identical_reductions(sink: UOp) -> UOp:
    """Replace every REDUCE equal to an earlier one up to its ranges' names by that one.
    Repeats until nothing merges: merging two means may make two variances identical."""
    while True:
        mapping = _identical_reductions([u for u in sink.toposort if u.op is Ops.REDUCE])
        if not mapping:
            return sink
        sink = substitute(sink, mapping)


def _identical_reductions(reduces: list[UOp]) -> dict[UOp, UOp]:
    mapping: dict[UOp, UOp] = {}
    kept: dict[tuple, list[UOp]] = {}
    for red in reduces:
        key = (red.arg, red.dtype, tuple(r.src[0] for r in red.src[1:]), frozenset(red.ranges))
        for earlier in kept.setdefault(key, []):
            renamed = substitute(red.src[0], dict(zip(red.src[1:], earlier.src[1:])))
            if renamed is earlier.src[0]:
                mapping[red] = earlier
                break
        else:
            kept[key].append(red)
    return mapping


# ---- lower: independent accumulators share a loop ------------------------------------


def share_reduce_loops(sink: UOp) -> UOp:
    """Give ACC_UPDATEs of one scope and one loop shape, none reading another, the same
    reduce ranges (Note: shared reduce loops). Repeats until nothing is shared: accumulators
    nested in loops that now are one are declared in one scope, and may share theirs."""
    while True:
        mapping = _shared_loop_ranges(sink)
        if not mapping:
            return sink
        sink = substitute(sink, mapping)


def _shared_loop_ranges(sink: UOp) -> dict[UOp, UOp]:
    scans = {u.src[0] for u in sink.toposort if u.op is Ops.ACC_RUNNING}
    clusters: dict[tuple, list[list[UOp]]] = {}
    mapping: dict[UOp, UOp] = {}
    for update in (u for u in sink.toposort if u.op is Ops.ACC_UPDATE and u.src[0] not in scans):
        if _keeps_own_loops(update):
            continue
        acc = update.src[0]
        key = (acc.src, acc.arg.lanes, tuple(r.src[0] for r in loop_ranges(update)))
        for cluster in clusters.setdefault(key, []):
            if all(_independent(update, member) for member in cluster):
                mapping.update((r, s) for r, s in zip(loop_ranges(update), loop_ranges(cluster[0])) if r is not s)
                cluster.append(update)
                break
        else:
            clusters[key].append([update])
    return mapping


def loop_ranges(update: UOp) -> list[UOp]:
    """The ranges an ACC_UPDATE's loops walk, outermost first (a lane copy last)."""
    return sorted(update.src[2:], key=lambda r: r.arg.nesting)


def _keeps_own_loops(update: UOp) -> bool:
    """An accumulator declared inside this update's loops: its loop nest stays its own, unless it
    is a double sum of float32 block sums (Note: float32 sums in blocks, codegen/float_sums.py):
    two over one tensor's blocks walk them once, each block's sums sharing the inner loop."""
    walked = set(loop_ranges(update))
    nested = [u for u in update.src[1].toposort if u.op is Ops.DEFINE_ACC and not walked.isdisjoint(u.ranges)]
    if not nested:
        return False
    acc = update.src[0]
    return not (acc.dtype is dtypes.float64 and acc.arg.combine is Ops.ADD
                and all(n.dtype is dtypes.float32 and n.arg.combine is Ops.ADD for n in nested))  # fmt: skip


def _independent(a: UOp, b: UOp) -> bool:
    """Neither update's value reads the other's accumulator (directly or through others)."""
    return b.src[0] not in a.src[1].toposort and a.src[0] not in b.src[1].toposort


def reduce_loop_count(program: list[UOp]) -> int:
    """Reduce loops a linearized program opens (lane loops of column reductions not counted)."""
    lane_copies = {u.src[-1] for u in program if u.op is Ops.ACC_UPDATE and u.src[0].arg.lanes > 1}
    return sum(1 for u in program if u.op is Ops.RANGE and u.arg.reduce and u not in lane_copies)
