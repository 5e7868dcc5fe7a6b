"""Tests of ember.uop.pattern (UPat, PatternMatcher, graph_rewrite) and of UOp interning in ember.uop.ops."""

from __future__ import annotations

import gc
import math
import weakref

from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, RangeKind, UOp, substitute
from ember.uop.pattern import PatternMatcher, UPat, graph_rewrite

r0, r1, r2 = UOp.range(8, 0), UOp.range(4, 1), UOp.range(16, 2)


def index(value: int) -> UOp:
    return UOp.const(dtypes.index, value)


def matches(pat: UPat, u: UOp) -> list[dict[str, UOp]]:
    return list(pat.match(u, {}))


# ---- UPat ---------------------------------------------------------------------------------


class TestUPat:
    def test_op_and_dtype_filters(self):
        assert matches(UPat(Ops.ADD), r0 + 1)
        assert not matches(UPat(Ops.MUL), r0 + 1)
        assert matches(UPat((Ops.MUL, Ops.ADD)), r0 + 1)
        assert matches(UPat.var("x", dtypes.index), r0)
        assert not matches(UPat.var("x", dtypes.int32), r0)
        assert matches(UPat.var("x", (dtypes.int32, dtypes.index)), r0)

    def test_captures(self):
        assert matches(UPat.var("x") + UPat.cvar("c"), r0 + 1) == [{"x": r0, "c": index(1)}]

    def test_const_matches_by_value(self):
        assert matches(UPat.var("x") * 1, r0 * 1)
        assert not matches(UPat.var("x") * 1, r0 * 2)

    def test_commutative_op_matches_either_order(self):
        pat = UPat.var("x") + UPat.cvar("c")
        swapped = UOp(Ops.ADD, dtypes.index, (index(1), r0))
        assert matches(pat, swapped) == [{"x": r0, "c": index(1)}]

    def test_non_commutative_op_matches_in_order_only(self):
        pat = UPat.var("x") - UPat.cvar("c")
        assert matches(pat, r0 - 1)
        assert not matches(pat, UOp(Ops.SUB, dtypes.index, (index(1), r0)))

    def test_commutative_match_yields_every_way(self):
        found = matches(UPat.var("a") + UPat.var("b"), r0 + r1)
        assert {(m["a"], m["b"]) for m in found} == {(r0, r1), (r1, r0)}

    def test_same_name_must_capture_the_same_uop(self):
        pat = UPat.var("x") - UPat.var("x")
        assert matches(pat, r0 - r0) == [{"x": r0}]
        assert not matches(pat, r0 - r1)

    def test_same_name_across_levels(self):
        pat = UPat.var("x") * UPat.cvar("c") + UPat.var("x")
        assert matches(pat, r0 * 4 + r0)
        assert matches(pat, r0 + r0 * 4)  # found by commuting the ADD
        assert not matches(pat, r0 * 4 + r1)

    def test_source_count_must_agree(self):
        assert not matches(UPat(Ops.NEG, src=(UPat.var("x"), UPat.var("y"))), -r0)

    def test_arg_match(self):
        assert matches(UPat(Ops.RANGE, arg=r0.arg), r0)
        assert not matches(UPat(Ops.RANGE, arg=r1.arg), r0)

    def test_bool_const_matches(self):
        assert matches(UPat.const(True), UOp.const(dtypes.bool, True))

    def test_bool_pattern_does_not_match_int(self):
        assert not matches(UPat.const(True), index(1))


# ---- PatternMatcher -----------------------------------------------------------------------


class TestPatternMatcher:
    def test_first_rule_that_returns_wins(self):
        pm = PatternMatcher(
            [
                (UPat(Ops.ADD, name="u"), lambda u: None),  # declines
                (UPat(Ops.ADD, name="u"), lambda u: u),  # returning the same UOp declines too
                (UPat(Ops.ADD), lambda: index(1)),
                (UPat(Ops.ADD), lambda: index(2)),
            ]
        )
        assert pm.rewrite(r0 + r1) is index(1)

    def test_no_rule_gives_none(self):
        assert PatternMatcher([(UPat(Ops.MUL), lambda: index(0))]).rewrite(r0 + r1) is None

    def test_wildcard_rules_apply_to_every_op(self):
        pm = PatternMatcher([(UPat(name="u"), lambda u: index(7) if u.op is Ops.SUB else None)])
        assert pm.rewrite(r0 - r1) is index(7)
        assert pm.rewrite(r0 + r1) is None

    def test_ctx_is_passed_to_rules_that_ask(self):
        seen: list[UOp] = []
        pm = PatternMatcher(
            [
                (UPat(Ops.RANGE, name="r"), lambda ctx, r: ctx.append(r)),
                (UPat(Ops.ADD, src=(UPat.var("x"), UPat.const(0))), lambda x: x),
            ]
        )
        assert graph_rewrite((r0 + 0) * r1, pm, ctx=seen) is r0 * r1
        assert set(seen) == {r0, r1}

    def test_concatenation_keeps_order(self):
        first = PatternMatcher([(UPat(Ops.ADD), lambda: index(1))])
        second = PatternMatcher([(UPat(Ops.ADD), lambda: index(2)), (UPat(Ops.MUL), lambda: index(3))])
        both = first + second
        assert both.rewrite(r0 + r1) is index(1)
        assert both.rewrite(r0 * r1) is index(3)


