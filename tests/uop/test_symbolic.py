"""Tests of ember.uop.symbolic: one class per rule family, then a randomized equivalence check.

The randomized check builds index expressions from RANGEs, a free (possibly negative) variable and
constants, simplifies them, and evaluates both forms at random in-bound points with C semantics.
"""

from __future__ import annotations

import itertools
import operator
import random

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
        assert simplify(r0.alu(Ops.NEG).alu(Ops.NEG)) is r0

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

    def test_middle_digit_recombines_with_the_low_one(self):
        # ((x//k)%m)*(c*k) + (x%k)*c -> (x%(k*m))*c
        assert simplify(((r2 // 2) % 4) * 6 + (r2 % 2) * 3) is (r2 % 8) * 3
        assert simplify((r2 % 2) + ((r2 // 2) % 2) * 2 + r0) is (r2 % 4) + r0

    def test_three_digits_of_a_flat_index_recombine(self):
        # a (2, 3, 4) buffer read through a (24, 5) view: the flat row's three digits, back to the row
        row, col = UOp.range(24, 0), UOp.range(5, 1)
        digits = (row // 12) * 60 + ((row // 4) % 3) * 20 + (row % 4) * 5 + col
        assert simplify(digits) is row * 5 + col

    def test_digit_rules_hold_for_values_of_either_sign(self):
        for expr in (((v // 2) % 3) * 2 + v % 2, ((v // 3) % 2) * 6 + (v % 3) * 2 + (v // 6) * 12):
            assert_same_everywhere(expr)
        assert_same_everywhere(((r2 // 2) % 4) * 6 + (r2 % 2) * 3 + r0)

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


def assert_same_everywhere(expr: UOp) -> None:
    """simplify(expr) equals expr at every value of its ranges (and of a free variable, at -6..6)."""
    ranges = sorted((u for u in expr.toposort if u.op is Ops.RANGE), key=lambda r: r.arg.nesting)
    simplified = simplify(expr)
    for values in itertools.product(*[range(r.vmax + 1) for r in ranges], range(-6, 7)):
        env = {**dict(zip(ranges, values[:-1], strict=True)), FREE: values[-1]}
        assert evaluate(simplified, env) == evaluate(expr, env), f"{expr} -> {simplified} at {env}"


COMPARE_OPS = [Ops.CMPLT, Ops.CMPLE, Ops.CMPEQ, Ops.CMPNE]
FREE = v = load("v", dtypes.index)  # an index value of unknown sign, to exercise every sign-dependent guard


class TestEdgeCasesKeepTheirValue:
    """Expressions at the edges of the rules' guards: negative dividends and divisors, bounds that just decide."""

    @pytest.mark.parametrize(
        "expr",
        [
            (r1 - 4) % 4,
            (r1 - 4) // 4,
            (r1 - 3) // 4,
            (r1 - 3) % 4,
            (r1 - 8) % 4,
            ((r0 + 1) * 4 - r1) // 4,
            ((r0 + 1) * 4 - r1) % 4,
            ((r0 + 1) * 4 + r1 * -1) // 4,
            ((r0 + 1) * 4 + r1 * -1) % 4,
            (r0 * 4 + r1 - 4) // 4,
            (r0 * 4 + r1 - 4) % 4,
            r0 // -4,
            r0 % -4,
            (r1 + 5) // -4,
            (r1 + 5) % -4,
            (r0 * 4 + r1) // -4,
            (r2 % 6) // 4,
            (r2 % 6) % 4,
            ((r1 - 4) // 2) // 2,
            ((r1 - 4) % 8) // 4,
            ((r1 - 4) % 8) % 4,
            (r0 * 6 - r2 * 4) // 4,
            (r0 * 6 - r2 * 4) % 4,
            (v * 4 + r1) // 4,
            (v * 4 + r1) % 4,
            (v * 4) // 4,
            (v * 6 + 2) // 4,
            (v * 6 + 2) % 4,
            (v % 4) // 2,
            (v // 2) // 2,
        ],
    )
    def test_division(self, expr):
        assert_same_everywhere(expr)

    @pytest.mark.parametrize("op", COMPARE_OPS)
    @pytest.mark.parametrize("bound", [-1, 0, 1, 2, 3, 4])
    def test_comparison_against_bounds(self, op, bound):
        assert_same_everywhere(r1.alu(op, index(bound)).where(r0, r2))
        assert_same_everywhere(index(bound).alu(op, r1).where(r0, r2))

    @pytest.mark.parametrize("op", [Ops.MAX, Ops.MIN])
    @pytest.mark.parametrize("bound", [-1, 0, 1, 2, 3, 4])
    def test_max_min_against_bounds(self, op, bound):
        assert_same_everywhere(r1.alu(op, index(bound)))
        assert_same_everywhere((r1 - 2).alu(op, r0 - bound))


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
# very divisor it is divided by, a comparison against a value's last possible value), so besides
# free-form trees there are generators biased toward index math: affine sums with coefficients
# that share factors with the divisors, and constants at the edges of an expression's bounds.
# Every case is evaluated on the corners of the ranges' box and on random points within it.

FREE_VALUES = range(-6, 7)
COEFFICIENTS = [1, 1, 2, 3, 4, 6, 8, 16, -1, -2, -4]
DIVISORS = [1, 2, 2, 3, 4, 4, 4, 6, 8, 8, 12, 16, 5, 7, -1, -2, -4]
KINDS = ["leaf"] + ["affine"] * 4 + ["div"] * 4 + ["binary"] * 2 + ["where", "neg"]


def near_bounds(u: UOp) -> st.SearchStrategy[int]:
    """Constants at and next to the ends of u's bounds, where comparisons and divisions flip (small ones only:
    overflow is out of scope)."""
    edges = [edge + shift for edge in (u.vmin, u.vmax) for shift in (-1, 0, 1) if abs(edge) < 1000]
    return st.sampled_from(edges) if edges else st.integers(-8, 8)


@st.composite
def affine(draw, parts: list[UOp]) -> UOp:
    """k1*p1 + ... + k0 for 1 to 3 of `parts` (the first always used) and a constant k0."""
    chosen = [parts[0]] + draw(st.lists(st.sampled_from(parts), max_size=2))
    terms = [part * draw(st.sampled_from(COEFFICIENTS)) for part in chosen]
    total = sum(terms[1:], terms[0])
    return total + draw(st.one_of(st.integers(-8, 8), near_bounds(total).map(lambda k: -k)))


@st.composite
def index_math(draw, leaves: list[UOp], depth: int) -> UOp:
    """Affine sums of leaves, divided and reduced modulo constants and summed again, `depth` times."""
    if depth == 0:
        return draw(affine(draw(st.permutations(leaves))))
    inner = draw(index_math(leaves, depth - 1))
    kind = draw(st.sampled_from(["affine", "idiv", "mod"]))
    if kind == "affine":
        return draw(affine([inner, *leaves]))
    divisor = index(draw(st.sampled_from(DIVISORS)))
    return inner // divisor if kind == "idiv" else inner % divisor


@st.composite
def decisions(draw, leaves: list[UOp]) -> UOp:
    """A comparison, MAX or MIN of index math against a constant at the edge of its bounds or more index math."""
    x = draw(index_math(leaves, depth=draw(st.integers(0, 1))))
    y = index(draw(near_bounds(x))) if draw(st.booleans()) else draw(index_math(leaves, depth=0))
    op = draw(st.sampled_from(COMPARE_OPS + [Ops.MAX, Ops.MIN]))
    if op in (Ops.MAX, Ops.MIN):
        return UOp(op, dtypes.index, (x, y))
    return x.alu(op, y).where(x, draw(index_math(leaves, depth=0)))


@st.composite
def trees(draw, leaves: list[UOp], depth: int) -> UOp:
    """A free-form index expression over `leaves`, at most `depth` operators deep."""
    kind = draw(st.sampled_from(KINDS if depth > 0 else ["leaf", "leaf", "leaf", "const"]))
    if kind == "leaf":
        return draw(st.sampled_from(leaves))
    if kind == "const":
        return index(draw(st.integers(-20, 20)))
    sub = trees(leaves, depth - 1)
    if kind == "affine":
        return draw(affine([draw(sub) for _ in range(3)]))
    if kind == "div":
        divisor = index(draw(st.sampled_from(DIVISORS)))
        return UOp(draw(st.sampled_from([Ops.IDIV, Ops.MOD])), dtypes.index, (draw(sub), divisor))
    if kind == "binary":
        op = draw(st.sampled_from([Ops.ADD, Ops.MUL, Ops.SUB, Ops.MAX, Ops.MIN]))
        return UOp(op, dtypes.index, (draw(sub), draw(sub)))
    if kind == "neg":
        return -draw(sub)
    x = draw(sub)
    return x.alu(draw(st.sampled_from(COMPARE_OPS)), index(draw(near_bounds(x)))).where(draw(sub), draw(sub))


def points(ranges: list[UOp], rng: random.Random) -> list[dict[UOp, int]]:
    """Every corner of the ranges' box (with the free variable at -1, 0 and 1), then random points inside it."""
    corners = [dict(zip(ranges, corner, strict=True)) for corner in itertools.product(*[(0, r.vmax) for r in ranges])]
    inside = [{r: rng.randint(0, r.vmax) for r in ranges} for _ in range(48)]
    return [{**point, FREE: v} for point in corners for v in (-1, 0, 1)] + [
        {**point, FREE: rng.choice(FREE_VALUES)} for point in inside
    ]


@st.composite
def cases(draw, shape: str) -> tuple[UOp, list[dict[UOp, int]]]:
    """An expression of the given shape over 1 to 3 ranges (maybe a free variable too), and the points to check."""
    sizes = draw(st.lists(st.integers(1, 20), min_size=1, max_size=3))
    ranges = [UOp.range(size, axis) for axis, size in enumerate(sizes)]
    leaves = ranges + ([FREE] if draw(st.booleans()) else [])
    if shape == "index_math":
        expr = draw(index_math(leaves, depth=draw(st.integers(0, 3))))
    elif shape == "decisions":
        expr = draw(decisions(leaves))
    else:
        expr = draw(trees(leaves, depth=3))
    return expr, points(ranges, random.Random(draw(st.integers(0, 2**32))))


def check_equivalent(expr: UOp, envs: list[dict[UOp, int]]) -> None:
    simplified = simplify(expr)
    for env in envs:
        value = evaluate(expr, env)
        assert evaluate(simplified, env) == value, f"{expr} -> {simplified} at {env}"
        assert expr.vmin <= value <= expr.vmax, f"bounds of {expr} miss {value} at {env}"
    assert simplify(simplified) is simplified, f"{expr} -> {simplified} is not a fixpoint"


EQUIVALENCE = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@EQUIVALENCE
@given(cases("index_math"))
def test_index_math_keeps_its_value(case):
    check_equivalent(*case)


@EQUIVALENCE
@given(cases("decisions"))
def test_decisions_keep_their_value(case):
    check_equivalent(*case)


@EQUIVALENCE
@given(cases("trees"))
def test_free_form_trees_keep_their_value(case):
    check_equivalent(*case)


def test_distributed_terms_make_equal_affine_indexes_equal():
    from ember.uop.symbolic import distributed_terms

    a, b, c = (UOp.range(n, i) for i, n in enumerate((4, 64, 1024)))
    nested = (a * 64 + b) * 1024 + c
    flat = a * 65536 + b * 1024 + c
    assert distributed_terms(nested) == distributed_terms(flat) == ({a: 65536, b: 1024, c: 1}, 0)
    assert distributed_terms((a + 3) * 2 + 5) == ({a: 2}, 11)
    assert distributed_terms(a // 2 + b) is None  # not affine in the ranges


def test_a_checked_index_and_value_keeping_casts_carry_their_bounds():
    """A CHECK passes on its safe value (an index clamped in range: Note: kernel errors) and an
    integer cast that changes no value keeps its source's bounds, so a kernel gathering at a
    checked position, or at a range cast through int64, indexes in int32 (codegen/blocks.py
    `index_bits`), static or symbolic; a cast that may wrap keeps its dtype's bounds."""
    from ember.uop.ops import CheckArg

    position = load("idx", dtypes.int64).cast(dtypes.index)
    clamped = position.alu(Ops.MAX, index(0)).alu(Ops.MIN, index(999))
    ok = position.lt(index(1000))
    check = UOp(Ops.CHECK, dtypes.index, (clamped, ok, position), CheckArg("IndexError", "index {value}"))
    assert (check.vmin, check.vmax) == (0, 999)
    through_int64 = r2.cast(dtypes.int64).cast(dtypes.index)
    assert (through_int64.vmin, through_int64.vmax) == (0, 15)
    wrapping = (r2 * 20).cast(dtypes.int8)
    assert (wrapping.vmin, wrapping.vmax) == (dtypes.int8.min, dtypes.int8.max)
    assert (position.vmin, position.vmax) == (dtypes.index.min, dtypes.index.max)


@pytest.mark.parametrize("c", [1, 2, 3, 8])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("lo, hi", [(0, 40), (2, 17), (5, 5), (7, 9)])
def test_bounds_of_a_value_less_its_own_quotient(c, m, lo, hi):
    """x - m*(x//c), the length of `x[n//2:]` when n is symbolic: its bounds hold at every x in
    range, are exact for m = 1, and stay non-negative where m <= c (interval arithmetic on the
    two terms alone gives a negative minimum, and the slice's loop failed the IR check)."""
    from ember.uop.variables import variable

    x = variable("n", lo, hi)
    for expr in (x - x // c * m, x + x // c * -m, simplify(x - x // c * m)):
        values = [n - m * (n // c) for n in range(lo, hi + 1)]
        assert expr.vmin <= min(values) and max(values) <= expr.vmax, (expr, values)
        if m <= c:
            assert expr.vmin >= 0
        if m == 1:
            assert (expr.vmin, expr.vmax) == (min(values), max(values))
