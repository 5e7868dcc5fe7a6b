"""Division and remainder by a symbolic size (Note: symbolic sizes, uop/variables.py).

A view of a tensor with symbolic sizes divides by them: reshaping (b, s, 128) to (b*s, 128)
reads dim 0 at `(n // s) % b` and dim 1 at `n % s`. The rules of symbolic.py need a constant
divisor; these take a divisor `d` that is a product of size variables and a positive constant
(its "factors"), and reason by factors instead of by value: a term whose factors include all
of d's is a multiple of d, and a value below d (a loop over d, a remainder by d) divides to 0.
Every rule needs d >= 1 (a size variable's vmin) and, where truncation must equal floor, a
non-negative dividend, as the constant rules do (Note: integer semantics, symbolic.py).
"""

from __future__ import annotations

import functools
import operator
from collections import Counter

from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, UOp
from ember.uop.pattern import PatternMatcher, UPat


def addends(u: UOp) -> list[UOp]:
    """The terms of a tree of ADDs, left to right (without recursion: index sums can be long)."""
    terms, stack = [], [u]
    while stack:
        top = stack.pop()
        if top.op is Ops.ADD:
            stack += [top.src[1], top.src[0]]
        else:
            terms.append(top)
    return terms


def sum_of(terms: list[UOp], like: UOp) -> UOp:
    """terms[0] + terms[1] + ..., or a 0 of `like`'s dtype when there are none."""
    return functools.reduce(operator.add, terms) if terms else like.const_like(0)


def expanded_terms(u: UOp) -> list[UOp]:
    """The addends of `u` with products distributed over sums: (a + b*s)*4 -> [a*4, b*s*4]."""
    if u.op is Ops.ADD:
        return [t for s in u.src for t in expanded_terms(s)]
    if u.op is Ops.MUL and (u.src[0].op is Ops.ADD or u.src[1].op is Ops.ADD):
        return [x * y for x in expanded_terms(u.src[0]) for y in expanded_terms(u.src[1])]
    return [u]


def factors(u: UOp) -> tuple[int, Counter]:
    """`u` as constant * product(factors): the constant, and the non-constant factors counted."""
    constant, found, stack = 1, Counter[UOp](), [u]
    while stack:
        top = stack.pop()
        if top.op is Ops.MUL:
            stack += top.src
        elif top.op is Ops.CONST:
            constant *= top.arg
        else:
            found[top] += 1
    return constant, found


def product(constant: int, found: Counter, like: UOp) -> UOp:
    terms = [u for u, n in sorted(found.items(), key=lambda p: _factor_order(p[0])) for _ in range(n)]
    result = terms[0] if terms else like.const_like(constant)
    for t in terms[1:]:
        result = result * t
    return result * like.const_like(constant) if terms and constant != 1 else result


def _factor_order(u: UOp) -> tuple[bool, str]:
    """Size variables first, by name (as sympy orders a product's symbols), then other factors."""
    return (u.op is not Ops.DEFINE_VAR, u.arg.name if u.op is Ops.DEFINE_VAR else u.key)


def normal_form(u: UOp) -> frozenset:
    """A sum of products as {(factors, coefficient)}: equal for equal sums however they were built."""
    return form_of_terms(addends(u))


def form_of_terms(addends: list[UOp]) -> frozenset:
    """Products summed, as {(factors, coefficient)}: like terms combined, zero ones dropped."""
    terms: dict[frozenset, int] = {}
    for term in addends:
        constant, found = factors(term)
        key = frozenset(found.items())
        terms[key] = terms.get(key, 0) + constant
    return frozenset((k, c) for k, c in terms.items() if c != 0)