# ---- graph_rewrite ------------------------------------------------------------------------

pm_fold_add = PatternMatcher(
    [
        (UPat.var("x") + 0, lambda x: x),  # x + 0 -> x
        (UPat.cvar("a") + UPat.cvar("b"), lambda a, b: a.const_like(a.arg + b.arg)),  # a + b -> c
        (UPat(Ops.NEG, src=(UPat(Ops.NEG, src=(UPat.var("x"),)),)), lambda x: x),  # -(-x) -> x
    ]
)


class TestGraphRewrite:
    def test_bottom_up_to_fixpoint(self):
        assert graph_rewrite(((r0 + 0) + 0) + 0, pm_fold_add) is r0
        assert graph_rewrite((index(1) + index(2)) + (index(3) + index(4)), pm_fold_add) is index(10)
        assert graph_rewrite(r0.alu(Ops.NEG).alu(Ops.NEG).alu(Ops.NEG).alu(Ops.NEG), pm_fold_add) is r0

    def test_replacement_is_rewritten_too(self):
        pm = pm_fold_add + PatternMatcher([(UPat.var("x") * 2, lambda x: (x + 0) + (x + 0))])  # x*2 -> (x+0)+(x+0)
        assert graph_rewrite(r0 * 2, pm) is r0 + r0

    def test_rule_enabled_by_a_rewritten_source(self):
        pm = PatternMatcher(
            [
                (UPat(Ops.MUL, src=(UPat.var("x"), UPat.const(0))), lambda x: x.const_like(0)),  # x*0 -> 0
                (UPat.var("x") + 0, lambda x: x),  # x + 0 -> x
            ]
        )
        assert graph_rewrite(r1 + r0 * 0, pm) is r1

    def test_untouched_graph_is_returned_as_is(self):
        expr = (r0 * 4 + r1) // 4
        assert graph_rewrite(expr, pm_fold_add) is expr

    def test_shared_subexpressions_are_rewritten_once(self):
        calls: list[UOp] = []
        pm = PatternMatcher([(UPat(Ops.ADD, name="u"), lambda ctx, u: ctx.append(u))])
        shared = r0 + r1
        graph_rewrite(shared * shared - shared, pm, ctx=calls)
        assert calls == [shared]

    def test_deep_graph(self):
        expr = r0
        for _ in range(2000):
            expr = expr + 0
        assert graph_rewrite(expr, pm_fold_add) is r0


# ---- interning and substitute -------------------------------------------------------------


class TestInterning:
    def test_equal_uops_are_the_same_object(self):
        assert UOp.range(8, 0) is r0
        assert r0 * 4 + r1 is r0 * 4 + r1
        assert UOp(Ops.ADD, dtypes.index, (r0, r1)) is r0 + r1

    def test_different_uops_are_different_objects(self):
        assert r0 + r1 is not r1 + r0
        assert index(1) is not UOp.const(dtypes.int32, 1)
        assert UOp.range(8, 0, RangeKind.REDUCE) is not r0

    def test_constants_are_normalized_to_their_dtype(self):
        assert UOp.const(dtypes.float32, 1) is UOp.const(dtypes.float32, 1.0)
        assert UOp.const(dtypes.index, 2.0) is index(2)
        assert UOp.const(dtypes.bool, 1) is UOp.const(dtypes.bool, True)

    def test_negative_zero_stays_distinct(self):
        zero, negative_zero = UOp.const(dtypes.float32, 0.0), UOp.const(dtypes.float32, -0.0)
        assert zero is not negative_zero
        assert math.copysign(1.0, negative_zero.arg) == -1.0
        assert zero is UOp.const(dtypes.float32, 0.0)

    def test_nan_constants_merge(self):
        assert UOp.const(dtypes.float32, math.nan) is UOp.const(dtypes.float32, math.nan)

    def test_bool_and_int_args_stay_distinct(self):
        assert UOp(Ops.CONST, dtypes.index, (), 1) is not UOp(Ops.CONST, dtypes.index, (), True)

    def test_unused_uops_are_collected(self):
        made = UOp.const(dtypes.index, 918273645) * r0
        assert made.toposort[-1] is made  # a cached property that refers back to the UOp: a reference cycle
        ref = weakref.ref(made)
        del made
        gc.collect()
        assert ref() is None

    def test_key_is_stable_and_structural(self):
        assert (r0 + 1).key == (r0 + 1).key
        assert (r0 + 1).key != (r0 + 2).key
        assert UOp.const(dtypes.float32, 0.0).key != UOp.const(dtypes.float32, -0.0).key


class TestSubstitute:
    def test_replaces_every_occurrence(self):
        assert substitute(r0 * 4 + r0, {r0: r2}) is r2 * 4 + r2

    def test_keeps_untouched_subtrees(self):
        expr = (r0 * 4 + r1) // 4
        assert substitute(expr, {r2: r0}) is expr
        assert substitute(expr, {r0: r2}).src[1] is index(4)

    def test_replaces_whole_subexpressions(self):
        assert substitute((r0 * 4 + r1) // 4, {r0 * 4 + r1: r2}) is r2 // 4

    def test_is_one_pass(self):
        assert substitute(r0 + r1, {r0: r1, r1: r0}) is r1 + r0
