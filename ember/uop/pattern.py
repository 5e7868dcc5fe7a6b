"""Rewrite rules over UOps: `UPat` patterns, `PatternMatcher` tables, `graph_rewrite`.

A pass is a table of `(UPat, function)` rules. The function receives the pattern's named
captures as keyword arguments (and `ctx` when it asks for it) and returns a replacement
UOp, or None to decline. `graph_rewrite` applies a table bottom-up until nothing changes.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from ember.uop.dtypes import DType
from ember.uop.ops import COMMUTATIVE_OPS, Ops, UOp

Rule = tuple["UPat", Callable[..., UOp | None]]


class UPat:
    """Matches UOps by op, dtype, sources and arg; `name` captures the matched UOp."""

    def __init__(
        self,
        op: Ops | tuple[Ops, ...] | None = None,
        dtype: DType | tuple[DType, ...] | None = None,
        src: tuple[UPat, ...] | None = None,
        arg: Any = None,
        name: str | None = None,
        match_arg: bool = False,
    ):
        self.ops = None if op is None else (op if isinstance(op, tuple) else (op,))
        self.dtypes = None if dtype is None else (dtype if isinstance(dtype, tuple) else (dtype,))
        self.src, self.arg, self.name = src, arg, name
        self.match_arg = match_arg or arg is not None

    @staticmethod
    def var(name: str | None = None, dtype: DType | tuple[DType, ...] | None = None) -> UPat:
        return UPat(name=name, dtype=dtype)

    @staticmethod
    def cvar(name: str | None = None, dtype: DType | tuple[DType, ...] | None = None) -> UPat:
        return UPat(Ops.CONST, dtype=dtype, name=name)

    @staticmethod
    def const(value: Any) -> UPat:
        return UPat(Ops.CONST, arg=value, match_arg=True)

    def _alu(self, op: Ops, other: UPat | int | float) -> UPat:
        return UPat(op, src=(self, other if isinstance(other, UPat) else UPat.const(other)))

    def __add__(self, other):
        return self._alu(Ops.ADD, other)

    def __sub__(self, other):
        return self._alu(Ops.SUB, other)

    def __mul__(self, other):
        return self._alu(Ops.MUL, other)

    def __floordiv__(self, other):
        return self._alu(Ops.IDIV, other)

    def __mod__(self, other):
        return self._alu(Ops.MOD, other)

    def match(self, u: UOp, captures: dict[str, UOp]) -> Iterator[dict[str, UOp]]:
        """Every way `u` matches, as the extended capture dicts."""
        if self.ops is not None and u.op not in self.ops:
            return
        if self.dtypes is not None and u.dtype not in self.dtypes:
            return
        if self.match_arg and not _same_arg(u.arg, self.arg):
            return
        if self.name is not None:
            if self.name in captures and captures[self.name] is not u:
                return
            captures = {**captures, self.name: u}
        if self.src is None:
            yield captures
            return
        if len(self.src) != len(u.src):
            return
        orders = [self.src]
        if u.op in COMMUTATIVE_OPS and len(self.src) == 2:
            orders.append((self.src[1], self.src[0]))
        for order in orders:
            yield from _match_sources(order, u.src, captures)


def _same_arg(a: Any, b: Any) -> bool:
    """Constants match by type and value: True is not 1, and 0.0 is not -0.0."""
    if isinstance(a, float) or isinstance(b, float):
        return type(a) is type(b) and repr(a) == repr(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _match_sources(pats: tuple[UPat, ...], srcs: tuple[UOp, ...], captures: dict[str, UOp]) -> Iterator[dict]:
    if not pats:
        yield captures
        return
    for extended in pats[0].match(srcs[0], captures):
        yield from _match_sources(pats[1:], srcs[1:], extended)


class PatternMatcher:
    """An ordered table of rules; the first rule that returns a UOp wins."""

    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self.by_op: dict[Ops | None, list[tuple[UPat, Callable, bool]]] = {}
        for pat, fn in rules:
            wants_ctx = "ctx" in inspect.signature(fn).parameters
            for op in pat.ops or (None,):
                self.by_op.setdefault(op, []).append((pat, fn, wants_ctx))

    def __add__(self, other: PatternMatcher) -> PatternMatcher:
        return PatternMatcher(self.rules + other.rules)

    def rewrite(self, u: UOp, ctx: Any = None) -> UOp | None:
        for pat, fn, wants_ctx in itertools.chain(self.by_op.get(u.op, ()), self.by_op.get(None, ())):
            for captures in pat.match(u, {}):
                out = fn(ctx=ctx, **captures) if wants_ctx else fn(**captures)
                if out is not None and out is not u:
                    return out
        return None


def graph_rewrite(root: UOp, matcher: PatternMatcher, ctx: Any = None) -> UOp:
    """Rewrite `root` bottom-up with `matcher` until no rule applies anywhere."""
    done: dict[UOp, UOp] = {}

    def visit(u: UOp) -> UOp:
        if (hit := done.get(u)) is not None:
            return hit
        new_src = tuple(visit(s) for s in u.src)
        node = u if all(a is b for a, b in zip(new_src, u.src)) else UOp(u.op, u.dtype, new_src, u.arg)
        replaced = matcher.rewrite(node, ctx)
        done[u] = result = node if replaced is None else visit(replaced)
        return result

    for u in root.toposort:  # sources first, so the recursion above stays shallow
        visit(u)
    return done[root]


def rewrite_each_once(root: UOp, rewrite: Callable[[UOp], UOp]) -> UOp:
    """Every UOp of `root`, its sources rewritten first, replaced by `rewrite(node)` once: the
    result is not rewritten again (for rewrites that keep the op they wrap, like a guard or a
    CHECK around a division, which a fixed-point `graph_rewrite` would wrap forever)."""
    done: dict[UOp, UOp] = {}
    for u in root.toposort:
        src = tuple(done[s] for s in u.src)
        done[u] = rewrite(u if all(a is b for a, b in zip(src, u.src)) else UOp(u.op, u.dtype, src, u.arg))
    return done[root]
