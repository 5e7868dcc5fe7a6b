"""Guards on symbolic sizes while a graph compiles with them (Note: guards a compile adds).

Note: guards a compile adds
    A symbolic compile (compile_symbolic.py) runs with this module's hook on the shape
    environment's guard check (`ShapeEnv._check_frozen`, which torch calls before it records
    any guard). The hook either refuses the guard (the compile raises and the graph is compiled
    per shape instead) or admits it, and remembers what it admitted.

    - A forward or inference graph compiles inside dynamo's compile of the frame, before dynamo
      builds the frame's guards from the shape environment: a guard added now becomes a dynamo
      guard, checked before every call, and a call that breaks it recompiles the frame. So these
      compiles admit a guard that narrows a size without fixing it: a size relation (`<`, `<=`,
      `!=` ...) over backed symbols, true for the example. torch's fake convolution asks one
      for a channels-last input, whether the layout is dense: `(s - 1)//2 + 1 != 1`.
      An equality is admitted where it leaves every size free to change (it holds with any one
      size moved to a few other values): a divisibility (`Eq(s % 2, 0)`, a reshape's) or a
      derived size's value over a range of sizes (`Eq(Max(1, s//2), s//2)`). A call that breaks
      it recompiles the frame, and that compile is symbolic again, under the opposite guard.
    - Refused everywhere: an equality that pins a size (`Eq(s0, 3)` or `int(size)`) would
      specialize it, turning ember's compile per shape into a dynamo recompile per shape (a new
      trace each); a guard on an unbacked (data-dependent) symbol, which dynamo cannot check
      before a call.
    - A backward compiles lazily at its first call, after dynamo's guards are built and its shape
      environment is frozen: nothing added then is checked, so a backward refuses all guards, as
      does any compile that finds its environment frozen.
    - A compile that admits guards and then fails leaves them in the environment (torch has no
      undo): the per-shape graph that replaces it is then guarded by them too. Still correct;
      at worst a frame is compiled again where the per-shape path would not have needed it.

    The admitted guards are part of what the compiled graph assumes, so the graph cache stores
    them with the entry (as JSON expression trees, no pickles: Note: cache safety). A process that
    loads the entry re-asserts them on its own shape environment, so that its dynamo checks them
    too; where the example breaks one, the entry is not served and the graph compiles again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import sympy
import torch.utils._sympy.functions as torch_sympy_functions

REFUSED = "Guard attempted while ShapeEnv guards are frozen"  # torch's words: compile_symbolic's reasons read them


class NewGuardRefused(RuntimeError):
    """A stage asked torch's shape environment for a guard that this compile cannot admit."""


class SizeGuards:
    """The guards one compile admitted, on one shape environment; `admit` False refuses all."""

    def __init__(self, shape_env: Any, admit: bool):
        self.shape_env, self.admit = shape_env, admit
        self.admitted: list[sympy.Basic] = []

    def check(self, expr: sympy.Basic, concrete_val: sympy.Basic) -> None:
        """torch's `_check_frozen(expr, concrete_val)`, called before it records a guard."""
        guard = _as_guard(expr, concrete_val)
        # a frozen environment: dynamo has built the frame's guards already, a new one would go unchecked
        open_for_guards = self.admit and not self.shape_env.frozen
        if not (open_for_guards and _narrows_without_fixing(guard, hints(self.shape_env))):
            raise NewGuardRefused(f"{REFUSED}: {expr} == {concrete_val}")
        self.admitted.append(guard)

    def encoded(self) -> list | None:
        """The admitted guards as JSON trees for the graph cache; None if one has a form this
        module does not encode (the graph is then not stored)."""
        try:
            return [encode(g) for g in self.admitted]
        except UnknownExpression:
            return None

    def reassert(self, encoded: list) -> bool:
        """Guards a cached graph was compiled under, asserted on this compile's shape environment
        (so that dynamo checks them); False, asserting none, where the example breaks one or one
        names a symbol this environment lacks."""
        if encoded and (not self.admit or self.shape_env.frozen):
            return False
        values = hints(self.shape_env)
        symbols = {str(s): s for s in values}
        try:
            guards = [decode(tree, symbols) for tree in encoded]
        except UnknownExpression:
            return False
        if not all(bool(g.xreplace(values)) for g in guards):
            return False
        for guard in guards:
            self.shape_env.evaluate_expr(guard)
        return True


@contextlib.contextmanager
def guarding(shape_env: Any, admit: bool) -> Iterator[SizeGuards]:
    """While the body runs, every new guard on `shape_env` goes through a `SizeGuards` check
    (Note: guards a compile adds). `_check_frozen` exists in torch 2.11 through 2.14."""
    guards = SizeGuards(shape_env, admit)
    shape_env._check_frozen = guards.check
    _compiling.depth = getattr(_compiling, "depth", 0) + 1
    try:
        yield guards
    finally:
        _compiling.depth -= 1
        del shape_env._check_frozen  # the class's own check again


