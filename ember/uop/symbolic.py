"""Symbolic simplification of integer and index expressions.

Runs on any UOp graph: `simplify(u)` rewrites the integer-valued parts of `u` (loop
variables, index math, integer ALU ops) with `pm_symbolic` and returns the simplified graph.
Float-valued and bool-valued arithmetic is left exactly as it is: x+0.0 and x*0.0 are not
identities for floats (-0.0, NaN, inf), so no rule here matches a float operand.

Note: integer semantics
    IDIV truncates toward zero and MOD takes the sign of the dividend (C semantics), and
    constants fold that way. Rules that reason from bounds (`vmin`/`vmax`) only match the
    non-wrapping integer dtypes (`BOUNDED_INTS`: index and the signed ints), whose arithmetic
    is assumed never to overflow, so the bounds from `ops.bounds` hold. Unsigned ints wrap,
    so only the purely algebraic rules (valid modulo 2**bits) match them. Every division
    rule needs a positive constant divisor, and those that depend on the rounding direction
    need a non-negative dividend; index math always has one.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable

from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import Ops, UOp
from ember.uop.pattern import PatternMatcher, UPat, graph_rewrite
from ember.uop.symbolic_division import addends, expanded_terms, form_of_terms, pm_symbolic_division, sum_of

INTS: tuple[DType, ...] = tuple(d for d in vars(dtypes).values() if isinstance(d, DType) and d.is_int)
BOUNDED_INTS: tuple[DType, ...] = tuple(d for d in INTS if d.kind in ("int", "index"))
COMPARISONS = (Ops.CMPLT, Ops.CMPLE, Ops.CMPEQ, Ops.CMPNE)


def ivar(name: str, dtype: tuple[DType, ...] = INTS) -> UPat:
    """Any integer-valued UOp, captured as `name`."""
    return UPat.var(name, dtype)


def iconst(name: str, dtype: tuple[DType, ...] = INTS) -> UPat:
    """An integer CONST, captured as `name`."""
    return UPat.cvar(name, dtype)


# Pattern variables of the rule tables: _x and _y match any integer-valued UOp, _c* an integer constant.
# The _b* ones match only BOUNDED_INTS, for the rules that reason from bounds.
_x, _y, _c, _c1, _c2 = ivar("x"), ivar("y"), iconst("c"), iconst("c1"), iconst("c2")
_bx, _by = ivar("x", BOUNDED_INTS), ivar("y", BOUNDED_INTS)
_bc, _bc1, _bm = iconst("c", BOUNDED_INTS), iconst("c1", BOUNDED_INTS), iconst("m", BOUNDED_INTS)

# ---- constant folding ----------------------------------------------------------------------


def c_idiv(a: int, b: int) -> int:
    """a / b truncated toward zero, as C's `/`."""
    quotient = abs(a) // abs(b)
    return quotient if (a >= 0) == (b > 0) else -quotient


def c_mod(a: int, b: int) -> int:
    """The remainder of `c_idiv`: it has the sign of the dividend, as C's `%`."""
    return a - b * c_idiv(a, b)


EVALUATE: dict[Ops, Callable[..., int | bool]] = {
    Ops.ADD: operator.add,
    Ops.SUB: operator.sub,
    Ops.MUL: operator.mul,
    Ops.IDIV: c_idiv,
    Ops.MOD: c_mod,
    Ops.MAX: max,
    Ops.MIN: min,
    Ops.CMPLT: operator.lt,
    Ops.CMPLE: operator.le,
    Ops.CMPEQ: operator.eq,
    Ops.CMPNE: operator.ne,
}


def int_const(dtype: DType, value: int | bool) -> UOp | None:
    """A CONST of `dtype` holding `value`, or None when the dtype cannot hold it (overflow is left to run time)."""
    if dtype.is_bool or dtype.min <= value <= dtype.max:
        return UOp.const(dtype, value)
    return None


def fold_constants(u: UOp, c1: UOp, c2: UOp) -> UOp | None:
    """c1 op c2 -> c; a division by zero is left for run time to meet."""
    if u.op in (Ops.IDIV, Ops.MOD) and c2.arg == 0:
        return None
    return int_const(u.dtype, EVALUATE[u.op](c1.arg, c2.arg))


