"""Stage `codegen` (block backends), part of block lowering: a sum of exponentials shifted by the
maximum of the same row (softmax's denominator, log_softmax, logsumexp, cross_entropy), found in a
kernel AST after `phases.block_rewrite` (`exp_sum_of_max`), and the block UOps that compute it in
the maximum's own looped phase (`online_update`, `row_total`, `lane_total`), which
codegen/block_lowering.py uses.

Note: a row's exponential sum in one pass
    Lowered as written, S = sum_r exp(x_r - c), with c a function of M = max_r x_r, needs M before
    its first term: a looped variant walks a long row twice, once for M and once for S. Instead the
    maximum's loop keeps a running maximum m and, in each lane of the [XBLOCK, RBLOCK] tile, a sum
    s = sum exp(x - ref(m)) of what that lane has seen, relative to ref(m) = m, or 0 where m = +inf.
    With config.online_softmax "row" (the default) m is the row's, each chunk's maximum folded in (a
    block max per chunk: one exp and one float64 conversion of the rescale per row and chunk, one of
    each per element for its term, as the second pass had); with "lane" each lane keeps its own
    (no reduction across lanes inside the loop, but a second exp and conversion per element). For a
    chunk, with m' = max(m, the chunk's elements (row) or element (lane)):
        s' = (m' == m ? s : s * exp(ref(m) - ref(m')))  +  (m' == -inf ? 0 : exp(x - ref(m')))
    and after the loop, once M and c are known, S = sum over lanes of s, times exp(ref(M) - c)
    (row), or the sum over lanes of s * exp(ref(m) - c) (lane). exp(x - r) * exp(r - c) is
    exp(x - c), so S is eager's sum up to rounding (each term rounded against the running maximum,
    the rescale factor once more), and the row is read once. Eager's infinities and NaNs come out
    the same: a lane that has seen only -inf keeps s = 0 (the guard on its term), so it adds 0
    unless c is -inf (a row of -inf, whose terms eager makes NaN, as exp(-inf - c) is then); a +inf
    makes s = inf, and the total inf * exp(0 - c) is NaN for c = +inf (as eager's inf - inf) and inf
    for a finite c (logsumexp's c, where(|M| == inf, 0, M)); a NaN makes m, s and S NaN. Only shifts
    that are -inf exactly when M is are taken (M itself, or M with some rows replaced by a finite
    constant): a finite row with c = -inf would need eager's NaN for its -inf terms. Terms are summed
    in the sum's own accumulator dtype (float64 for a float32 sum, as every reduction is), the
    exponentials computed in the terms' dtype, as written; only casts that widen are taken between
    them, so no rounding of eager's is skipped. The maximum's accumulator is read before its update
    (ACC_PRIOR) and replaced (AccUpdate.REPLACE), as is the sum's. `ember.metrics.reduce_loops`
    counts one loop for both reductions.

    Each lane's running sum is float32 where the sum is float64 and its terms are float32 or
    narrower (`lane_sum_dtype`): a lane adds one term per chunk, at most row / RBLOCK of them (125
    for a 128256-word vocabulary in chunks of 1024), each in [0, 1] against the running maximum,
    so its rounding error stays below eager's own float32 sum's; the lanes are widened to float64
    before they are added up and scaled. A float64 lane sum cost a conversion per element, which
    with the exponential made bf16 cross_entropy over 16384 x 128256 logits compute-bound (0.70
    of copy bandwidth on an H100).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import Ops, UOp, substitute
from ember.uop.pattern import UPat

_EXP_OF_DIFFERENCE = UPat(Ops.EXP, src=(UPat(Ops.SUB, src=(UPat.var("x"), UPat.var("shift"))),))
_MAXIMUM = UPat(Ops.REDUCE, arg=Ops.MAX, name="maximum")
# the shifts that are -inf exactly where the maximum is: M, or M with some rows set to a finite constant
_SHIFTS = (
    _MAXIMUM,
    UPat(Ops.WHERE, src=(UPat.var("condition"), UPat.cvar("constant"), _MAXIMUM)),
    UPat(Ops.WHERE, src=(UPat.var("condition"), _MAXIMUM, UPat.cvar("constant"))),
)


@dataclass(frozen=True)
class ExpSum:
    """A REDUCE(casts(EXP(SUB(x, shift))), ADD) whose shift is a function of `maximum`, the MAX of
    the same x over as many elements (Note: a row's exponential sum in one pass)."""

    maximum: UOp  # REDUCE(x, *its ranges, MAX)
    shift: UOp  # c: constant along the row
    casts: tuple[DType, ...]  # the widening casts from the exponential to the sum's dtype, innermost first


def exp_sum_of_max(red: UOp) -> ExpSum | None:
    """`red` as an ExpSum, or None when it is any other reduction."""
    if red.op is not Ops.REDUCE or red.arg is not Ops.ADD or not red.dtype.is_float:
        return None
    value, casts = _without_widening_casts(red.src[0])
    for captures in _EXP_OF_DIFFERENCE.match(value, {}):
        x, shift = captures["x"], captures["shift"]
        maximum = _maximum_of_shift(shift)
        if maximum is None or not shift.ranges.isdisjoint(red.src[1:]):
            continue
        if x.dtype is value.dtype and _same_row(maximum, red, x):
            return ExpSum(maximum, shift, casts)
    return None


def _without_widening_casts(value: UOp) -> tuple[UOp, tuple[DType, ...]]:
    """`value` under its float casts that lose nothing (float32 -> float64), and those casts."""
    casts: list[DType] = []
    while value.op is Ops.CAST and value.dtype.is_float and value.src[0].dtype.is_float:
        if value.dtype.itemsize <= value.src[0].dtype.itemsize:
            break
        casts.append(value.dtype)
        value = value.src[0]
    return value, tuple(reversed(casts))


def _maximum_of_shift(shift: UOp) -> UOp | None:
    for pattern in _SHIFTS:
        for captures in pattern.match(shift, {}):
            constant = captures.get("constant")
            if constant is None or (isinstance(constant.arg, float) and math.isfinite(constant.arg)):
                return captures["maximum"]
    return None


def _same_row(maximum: UOp, red: UOp, x: UOp) -> bool:
    """Whether `maximum` reduces `x` over ranges of the sizes `red` walks, and the shift it makes
    (built from it) does not vary along `red`'s row."""
    ranges, own = red.src[1:], maximum.src[1:]
    if len(ranges) != len(own) or any(a.src[0] is not b.src[0] for a, b in zip(ranges, own)):
        return False
    if maximum.dtype is not x.dtype or x.ranges.isdisjoint(ranges):
        return False
    return substitute(maximum.src[0], dict(zip(own, ranges))) is x


def reference(m: UOp) -> UOp:
    """What a lane's sum is taken relative to: its maximum, or 0 once that is +inf."""
    return m.alu(Ops.CMPEQ, m.const_like(math.inf)).where(m.const_like(0.0), m)


def _widened(value: UOp, casts: tuple[DType, ...]) -> UOp:
    for dtype in casts:
        value = value.cast(dtype)
    return value


def lane_sum_dtype(sum_dtype: DType, found: ExpSum) -> DType:
    """The dtype of each lane's running sum: float32 for a float64 sum of terms no wider."""
    if sum_dtype is dtypes.float64 and found.maximum.dtype.itemsize <= 4:
        return dtypes.float32
    return sum_dtype


def summed_as(found: ExpSum, lane: DType) -> ExpSum:
    """`found` with its terms widened only as far as `lane`."""
    casts = tuple(c for c in found.casts if c.itemsize <= lane.itemsize)
    if (casts[-1] if casts else found.maximum.dtype) is not lane:
        casts += (lane,)
    return replace(found, casts=casts)


def online_update(found: ExpSum, prior_max: UOp, new_max: UOp, prior_sum: UOp, x: UOp) -> UOp:
    """A lane's sum after element `x` (masked lanes: -inf), from its sum and maximum before it and
    its maximum after (Note: a row's exponential sum in one pass)."""
    new_reference = reference(new_max)
    rescale = _widened(reference(prior_max).alu(Ops.SUB, new_reference).alu(Ops.EXP), found.casts)
    kept = prior_max.alu(Ops.CMPEQ, new_max).where(prior_sum, prior_sum.alu(Ops.MUL, rescale))
    term = new_max.alu(Ops.CMPEQ, new_max.const_like(-math.inf)).where(
        x.const_like(0.0), x.alu(Ops.SUB, new_reference).alu(Ops.EXP)
    )
    return kept.alu(Ops.ADD, _widened(term, found.casts))


def lane_total(found: ExpSum, lane_sum: UOp, lane_max: UOp, shift: UOp) -> UOp:
    """A lane's share of the row's sum once the row's shift is known: s * exp(ref(m) - c)."""
    return lane_sum.alu(Ops.MUL, _rescale(found, lane_max, shift))


def row_total(found: ExpSum, row_sum: UOp, row_max: UOp, shift: UOp) -> UOp:
    """The row's sum, its lanes' sums relative to the row's maximum M added: S * exp(ref(M) - c)."""
    return row_sum.alu(Ops.MUL, _rescale(found, row_max, shift))


def _rescale(found: ExpSum, maximum: UOp, shift: UOp) -> UOp:
    return _widened(reference(maximum).alu(Ops.SUB, shift).alu(Ops.EXP), found.casts)