class _QuietRefusals(logging.Filter):
    """torch logs a warning for any exception raised inside `evaluate_expr`, a refusal included;
    a refused guard is ember's decision, reported as the graph's reason to compile per shape
    (compile_symbolic.py: metrics, ember's log), not a failure to show the user. Only records of
    the thread that is compiling are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (getattr(_compiling, "depth", 0) and str(record.msg).startswith("failed during evaluate_expr"))


_compiling = threading.local()
logging.getLogger("torch.fx.experimental.symbolic_shapes").addFilter(_QuietRefusals())


def _as_guard(expr: sympy.Basic, concrete_val: sympy.Basic) -> sympy.Basic:
    """What torch records for `expr` evaluating to `concrete_val` (ShapeEnv._evaluate_expr)."""
    if concrete_val is sympy.true:
        return expr
    if concrete_val is sympy.false:
        return sympy.Not(expr)
    return sympy.Eq(expr, concrete_val)


def _narrows_without_fixing(guard: sympy.Basic, values: dict) -> bool:
    relations = (sympy.Ne, sympy.StrictLessThan, sympy.LessThan, sympy.StrictGreaterThan, sympy.GreaterThan)
    backed = all(s in values for s in guard.free_symbols)  # an unbacked symbol (u0 ...) has no value
    if not (guard.free_symbols and backed):
        return False
    return isinstance(guard, relations) or (isinstance(guard, sympy.Eq) and _holds_at_other_sizes(guard, values))


def _holds_at_other_sizes(guard: sympy.Basic, values: dict) -> bool:
    """Whether an equality leaves every size it names free to change: it still holds at 2 or more
    of a few other values of each size, moved alone (the 8 below it, none below 2, the 8 above it,
    and 2 and 4 times it, which keep what the example divides by). `Eq(s % 2, 0)` and
    `Eq(Max(1, s // 2), s // 2)` do; `Eq(s, 7)` pins s, and admitting it would turn one symbolic
    graph into a dynamo recompile per size."""
    for symbol in guard.free_symbols:
        hint = int(values[symbol])
        others = [*range(max(2, hint - 8), hint), *range(hint + 1, hint + 9), 2 * hint, 4 * hint]
        holding = sum(bool(guard.xreplace({**values, symbol: sympy.Integer(v)})) for v in others)
        if holding < 2:
            return False
    return True


def hints(shape_env: Any) -> dict[sympy.Symbol, sympy.Integer]:
    """The example's value of each backed symbol (torch 2.13 renamed `var_to_val`)."""
    values = getattr(shape_env, "backed_var_to_val", None)
    return values if values is not None else shape_env.var_to_val


# ---- guards as JSON: [class name, *arguments], a symbol ["symbol", name], an integer ["int", n] ----


class UnknownExpression(ValueError):
    """An expression with a node outside ENCODABLE, or a tree naming one."""


def _encodable() -> dict[str, type]:
    classes = {}
    for prefix, module in (("sympy", sympy), ("torch", torch_sympy_functions)):
        for name in dir(module):
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, sympy.Basic) and not issubclass(value, sympy.Atom):
                classes[f"{prefix}.{name}"] = value
    return classes


# sympy's and torch's sympy functions by name: sympy.Add, torch.FloorDiv, torch.Max (not sympy.Max) ...
ENCODABLE = _encodable()
_NAMES = {cls: name for name, cls in ENCODABLE.items()}


def encode(expr: sympy.Basic) -> list:
    if isinstance(expr, sympy.Symbol):
        return ["symbol", expr.name]
    if isinstance(expr, sympy.Integer):
        return ["int", int(expr)]
    if isinstance(expr, sympy.Rational):
        return ["rational", int(expr.p), int(expr.q)]
    if isinstance(expr, sympy.logic.boolalg.BooleanAtom):
        return ["bool", bool(expr)]
    name = _NAMES.get(type(expr))
    if name is None:
        raise UnknownExpression(f"cannot encode {type(expr).__name__}")
    return [name, *(encode(a) for a in expr.args)]


def decode(tree: list, symbols: dict[str, sympy.Symbol]) -> sympy.Basic:
    kind, *args = tree
    if kind == "symbol":
        if args[0] not in symbols:
            raise UnknownExpression(f"no symbol {args[0]}")
        return symbols[args[0]]
    if kind == "int":
        return sympy.Integer(args[0])
    if kind == "rational":
        return sympy.Rational(args[0], args[1])
    if kind == "bool":
        return sympy.true if args[0] else sympy.false
    if kind not in ENCODABLE:
        raise UnknownExpression(f"no class {kind}")
    return ENCODABLE[kind](*(decode(a, symbols) for a in args))