pm_constant_folding = PatternMatcher(
    [
        (UPat(Ops.NEG, src=(_c,)), lambda c: int_const(c.dtype, -c.arg)),  # -(c) -> c'
        (UPat(tuple(EVALUATE), src=(_c1, _c2), name="u"), fold_constants),  # c1 op c2 -> c
    ]
)

# ---- identities and reassociation ----------------------------------------------------------


def const_to_right(u: UOp) -> UOp | None:
    """c op x -> x op c for a commutative op, so that the other rules meet constants on the right only."""
    if u.src[0].op is Ops.CONST and u.src[1].op is not Ops.CONST:
        return UOp(u.op, u.dtype, (u.src[1], u.src[0]), u.arg)
    return None


def add_const(x: UOp, value: int) -> UOp | None:
    """x + value, or None when x's dtype cannot hold `value`."""
    return None if (c := int_const(x.dtype, value)) is None else x + c


def mul_const(x: UOp, value: int) -> UOp | None:
    """x * value, or None when x's dtype cannot hold `value`."""
    return None if (c := int_const(x.dtype, value)) is None else x * c


def hoist_const(x: UOp, c1: UOp, y: UOp) -> UOp | None:
    """(x + c1) + y -> (x + y) + c1, moving constants outward where they meet and fold."""
    return None if y.op is Ops.CONST else (x + y) + c1


def distribute_const(x: UOp, c1: UOp, c2: UOp) -> UOp | None:
    """(x + c1) * c2 -> x*c2 + c1*c2, exposing multiples of c2 to the division rules."""
    return None if (product := int_const(x.dtype, c1.arg * c2.arg)) is None else x * c2 + product


def keep_check(check: UOp) -> UOp:
    """A checked position times a stride of 0 (a read of an expanded dim) still reports an index
    out of range, as eager does: only the position goes."""
    return UOp(Ops.CHECK, check.dtype, (check.const_like(0), *check.src[1:]), check.arg)


