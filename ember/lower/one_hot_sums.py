"""Stage `lower`: a sum over one dim of a value that is nonzero at one position only becomes
that position's value (`pm_one_hot_sums`, applied by lower/reductions.py `reduce` to each REDUCE
it builds, before graph.py decides whether the result is realized).

Note: a one-hot sum is a select
    The gradient of a log-softmax reads `sum_r g[r]` where g is nll_loss's gradient: a scatter of
    one element per row (Note: a scatter of one element per row is a select, scatter.py), so
    g[r] = where(r == t, -w, 0) * ... with t the row's target. As a REDUCE it was a looped kernel
    of its own over every column of the logits (32000 for a language model), realized, read back
    by the gradient's kernel. Such a sum has one term that can differ from the others:

        sum_{r < R} v(r), where r appears in v only through `r == t` (t does not vary with r)
                          and in what the comparison's true side reads (the picked element)

    Let v1 = v with the comparison true and r := t (a gather at t, clamped into [0, R) so that it
    reads in bounds), v0 = v with the comparison false. When v0 does not vary with r and is
    provably zero or NaN (0 * w: a float zero unless w is infinite or NaN), the R terms are v1
    (when 0 <= t < R) and R - 1 (or R) copies of v0, and for R >= 2 eager's sum of them, in any
    order, is

        where(0 <= t < R, v1, 0) + v0    (NaN when v0 is: eager's 0 * inf in the other columns;
                                         otherwise v1, or 0 for a t out of range)

    in the REDUCE's own dtype (integers: v0 is 0, the sum is the select). Not rewritten: a v0 that
    varies with r (one_hot(t) * x summed: NaN or inf anywhere in x's row must reach the sum, which
    only a walk of the row finds), a CHECK that varies with r (eager raises for a bad index in any
    column, not only the picked one), a symbolic R that may be below 2, and anything but a sum over
    one range. The kernel that computed the sum is gone; its reader computes the select per row
    (tests/test_one_hot_sums.py counts the kernels).
"""

from __future__ import annotations

from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, UOp, substitute
from ember.uop.pattern import PatternMatcher, UPat, graph_rewrite
from ember.uop.symbolic import simplify


def compared_position(compare: UOp, r: UOp) -> UOp | None:
    """t, when `compare` is `r == t` (or `t == r`, r possibly cast to an integer) and t does not vary with r."""
    for this, other in ((compare.src[0], compare.src[1]), (compare.src[1], compare.src[0])):
        this = simplify(this)  # arange's values: r * 1 + 0
        is_r = this is r or (this.op is Ops.CAST and this.src[0] is r and this.dtype.is_int)
        if is_r and r not in other.ranges and other.dtype.is_int:
            return other
    return None


def zero_or_nan(u: UOp) -> bool:
    """Whether `u` is, for every input, zero (of either sign) or NaN, judged from its structure."""
    if not u.dtype.is_float:
        return u.vmin == 0 and u.vmax == 0  # integers and bools: exactly zero
    if u.op is Ops.CONST:
        return u.arg == 0
    if u.op is Ops.MUL:  # 0 * x is +-0, or NaN when x is infinite or NaN
        return zero_or_nan(u.src[0]) or zero_or_nan(u.src[1])
    if u.op is Ops.FDIV:  # 0 / x is +-0, or NaN when x is 0 or NaN
        return zero_or_nan(u.src[0])
    if u.op in (Ops.NEG, Ops.CAST):  # a float cast keeps NaN; from an integer, zero stays zero
        return zero_or_nan(u.src[0])
    if u.op in (Ops.ADD, Ops.SUB):
        return zero_or_nan(u.src[0]) and zero_or_nan(u.src[1])
    if u.op is Ops.WHERE:
        return zero_or_nan(u.src[1]) and zero_or_nan(u.src[2])
    return False


def cast_const(c: UOp, u: UOp) -> UOp:
    return UOp.const(u.dtype, c.arg)


_bool, _x, _y = UPat.cvar("c", dtypes.bool), UPat.var("x"), UPat.var("y")
# what the comparison's value decides, folded (pm_symbolic folds integer math only)
pm_decided = PatternMatcher(
    [
        (UPat(Ops.WHERE, src=(_bool, _x, _y)), lambda c, x, y: x if c.arg else y),  # where(True, x, y) -> x
        (UPat(Ops.AND, src=(_bool, _x)), lambda c, x: x if c.arg else c),  # True & x -> x, False & x -> False
        (UPat(Ops.OR, src=(_bool, _x)), lambda c, x: c if c.arg else x),  # True | x -> True, False | x -> x
        (UPat(Ops.NOT, src=(_bool,)), lambda c: UOp.const(dtypes.bool, not c.arg)),  # not True -> False
        (UPat(Ops.CAST, src=(_bool,), name="u"), cast_const),  # float(False) -> 0.0
    ]
)


def decided(value: UOp, compare: UOp, outcome: bool) -> UOp:
    """`value` where `compare` is `outcome`, with what that decides folded."""
    return simplify(graph_rewrite(substitute(value, {compare: UOp.const(dtypes.bool, outcome)}), pm_decided))


def one_hot_sum(red: UOp) -> UOp | None:
    """Note: a one-hot sum is a select. None: the sum is not of that form."""
    if len(red.src) != 2:
        return None
    value, r = red.src
    size = r.src[0]
    if size.vmin < 2:  # (lowering makes no range of size 1; a symbolic size may be 0 or 1)
        return None
    compares = {u: t for u in value.toposort if u.op is Ops.CMPEQ and (t := compared_position(u, r)) is not None}
    if len(compares) != 1 or any(u.op is Ops.CHECK and r in u.ranges for u in value.toposort):
        return None
    ((compare, t),) = compares.items()
    skipped = decided(value, compare, False)
    if r in skipped.ranges or not zero_or_nan(skipped):
        return None
    index = t if t.dtype is dtypes.index else t.cast(dtypes.index)
    last = simplify(size.alu(Ops.SUB, UOp.const(dtypes.index, 1)))
    position = index.alu(Ops.MIN, last).alu(Ops.MAX, UOp.const(dtypes.index, 0))
    picked = substitute(decided(value, compare, True), {r: position})
    inside = UOp.const(dtypes.index, 0).alu(Ops.CMPLE, index).alu(Ops.AND, index.lt(size))
    select = inside.where(picked, UOp.const(red.dtype, 0))
    select = select.alu(Ops.ADD, skipped) if red.dtype.is_float else select
    return graph_rewrite(simplify(select), pm_decided)  # a t checked in range earlier needs no where


pm_one_hot_sums = PatternMatcher(
    [
        # sum_r where(r == t, a, 0 * w) -> where(0 <= t < R, a[t], 0) + 0 * w
        (UPat(Ops.REDUCE, arg=Ops.ADD, name="red"), one_hot_sum),
    ]
)
