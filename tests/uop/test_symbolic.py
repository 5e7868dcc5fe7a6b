"""Tests of ember.uop.symbolic: one class per rule family, then a randomized equivalence check.

The randomized check builds index expressions from RANGEs, a free (possibly negative) variable and
constants, simplifies them, and evaluates both forms at random in-bound points with C semantics.
"""

from __future__ import annotations

import operator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import BufferArg, Ops, UOp
from ember.uop.symbolic import simplify

r0, r1, r2 = UOp.range(8, 0), UOp.range(4, 1), UOp.range(16, 2)


def index(value: int) -> UOp:
    return UOp.const(dtypes.index, value)


def load(name: str, dtype: DType) -> UOp:
    """A value read from memory: its bounds are all of `dtype`, so no bound-based rule can apply to it."""
    buffer = UOp(Ops.BUFFER, dtype, (), BufferArg(name, 16))
    return UOp(Ops.LOAD, dtype, (UOp(Ops.INDEX, dtype, (buffer, index(0))),))


# ---- an evaluator with C semantics -----------------------------------------------------------


def c_div(a: int, b: int) -> int:
    return -(-a // b) if (a < 0) != (b < 0) else a // b


BINARY = {
    Ops.ADD: operator.add,
    Ops.SUB: operator.sub,
    Ops.MUL: operator.mul,
    Ops.IDIV: c_div,
    Ops.MOD: lambda a, b: a - b * c_div(a, b),
    Ops.MAX: max,
    Ops.MIN: min,
    Ops.CMPLT: operator.lt,
    Ops.CMPLE: operator.le,
    Ops.CMPEQ: operator.eq,
    Ops.CMPNE: operator.ne,
}


def evaluate(root: UOp, env: dict[UOp, int]) -> int:
    """The value of `root` when each RANGE or LOAD `u` holds env[u]."""
    values: dict[UOp, int] = {}
    for u in root.toposort:
        args = [values[s] for s in u.src]
        if u.op is Ops.CONST:
            values[u] = u.arg
        elif u.op in (Ops.RANGE, Ops.LOAD):
            values[u] = env[u]
        elif u.op is Ops.NEG:
            values[u] = -args[0]
        elif u.op is Ops.WHERE:
            values[u] = args[1] if args[0] else args[2]
        elif u.op in BINARY:
            values[u] = BINARY[u.op](*args)
        elif u.op in (Ops.INDEX, Ops.BUFFER):
            values[u] = 0
        else:
            raise NotImplementedError(u.op)
    return values[root]


def test_evaluator_uses_c_semantics():
    assert evaluate(index(-7) // index(2), {}) == -3
    assert evaluate(index(-7) % index(2), {}) == -1
    assert evaluate(index(7) % index(-2), {}) == 1


# ---- rule families -------------------------------------------------------------------------


class TestConstantFolding:
    @pytest.mark.parametrize(
        "op, a, b, expected",
        [
            (Ops.ADD, 3, 4, 7),
            (Ops.SUB, 3, 4, -1),
            (Ops.MUL, -3, 4, -12),
            (Ops.IDIV, 7, 2, 3),
            (Ops.IDIV, -7, 2, -3),
            (Ops.IDIV, 7, -2, -3),
            (Ops.IDIV, -7, -2, 3),
            (Ops.MOD, 7, 3, 1),
            (Ops.MOD, -7, 3, -1),
            (Ops.MOD, 7, -3, 1),
            (Ops.MAX, -2, 5, 5),
            (Ops.MIN, -2, 5, -2),
        ],
    )
    def test_binary(self, op, a, b, expected):
        assert simplify(UOp(op, dtypes.index, (index(a), index(b)))) is index(expected)

    @pytest.mark.parametrize(
        "op, a, b, expected",
        [(Ops.CMPLT, 1, 2, True), (Ops.CMPLT, 2, 2, False), (Ops.CMPLE, 2, 2, True)]
        + [(Ops.CMPEQ, 2, 2, True), (Ops.CMPEQ, 1, 2, False), (Ops.CMPNE, 1, 2, True)],
    )
    def test_comparison(self, op, a, b, expected):
        assert simplify(index(a).alu(op, index(b))) is UOp.const(dtypes.bool, expected)

    def test_neg(self):
        assert simplify(-index(5)) is index(-5)

    def test_nested(self):
        assert simplify((index(1) + index(2)) * (index(10) - index(4))) is index(18)

    def test_division_by_zero_is_left_alone(self):
        for expr in (index(1) // index(0), index(1) % index(0)):
            assert simplify(expr) is expr

    def test_overflow_is_left_alone(self):
        big = UOp.const(dtypes.int32, dtypes.int32.max)
        expr = big + UOp.const(dtypes.int32, 1)
        assert simplify(expr) is expr

    def test_dtype_is_kept(self):
        assert simplify(UOp.const(dtypes.int32, 2) * UOp.const(dtypes.int32, 3)) is UOp.const(dtypes.int32, 6)


class TestIdentities:
    def test_add_zero(self):
        assert simplify(r0 + 0) is r0
        assert simplify(0 + r0) is r0

    def test_sub_zero(self):
        assert simplify(r0 - 0) is r0

    def test_mul_one_and_zero(self):
        assert simplify(r0 * 1) is r0
        assert simplify(1 * r0) is r0
        assert simplify(r0 * 0) is index(0)

    def test_div_and_mod_by_one(self):
        x = load("x", dtypes.int32)
        assert simplify(x // 1) is x
        assert simplify(x % 1) is UOp.const(dtypes.int32, 0)

    def test_self_cancelling(self):
        assert simplify(r0 - r0) is index(0)
        assert simplify((r0 + r1) - r1) is r0
        assert simplify((r1 + r0) - r1) is r0
        assert simplify(-(-r0)) is r0

    def test_max_min_of_same(self):
        x = load("x", dtypes.int32)
        assert simplify(x.alu(Ops.MAX, x)) is x
        assert simplify(x.alu(Ops.MIN, x)) is x

    def test_compare_with_itself(self):
        x = load("x", dtypes.int32)
        assert simplify(x.lt(x)) is UOp.const(dtypes.bool, False)
        assert simplify(x.alu(Ops.CMPLE, x)) is UOp.const(dtypes.bool, True)
        assert simplify(x.alu(Ops.CMPEQ, x)) is UOp.const(dtypes.bool, True)
        assert simplify(x.alu(Ops.CMPNE, x)) is UOp.const(dtypes.bool, False)

    def test_identities_hold_for_unsigned(self):
        y = load("y", dtypes.uint8)
        assert simplify(y + 0) is y
        assert simplify(y * 1) is y
        assert simplify(y - y) is UOp.const(dtypes.uint8, 0)


class TestReassociation:
    def test_constants_to_the_right(self):
        assert simplify(index(3) + r0) is r0 + 3
        assert simplify(index(3) * r0) is r0 * 3

    def test_add_constants(self):
        assert simplify((r0 + 2) + 3) is r0 + 5
        assert simplify((r0 + 2) - 2) is r0
        assert simplify(r0 - 3) is r0 + (-3)

    def test_mul_constants(self):
        assert simplify((r0 * 2) * 3) is r0 * 6

    def test_constants_move_outward(self):
        assert simplify((r0 + 1) + r1) is (r0 + r1) + 1
        assert simplify((r0 + 1) + (r1 + 2)) is (r1 + r0) + 3

    def test_distribute_constant(self):
        assert simplify((r0 + 1) * 4) is r0 * 4 + 4

    def test_collect_like_terms(self):
        assert simplify(r0 * 2 + r0 * 3) is r0 * 5
        assert simplify(r0 + r0 * 3) is r0 * 4
        assert simplify(r0 + r0) is r0 * 2
        assert simplify(r0 * 2 + r0 * -2) is index(0)

    def test_unsigned_constant_that_does_not_fit_is_not_made(self):
        y = load("y", dtypes.uint8)
        expr = y - UOp.const(dtypes.uint8, 3)  # y + (-3) would need a negative uint8
        assert simplify(expr) is expr
        expr = (y + UOp.const(dtypes.uint8, 200)) + UOp.const(dtypes.uint8, 100)
        assert simplify(expr) is expr


class TestBounds:
    def test_div_mod_below_divisor(self):
        assert simplify(r1 // 4) is index(0)
        assert simplify(r1 % 4) is r1
        assert simplify(r1 % 5) is r1

    def test_div_mod_within_one_period(self):
        assert simplify((r1 + 4) // 4) is index(1)
        assert simplify((r1 + 4) % 4) is r1

    def test_div_mod_not_decided(self):
        assert simplify(r0 // 4) is r0 // 4
        assert simplify(r0 % 4) is r0 % 4

    def test_comparisons(self):
        true, false = UOp.const(dtypes.bool, True), UOp.const(dtypes.bool, False)
        assert simplify(r0.lt(8)) is true
        assert simplify(r0.lt(0)) is false
        assert simplify(r0.lt(r1 + 8)) is true
        assert simplify(r0.alu(Ops.CMPLE, index(7))) is true
        assert simplify(r0.alu(Ops.CMPEQ, index(8))) is false
        assert simplify(r0.alu(Ops.CMPNE, index(-1))) is true
        assert simplify(r0.lt(4)) is r0.lt(4)

    def test_max_min(self):
        assert simplify(r1.alu(Ops.MAX, index(3))) is index(3)
        assert simplify(r1.alu(Ops.MAX, index(0))) is r1
        assert simplify(r1.alu(Ops.MIN, index(3))) is r1
        assert simplify(r1.alu(Ops.MIN, r0 + 4)) is r1
        assert simplify(r1.alu(Ops.MAX, index(2))) is r1.alu(Ops.MAX, index(2))

    def test_where(self):
        assert simplify(UOp.const(dtypes.bool, True).where(r0, r1)) is r0
        assert simplify(UOp.const(dtypes.bool, False).where(r0, r1)) is r1
        assert simplify(r0.lt(8).where(r0, r1)) is r0
        assert simplify(r0.lt(4).where(r1, r1)) is r1

    def test_div_by_itself(self):
        assert simplify((r0 + 1) // (r0 + 1)) is index(1)
        assert simplify(r0 // r0) is r0 // r0  # r0 can be 0

    def test_unsigned_bounds_are_not_trusted(self):
        y = load("y", dtypes.uint8)
        expr = (y + UOp.const(dtypes.uint8, 1)).lt(UOp.const(dtypes.uint8, 1))  # y = 255 wraps to 0 < 1
        assert simplify(expr) is expr


class TestDivMod:
    def test_sum_with_multiple_of_divisor(self):
        assert simplify((r0 * 4 + r1) // 4) is r0
        assert simplify((r0 * 4 + r1) % 4) is r1
        assert simplify((r1 + r0 * 4) // 4) is r0

    def test_sum_with_constant(self):
        assert simplify((r0 * 4 + r1 + 4) // 4) is r0 + 1
        assert simplify((r0 * 4 + r1 + 4) % 4) is r1
        assert simplify(((r0 + 1) * 4 + r1) // 4) is r0 + 1

    def test_three_dimensional_index(self):
        flat = r0 * 64 + r2 * 4 + r1
        assert simplify(flat // 64) is r0
        assert simplify((flat // 4) % 16) is r2
        assert simplify(flat % 4) is r1
        assert simplify(flat % 64) is r2 * 4 + r1

    def test_remainder_that_does_not_fold(self):
        assert simplify((r0 * 4 + r2) // 4) is r0 + r2 // 4
        assert simplify((r0 * 4 + r2) % 4) is r2 % 4

    def test_exact_multiples(self):
        assert simplify((r0 * 8) // 4) is r0 * 2
        assert simplify((r0 * 8) % 4) is index(0)
        assert simplify((r0 * 4) // 4) is r0

    def test_common_factor(self):
        assert simplify((r0 * 2) // 4) is r0 // 2
        assert simplify((r0 * 6 + r2 * 4) // 4) is r2 + (r0 * 3) // 2
        assert simplify((r0 * 6 + r2 * 4) % 4) is ((r0 * 3) % 2) * 2

    def test_nested_division(self):
        assert simplify((r2 // 2) // 2) is r2 // 4
        assert simplify(((r0 * 16 + r2) // 2) // 4) is r0 * 2 + r2 // 8

    def test_division_of_remainder(self):
        assert simplify((r2 % 8) // 4) is (r2 // 4) % 2
        assert simplify((r2 % 8) % 4) is r2 % 4

    def test_possibly_negative_dividend_is_left_alone(self):
        x = load("x", dtypes.int32)
        c4 = UOp.const(dtypes.int32, 4)
        for expr in ((x * c4 + r1.cast(dtypes.int32)) // c4, (x // c4) // c4, (x % UOp.const(dtypes.int32, 8)) // c4):
            assert simplify(expr) is expr
        shifted = (r0 - 1) * 4 + r1  # -4 <= shifted < 28: truncation is not floor here
        assert evaluate(simplify(shifted // 4), {r0: 0, r1: 3}) == 0

    def test_exact_division_of_possibly_negative_dividend(self):
        x = load("x", dtypes.int32)
        c4 = UOp.const(dtypes.int32, 4)
        assert simplify((x * c4) // c4) is x
        assert simplify((x * c4) % c4) is UOp.const(dtypes.int32, 0)

    def test_negative_divisor_is_left_to_folding(self):
        expr = r0 // -4
        assert simplify(expr) is expr


class TestFloatsAreUntouched:
    @pytest.mark.parametrize(
        "build",
        [
            lambda f: f + 0.0,
            lambda f: f - 0.0,
            lambda f: f * 1.0,
            lambda f: f * 0.0,
            lambda f: f - f,
            lambda f: (f + 1.0) + 2.0,
            lambda f: f.alu(Ops.MAX, f),
            lambda f: f.lt(f),
            lambda f: UOp.const(dtypes.bool, True).where(f, f + 1.0),
            lambda f: UOp.const(dtypes.float32, 1.0) + UOp.const(dtypes.float32, 2.0),
        ],
    )
    def test_float_expression_stays(self, build):
        expr = build(load("f", dtypes.float32))
        assert simplify(expr) is expr

    def test_index_of_a_float_load_is_simplified(self):
        buffer = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg("f", 32))
        value = UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, dtypes.float32, (buffer, (r0 * 4 + r1) // 4)),))
        expected = UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, dtypes.float32, (buffer, r0)),))
        assert simplify(value * 0.0) is expected * 0.0


# ---- randomized equivalence ----------------------------------------------------------------
#
# Uniformly random trees rarely take the shapes the rules look for (a sum of multiples of the
# very divisor it is divided by, a comparison against a range's last value), so the generator
# is biased toward index-like expressions: affine sums, divisors that share factors with the
# coefficients, and constants near the ranges' bounds.

FREE = load("v", dtypes.index)  # an index value of unknown sign, so that every sign-dependent guard is exercised
FACTORS = [1, 2, 3, 4, 6, 8, 12, 16]
COMPARE_OPS = [Ops.CMPLT, Ops.CMPLE, Ops.CMPEQ, Ops.CMPNE]
KINDS = ["leaf"] + ["affine"] * 4 + ["div"] * 4 + ["binary"] * 2 + ["where", "neg"]


def constants(ranges: list[UOp]) -> st.SearchStrategy[int]:
    """Small integers, and the sizes and last values of the ranges (and their negations)."""
    near_bounds = sorted({sign * (r.vmax + shift) for r in ranges for sign in (1, -1) for shift in (0, 1)})
    return st.one_of(st.integers(-20, 20), st.sampled_from(near_bounds))


def divisors() -> st.SearchStrategy[int]:
    return st.sampled_from(FACTORS * 3 + [5, 7, 9, -1, -2, -4])


@st.composite
def expressions(draw, ranges: list[UOp], leaves: list[UOp], depth: int) -> UOp:
    """A random index expression over `leaves`, at most `depth` operators deep."""
    kind = draw(st.sampled_from(KINDS if depth > 0 else ["leaf", "leaf", "leaf", "const"]))
    if kind == "leaf":
        return draw(st.sampled_from(leaves))
    if kind == "const":
        return index(draw(constants(ranges)))
    sub = expressions(ranges, leaves, depth - 1)
    if kind == "affine":
        terms = [draw(sub) * draw(st.sampled_from(FACTORS + [-1, -4])) for _ in range(draw(st.integers(1, 3)))]
        return sum(terms[1:], terms[0]) + draw(constants(ranges))
    if kind == "div":
        return UOp(draw(st.sampled_from([Ops.IDIV, Ops.MOD])), dtypes.index, (draw(sub), index(draw(divisors()))))
    if kind == "binary":
        op = draw(st.sampled_from([Ops.ADD, Ops.MUL, Ops.SUB, Ops.MAX, Ops.MIN]))
        return UOp(op, dtypes.index, (draw(sub), draw(st.one_of(sub, st.builds(index, constants(ranges))))))
    if kind == "neg":
        return -draw(sub)
    condition = draw(sub).alu(draw(st.sampled_from(COMPARE_OPS)), draw(st.one_of(sub, st.builds(index, constants(ranges)))))
    return condition.where(draw(sub), draw(sub))


@st.composite
def points(draw, ranges: list[UOp]) -> dict[UOp, int]:
    """Values for the ranges, within their bounds and often at an end, and for the free variable."""
    values = {r: draw(st.one_of(st.just(0), st.just(r.vmax), st.integers(0, r.vmax))) for r in ranges}
    return {**values, FREE: draw(st.one_of(st.integers(-2, 2), st.integers(-40, 40)))}


@st.composite
def expressions_and_points(draw) -> tuple[UOp, list[dict[UOp, int]]]:
    """An expression over 1 to 3 ranges (maybe a free variable too), and 8 points to evaluate it at."""
    sizes = draw(st.lists(st.integers(1, 20), min_size=1, max_size=3))
    ranges = [UOp.range(size, axis) for axis, size in enumerate(sizes)]
    leaves = ranges + ([FREE] if draw(st.booleans()) else [])
    return draw(expressions(ranges, leaves, depth=3)), draw(st.lists(points(ranges), min_size=8, max_size=8))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(expressions_and_points())
def test_simplify_preserves_value(case):
    expr, env_list = case
    simplified = simplify(expr)
    for env in env_list:
        value = evaluate(expr, env)
        assert evaluate(simplified, env) == value, f"{expr} -> {simplified} at {env}"
        assert expr.vmin <= value <= expr.vmax, f"bounds of {expr} miss {value} at {env}"
    assert simplify(simplified) is simplified, f"{expr} -> {simplified} is not a fixpoint"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(expressions_and_points())
def test_simplify_never_grows_the_graph_much(case):
    expr, _ = case
    assert len(simplify(expr).toposort) <= 2 * len(expr.toposort) + 4