pm_identities = PatternMatcher(
    [
        (UPat((Ops.ADD, Ops.MUL, Ops.MAX, Ops.MIN), INTS, name="u"), const_to_right),  # c op x -> x op c
        (_x + 0, lambda x: x),  # x + 0 -> x
        (_x - 0, lambda x: x),  # x - 0 -> x
        (_x * 1, lambda x: x),  # x * 1 -> x
        (UPat(Ops.CHECK, name="check") * 0, keep_check),  # CHECK(x, ok) * 0 -> CHECK(0, ok)
        (_x * 0, lambda x: x.const_like(0)),  # x * 0 -> 0
        (_x // 1, lambda x: x),  # x // 1 -> x
        (_x % 1, lambda x: x.const_like(0)),  # x % 1 -> 0
        (_x - _x, lambda x: x.const_like(0)),  # x - x -> 0
        ((_x + _y) - _y, lambda x, y: x),  # (x + y) - y -> x
        (UPat(Ops.NEG, src=(UPat(Ops.NEG, src=(_x,)),)), lambda x: x),  # -(-x) -> x
        (UPat((Ops.MAX, Ops.MIN), src=(_x, _x)), lambda x: x),  # max(x, x) -> x
        (_x - _c, lambda x, c: add_const(x, -c.arg)),  # x - c -> x + (-c)
        ((_x + _c1) + _c2, lambda x, c1, c2: add_const(x, c1.arg + c2.arg)),  # (x + c1) + c2 -> x + (c1+c2)
        ((_x * _c1) * _c2, lambda x, c1, c2: mul_const(x, c1.arg * c2.arg)),  # (x * c1) * c2 -> x * (c1*c2)
        ((_x + _c1) + _y, hoist_const),  # (x + c1) + y -> (x + y) + c1
        ((_x + _c1) * _c2, distribute_const),  # (x + c1) * c2 -> x*c2 + c1*c2
        (_x * _c1 + _x * _c2, lambda x, c1, c2: mul_const(x, c1.arg + c2.arg)),  # x*c1 + x*c2 -> x*(c1+c2)
        (_x + _x * _c1, lambda x, c1: mul_const(x, c1.arg + 1)),  # x + x*c1 -> x*(c1+1)
        (_x + _x, lambda x: mul_const(x, 2)),  # x + x -> x*2
    ]
)

# ---- comparisons, MAX/MIN and WHERE --------------------------------------------------------


def decide_comparison(op: Ops, x: UOp, y: UOp) -> bool | None:
    """The value of `x op y` for every x and y within their bounds, or None when it varies."""
    if op is Ops.CMPLT:
        return True if x.vmax < y.vmin else False if x.vmin >= y.vmax else None
    if op is Ops.CMPLE:
        return True if x.vmax <= y.vmin else False if x.vmin > y.vmax else None
    if x.vmax < y.vmin or y.vmax < x.vmin:
        return op is Ops.CMPNE
    if x.vmin == x.vmax == y.vmin == y.vmax:
        return op is Ops.CMPEQ
    return None


def compare_by_bounds(u: UOp, x: UOp, y: UOp) -> UOp | None:
    """x < y, x <= y, x == y, x != y -> True or False when the bounds of x and y decide it."""
    return None if (known := decide_comparison(u.op, x, y)) is None else UOp.const(dtypes.bool, known)


def max_min_by_bounds(u: UOp, x: UOp, y: UOp) -> UOp | None:
    """max(x, y) -> x when x >= y for all their values; min(x, y) -> x when x <= y (y is tried by commuting)."""
    x_wins = x.vmin >= y.vmax if u.op is Ops.MAX else x.vmax <= y.vmin
    return x if x_wins else None


def compare_same(u: UOp, x: UOp) -> UOp:
    """x < x -> False, x <= x -> True, x == x -> True, x != x -> False."""
    return UOp.const(dtypes.bool, u.op in (Ops.CMPLE, Ops.CMPEQ))


_where_const = UPat(Ops.WHERE, src=(UPat.cvar("cond", dtypes.bool), _x, _y))

pm_comparisons = PatternMatcher(
    [
        (UPat(COMPARISONS, src=(_x, _x), name="u"), compare_same),  # x < x -> False
        (UPat(COMPARISONS, src=(_bx, _by), name="u"), compare_by_bounds),  # x < y -> True when x.vmax < y.vmin
        (UPat((Ops.MAX, Ops.MIN), src=(_bx, _by), name="u"), max_min_by_bounds),  # max(x, y) -> x when x >= y
        (_where_const, lambda cond, x, y: x if cond.arg else y),  # where(True, x, y) -> x
        (UPat(Ops.WHERE, src=(UPat.var("cond"), _x, _x)), lambda cond, x: x),  # where(cond, x, x) -> x
    ]
)

# ---- division and remainder ----------------------------------------------------------------


def linear_terms(index: UOp) -> tuple[list[tuple[UOp, int]], int]:
    """`index` as sum(term * coefficient) + offset: its addends split into a non-constant
    term and a constant multiplier, and the constant addends summed."""
    terms, offset = [], 0
    for addend in addends(index):
        base, k = coefficient(addend)
        if base is None:
            offset += k
        else:
            terms.append((base, k))
    return terms, offset


def distributed_terms(index: UOp, opaque: bool = False) -> tuple[dict[UOp, int], int] | None:
    """`index` as ({term: coefficient}, offset) with constant multipliers distributed over
    sums ((a*4 + b)*128 -> a*512 + b*128), so equal affine indexes compare equal however they
    were built; None when a term is not a RANGE or AXIS times a constant, unless `opaque`
    (then such a term, a div or mod, is kept whole)."""
    coefficients: dict[UOp, int] = {}
    offset = 0

    def add(u: UOp, k: int) -> bool:
        nonlocal offset
        if u.op is Ops.CONST:
            offset += u.arg * k
            return True
        if u.op is Ops.ADD:
            return all(add(src, k) for src in u.src)
        if u.op is Ops.MUL and u.src[1].op is Ops.CONST:
            return add(u.src[0], k * u.src[1].arg)
        if u.op in (Ops.RANGE, Ops.AXIS) or opaque:
            coefficients[u] = coefficients.get(u, 0) + k
            return True
        return False

    if not add(index, 1):
        return None
    return {u: k for u, k in coefficients.items() if k != 0}, offset


def element_form(index: UOp) -> object:
    """A canonical form of an element index, equal for indexes equal as sums of products however
    they were built: its distributed terms when affine with constant coefficients ((a*64 + b)*1024
    and a*65536 + b*1024), else its products distributed and counted by their factors, which a
    symbolic stride needs ((a + b*s)*1024 and a*1024 + b*(s*1024), Note: symbolic sizes). Unequal
    forms say nothing: a caller that compares them only declines (an in-place store, a fusion)."""
    simplified = simplify(index)
    form = distributed_terms(simplified)
    if form is not None:
        return frozenset(form[0].items()), form[1]
    return form_of_terms(expanded_terms(simplified))


def coefficient(term: UOp) -> tuple[UOp | None, int]:
    """`term` as (base, k) with term == base*k; base is None for a constant."""
    if term.op is Ops.CONST:
        return None, term.arg
    if term.op is Ops.MUL and term.src[1].op is Ops.CONST:
        return term.src[0], term.src[1].arg
    return term, 1


def scaled(base: UOp | None, k: int, like: UOp) -> UOp:
    """base * k, without a `* 1`; the constant k (of `like`'s dtype) when base is None."""
    if base is None:
        return like.const_like(k)
    return base if k == 1 else base * base.const_like(k)


def split_multiples(x: UOp, c: int) -> tuple[list[UOp], list[UOp]]:
    """Addends of x as x == c*sum(quotient) + sum(remainder): multiples of c go, divided, to quotient."""
    quotient, remainder = [], []
    for term in addends(x):
        base, k = coefficient(term)
        if base is None:
            whole, rest = divmod(k, c)  # floor divmod: the constant's remainder lies in [0, c)
            quotient += [x.const_like(whole)] if whole else []
            remainder += [x.const_like(rest)] if rest else []
        elif k % c == 0:
            quotient.append(scaled(base, k // c, x))
        else:
            remainder.append(term)
    return quotient, remainder


def divide_sum(x: UOp, c: UOp) -> UOp | None:
    """(q*c + r) // c -> q + r//c; exact when r is empty, else needs x >= 0 and r >= 0 (truncation = floor)."""
    quotient, remainder = split_multiples(x, c.arg)
    rest = sum_of(remainder, x)
    if not quotient or (remainder and not (x.vmin >= 0 and rest.vmin >= 0)):
        return None
    return sum_of(quotient + ([rest // c] if remainder else []), x)


def mod_sum(x: UOp, c: UOp) -> UOp | None:
    """(q*c + r) % c -> r % c; 0 when r is empty, else needs x >= 0 and r >= 0 (truncation = floor)."""
    quotient, remainder = split_multiples(x, c.arg)
    rest = sum_of(remainder, x)
    if not quotient or (remainder and not (x.vmin >= 0 and rest.vmin >= 0)):
        return None
    return rest % c if remainder else x.const_like(0)


def common_factor(x: UOp, c: UOp) -> tuple[UOp, UOp, int] | None:
    """(x/g, c/g, g) for g > 1 the gcd of c and the coefficients of all addends of x; None when g is 1."""
    terms = [coefficient(term) for term in addends(x)]
    g = math.gcd(c.arg, *(k for _, k in terms))
    if g <= 1:
        return None
    return sum_of([scaled(base, k // g, x) for base, k in terms], x), c.const_like(c.arg // g), g


def divide_common_factor(x: UOp, c: UOp) -> UOp | None:
    """(g*a) // (g*d) -> a // d: the same rational number, so the same truncation for every sign of a."""
    return None if (factored := common_factor(x, c)) is None else factored[0] // factored[1]


def mod_common_factor(x: UOp, c: UOp) -> UOp | None:
    """(g*a) % (g*d) -> (a % d) * g, which C's truncating `%` satisfies for every sign of a."""
    return None if (factored := common_factor(x, c)) is None else (factored[0] % factored[1]) * factored[2]


def divide_by_bounds(x: UOp, c: UOp) -> UOp | None:
    """x // c -> k when all x in [vmin, vmax] (x >= 0) have the same quotient k; so x // c -> 0 when x < c."""
    return x.const_like(x.vmin // c.arg) if x.vmin >= 0 and x.vmin // c.arg == x.vmax // c.arg else None


def mod_by_bounds(x: UOp, c: UOp) -> UOp | None:
    """x % c -> x - k*c when all x in [vmin, vmax] (x >= 0) have the same quotient k; so x % c -> x when x < c."""
    if x.vmin < 0 or x.vmin // c.arg != x.vmax // c.arg:
        return None
    return x if x.vmin < c.arg else add_const(x, -(x.vmin // c.arg) * c.arg)


def divide_twice(x: UOp, c1: UOp, c: UOp) -> UOp | None:
    """(x // c1) // c -> x // (c1*c) for x >= 0 and c1 > 0."""
    if x.vmin < 0 or c1.arg <= 0 or (product := int_const(x.dtype, c1.arg * c.arg)) is None:
        return None
    return x // product


def divide_remainder(x: UOp, m: UOp, c: UOp) -> UOp | None:
    """(x % (c*k)) // c -> (x // c) % k for x >= 0 and k > 0."""
    if x.vmin < 0 or m.arg <= 0 or m.arg % c.arg != 0:
        return None
    return (x // c) % m.const_like(m.arg // c.arg)


def mod_remainder(x: UOp, m: UOp, c: UOp) -> UOp | None:
    """(x % (c*k)) % c -> x % c for x >= 0 and k > 0."""
    return x % c if x.vmin >= 0 and m.arg > 0 and m.arg % c.arg == 0 else None


def inner_factor(x: UOp, c: int) -> tuple[UOp, UOp, int] | None:
    """x == f*q + r with f > 1 dividing c, q >= 0 and 0 <= r < f: (q, r, f), largest f first.
    This is how a reshape's flat index looks: (a*256 + b) with 0 <= b < 256."""
    if x.vmin < 0:
        return None
    for f in sorted({k for _, k in (coefficient(t) for t in addends(x)) if k > 1 and c % k == 0}, reverse=True):
        quotient, remainder = split_multiples(x, f)
        rest = sum_of(remainder, x)
        if quotient and rest.vmin >= 0 and rest.vmax < f:
            return sum_of(quotient, x), rest, f
    return None


def divide_by_inner_factor(x: UOp, c: UOp) -> UOp | None:
    """(q*f + r) // (f*k) -> q // k when 0 <= r < f."""
    if (split := inner_factor(x, c.arg)) is None:
        return None
    q, _, f = split
    return q // c.const_like(c.arg // f)


def mod_by_inner_factor(x: UOp, c: UOp) -> UOp | None:
    """(q*f + r) % (f*k) -> (q % k)*f + r when 0 <= r < f."""
    if (split := inner_factor(x, c.arg)) is None:
        return None
    q, r, f = split
    return (q % c.const_like(c.arg // f)) * f + r


def recombine_div_mod(u: UOp) -> UOp | None:
    """(x//k)*(c*k) + (x%k)*c -> x*c: the two halves of one index, split and put back.
    ((x//k)%m)*(c*k) + (x%k)*c -> (x%(k*m))*c: the middle digits of an index split in three
    (a reshape of (a, b, c) to (a*b*c,) read back), so the outer digit then recombines too.
    Both hold for C's truncating division as for floor division (k, m > 0)."""
    terms = addends(u)
    parts = [coefficient(t) for t in terms]
    for i, (high, c1) in enumerate(parts):
        if (split := _quotient_digit(high)) is None:
            continue
        x, divisor, modulus = split
        k = divisor.arg
        for j, (low, c2) in enumerate(parts):
            if low is not None and low.op is Ops.MOD and low.src[0] is x and low.src[1] is divisor and c1 == c2 * k:
                rest = [t for n, t in enumerate(terms) if n not in (i, j)]
                joined = x if modulus is None else x % x.const_like(k * modulus)
                return sum_of([scaled(joined, c2, u), *rest], u)
    return None


def _quotient_digit(u: UOp | None) -> tuple[UOp, UOp, int | None] | None:
    """(x, k, None) for x//k and (x, k, m) for (x//k)%m, with constants k, m > 0; else None."""
    modulus = None
    if u is not None and u.op is Ops.MOD and u.src[1].op is Ops.CONST and u.src[1].arg > 0:
        u, modulus = u.src[0], u.src[1].arg
    if u is None or u.op is not Ops.IDIV or u.src[1].op is not Ops.CONST or u.src[1].arg <= 0:
        return None
    return u.src[0], u.src[1], modulus


def with_positive_divisor(rule: Callable[..., UOp | None]) -> Callable[..., UOp | None]:
    """`rule`, declining every match whose constant divisor `c` is not positive."""

    @functools.wraps(rule)  # keeps the signature, so PatternMatcher still sees whether it asks for ctx
    def guarded(**captures: UOp) -> UOp | None:
        return rule(**captures) if captures["c"].arg > 0 else None

    return guarded


# Every rule below with a divisor `c` goes through `with_positive_divisor`: it only fires for a constant c > 0.
pm_division = PatternMatcher(
    [
        (_bx // _bx, lambda x: x.const_like(1) if x.vmin > 0 or x.vmax < 0 else None),  # x // x -> 1 when x != 0
        (_bx // _bc, with_positive_divisor(divide_by_bounds)),  # x // c -> 0 when 0 <= x < c
        (_bx % _bc, with_positive_divisor(mod_by_bounds)),  # x % c -> x when 0 <= x < c
        ((_bx // _bc1) // _bc, with_positive_divisor(divide_twice)),  # (x // c1) // c -> x // (c1*c)
        ((_bx % _bm) // _bc, with_positive_divisor(divide_remainder)),  # (x % (c*k)) // c -> (x // c) % k
        ((_bx % _bm) % _bc, with_positive_divisor(mod_remainder)),  # (x % (c*k)) % c -> x % c
        (_bx // _bc, with_positive_divisor(divide_sum)),  # (x*c + y) // c -> x + y//c
        (_bx % _bc, with_positive_divisor(mod_sum)),  # (x*c + y) % c -> y % c
        (_bx // _bc, with_positive_divisor(divide_common_factor)),  # (x*6 + y*4) // 4 -> (x*3 + y*2) // 2
        (_bx % _bc, with_positive_divisor(mod_common_factor)),  # (x*6 + y*4) % 4 -> ((x*3 + y*2) % 2) * 2
        (_bx // _bc, with_positive_divisor(divide_by_inner_factor)),  # (q*f + r) // (f*k) -> q // k, 0 <= r < f
        (_bx % _bc, with_positive_divisor(mod_by_inner_factor)),  # (q*f + r) % (f*k) -> (q % k)*f + r
    ]
)
# also run alone after block lowering, which splits a block's flat index into its dims (codegen/phases.py)
pm_recombine = PatternMatcher(
    [(UPat(Ops.ADD, dtype=BOUNDED_INTS, name="u"), recombine_div_mod)]  # (x//k)*(c*k) + (x%k)*c -> x*c
)

pm_symbolic = pm_constant_folding + pm_identities + pm_comparisons + pm_division + pm_recombine + pm_symbolic_division


# Identical layers ask to simplify the very same (interned) index expressions again and again:
# lowering per view read, the scheduler per fused read, codegen per in-place candidate. The
# result is a pure function of the UOp (its ranges carry their bounds), so it is computed once;
# the memo is bounded, keyed by identity (UOps are interned), and lru_cache is thread-safe.
SIMPLIFY_MEMO_SIZE = 1 << 15


@functools.lru_cache(maxsize=SIMPLIFY_MEMO_SIZE)
def simplify(u: UOp) -> UOp:
    """`u` with its integer expressions simplified by `pm_symbolic`; float arithmetic stays as written."""
    return graph_rewrite(u, pm_symbolic)