def exact_quotient(u: UOp, d: UOp) -> UOp | None:
    """u / d when d divides u by its factors (u = d * q), else None."""
    cu, fu = factors(u)
    cd, fd = factors(d)
    if cd <= 0 or cu % cd != 0 or any(fu[f] < n for f, n in fd.items()):
        return None
    return product(cu // cd, fu - fd, u)


def exclusive_bound(x: UOp) -> UOp | None:
    """A UOp that `x` stays below for every value of the size variables (x >= 0), or None: a loop
    is below its size, a remainder below its divisor, q*f + r (0 <= r < f) below bound(q)*f, y - c
    (c >= 1) below y's bound or y, min(a, b) below either's bound. So a position clamped into a
    dim of size s, min(max(i, 0), s - 1), as pooling and padded convolutions read their windows,
    is below s."""
    if x.op is Ops.RANGE:
        return x.src[0]
    if x.op is Ops.MOD and x.src[0].vmin >= 0:
        return x.src[1]
    if x.op is Ops.IDIV and x.src[0].vmin >= 0 and (inner := exclusive_bound(x.src[0])) is not None:
        return exact_quotient(inner, x.src[1])
    if x.op is Ops.MIN:
        return next((bound for src in x.src if (bound := exclusive_bound(src)) is not None), None)
    if x.op is Ops.ADD and x.src[1].op is Ops.CONST and x.src[1].arg <= -1:
        return x.src[0] if (bound := exclusive_bound(x.src[0])) is None else bound  # s - 1 < s
    if x.op is Ops.ADD:
        split = inner_split(x)
        if split is not None and (bound := exclusive_bound(split[0])) is not None:
            return bound * split[2]
    return None


def below(x: UOp, d: UOp) -> bool:
    """0 <= x < d for every value of the size variables."""
    if x.vmin < 0:
        return False
    if x.vmax < d.vmin:
        return True
    bound = exclusive_bound(x)
    return bound is not None and (bound is d or exact_quotient(d, bound) is not None)


def inner_split(x: UOp) -> tuple[UOp, UOp, UOp] | None:
    """x == q*f + r with 0 <= r < f, as (q, r, f): the flat index of a reshape (a*s + b, b < s).
    f is the factor of the last addend that is a product (a*s: f = s)."""
    terms = addends(x)
    for i, term in enumerate(terms):
        if term.op is not Ops.MUL:
            continue
        for f in (term.src[1], term.src[0]):
            if f.vmin < 1:
                continue
            rest = sum_of([t for j, t in enumerate(terms) if j != i], x)
            q = exact_quotient(term, f)
            if q is not None and q.vmin >= 0 and below(rest, f):
                return q, rest, f
    return None


def split_multiples(x: UOp, d: UOp) -> tuple[list[UOp], list[UOp]]:
    """Addends of x as x == d*sum(quotient) + sum(remainder)."""
    quotient, remainder = [], []
    for term in addends(x):
        q = exact_quotient(term, d)
        if q is None:
            remainder.append(term)
        else:
            quotient.append(q)
    return quotient, remainder


def symbolic_divisor(d: UOp) -> bool:
    """A positive divisor made of size variables (never a loop variable): the rules below apply."""
    return d.op is not Ops.CONST and d.vmin >= 1 and d.has_variables and all(u.op is not Ops.RANGE for u in d.toposort)


def applies(x: UOp, d: UOp) -> bool:
    """Whether the rules below take x // d and x % d: a symbolic divisor, or a positive constant
    one of a dividend with size variables (a0*(s*512) is a multiple of 512 only by its factors)."""
    if d.op is Ops.CONST:
        return d.arg > 0 and x.has_variables
    return symbolic_divisor(d)


def divide(x: UOp, d: UOp) -> UOp | None:
    """x // d: 0 below d; (q*d + r) // d -> q + r // d; (q*f + r) // (f*k) -> q // k (0 <= r < f)."""
    if not applies(x, d) or x.vmin < 0:
        return None
    if below(x, d):
        return x.const_like(0)
    quotient, remainder = split_multiples(x, d)
    if quotient:
        rest = sum_of(remainder, x)
        return sum_of(quotient + ([rest // d] if remainder and rest.vmin >= 0 else []), x) \
            if not remainder or rest.vmin >= 0 else None  # fmt: skip
    split = inner_split(x)
    if split is not None and (k := exact_quotient(d, split[2])) is not None:
        return split[0] // k
    return None


def remainder(x: UOp, d: UOp) -> UOp | None:
    """x % d: x below d; (q*d + r) % d -> r % d; (q*f + r) % (f*k) -> (q % k)*f + r (0 <= r < f)."""
    if not applies(x, d) or x.vmin < 0:
        return None
    if below(x, d):
        return x
    quotient, rest_terms = split_multiples(x, d)
    if quotient:
        rest = sum_of(rest_terms, x)
        return rest % d if rest_terms and rest.vmin >= 0 else (x.const_like(0) if not rest_terms else None)
    split = inner_split(x)
    if split is not None and (k := exact_quotient(d, split[2])) is not None:
        q, r, f = split
        return (q % k) * f + r
    return None


def recombine(u: UOp) -> UOp | None:
    """(x // d)*(c*d) + (x % d)*c -> x*c, for a symbolic d: the halves of one index put back."""
    if not u.has_variables:  # every static sum: nothing to look at
        return None
    terms = addends(u)
    lows = [(j, m) for j, t in enumerate(terms) for m in _symbolic_remainders(t)]
    for j, m in lows:  # (static sums have none: one pass over their terms)
        x, d = m.src
        c_low, f_low = factors(terms[j])
        scale_of_low = (c_low, f_low - Counter({m: 1}))
        for i, high in enumerate(terms):
            scale = exact_quotient(high, (x // d) * d) if i != j else None
            if scale is not None and factors(scale) == scale_of_low:
                rest = [t for n, t in enumerate(terms) if n not in (i, j)]
                return sum_of([x * scale, *rest], u)
    return None


def _symbolic_remainders(term: UOp) -> list[UOp]:
    """The factors of `term` that are remainders by a symbolic size."""
    candidates = (
        [term] if term.op is Ops.MOD else [s for s in term.src if s.op is Ops.MOD] if term.op is Ops.MUL else []
    )
    if term.op is Ops.MUL and not candidates:
        candidates = [f for f in factors(term)[1] if f.op is Ops.MOD]
    return [m for m in candidates if symbolic_divisor(m.src[1])]


_x, _d = UPat.var("x", (dtypes.index,)), UPat.var("d", (dtypes.index,))

pm_symbolic_division = PatternMatcher(
    [
        (_x // _d, divide),  # (q*d + r) // d -> q + r // d, x // d -> 0 when x < d
        (_x % _d, remainder),  # (q*d + r) % d -> r % d, x % d -> x when x < d
        (UPat(Ops.ADD, dtype=(dtypes.index,), name="u"), recombine),  # (x//d)*d*c + (x%d)*c -> x*c
    ]
)
