"""Size variables: torch's symbolic sizes as UOps, and UOps of sizes as Python source.

Note: symbolic sizes
    Under `torch.compile(dynamic=True)` (or `mark_dynamic`) the graph ember gets has sizes that are
    torch SymInts: sympy expressions over the shape environment's symbols (s0, s1, ...), each
    with a range of values it is known to keep (dynamo makes a dynamic size at least 2; 0 and 1
    are specialized). ember compiles such a graph once (compile_symbolic.py): lowering keeps the
    SymInts as they come (a Layout's sizes and strides, a view's shape), and where a size enters
    a UOp it becomes an index expression over DEFINE_VARs, one per symbol, with the symbol's
    bounds as its vmin/vmax, so bound analysis and simplification work on it as on any index.
    A RANGE's size is then such an expression instead of a CONST; a C++ kernel takes each
    variable it reads as an `int64_t` argument after its buffers; the wrapper binds each
    variable from the inputs' sizes at the start of `call` and evaluates every allocation's
    size, every view and every extern's size argument from them.

    Nothing assumes a size silently: every guard the compile asks of the shape environment is
    either one dynamo will check (a relation that does not fix a size, asked while a forward
    compiles: Note: guards a compile adds, size_guards.py) or refused, so a decision that needs a
    concrete value (an int() of a size, any guard in a backward) raises there, and the graph falls
    back to per-shape specialization with that reason (shape_specialization.py). A decision made
    on a UOp size either reads its bounds or refuses with `SymbolicSizeError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, UOp, VarArg

# the largest size a variable is assumed to reach where torch gives no bound (sizes are int64)
UNBOUNDED = 2**62


class SymbolicSizeError(Exception):
    """A stage met a symbolic size where it needs a concrete one (Note: symbolic sizes)."""


def variable(name: str, vmin: int, vmax: int) -> UOp:
    return UOp(Ops.DEFINE_VAR, dtypes.index, (), VarArg(name, vmin, vmax))


def is_symbolic(value: Any) -> bool:
    """Whether `value` is a torch SymInt whose value is not a constant."""
    import torch

    return isinstance(value, torch.SymInt) and not isinstance(value.node.maybe_as_int(), int)


def symbolic_size(value: Any) -> UOp | None:
    """A torch SymInt as an index UOp over DEFINE_VARs; None when `value` is no SymInt."""
    import torch

    if not isinstance(value, torch.SymInt):
        return None
    constant = value.node.maybe_as_int()
    if isinstance(constant, int):
        return UOp.const(dtypes.index, constant)
    from ember.uop.symbolic import simplify

    return simplify(sympy_to_uop(value.node.expr, value.node.shape_env))  # constants to the right, as rules expect


def symbolic_scalar(value: Any) -> UOp | None:
    """A torch SymFloat computed from sizes (BatchNorm's n / (n - 1) under dynamic shapes) as a
    float64 UOp over DEFINE_VARs; None when `value` is no SymFloat."""
    import torch

    if not isinstance(value, torch.SymFloat):
        return None
    return sympy_to_float_uop(value.node.expr, value.node.shape_env)


def symbolic_value(value: Any) -> UOp | None:
    """A SymInt as an index UOp, a SymFloat of sizes as a float64 one; None for other values."""
    size = symbolic_size(value)
    return size if size is not None else symbolic_scalar(value)


def index_size(value: Any) -> int | UOp:
    """A size as kernels take it: an int, or a UOp of size variables when it is symbolic."""
    if type(value) is int:
        return value
    size = symbolic_size(value) if not isinstance(value, UOp) else value
    if size is None:
        return int(value)
    return size.arg if size.op is Ops.CONST else size


def size_hint(value: Any) -> int:
    """A size's value in the example the graph was compiled with (an estimate, for heuristics only)."""
    if type(value) is int:
        return value
    import torch

    if isinstance(value, torch.SymInt):
        return int(value.node.hint) if value.node.hint is not None else UNBOUNDED
    if isinstance(value, UOp):  # a stride ember derived: each variable at its lower bound, at least 2
        return estimate(value)
    return int(value)


def known_size_hint(value: Any) -> int | None:
    """`size_hint`, or None for a size the example gives no value (an unbacked symbol)."""
    hint = size_hint(value)
    return None if hint >= UNBOUNDED else hint


def estimate(u: UOp, at: int = 2) -> int:
    """A size expression's value with each variable at its lower bound, and at least `at`;
    UNBOUNDED where it does not fold to a number."""
    if u.op is Ops.DEFINE_VAR:
        return max(u.arg.vmin, at)
    from ember.uop.ops import substitute
    from ember.uop.symbolic import simplify

    values = {v: UOp.const(dtypes.index, max(v.arg.vmin, at)) for v in variables_of(u)}
    folded = simplify(substitute(u, values))
    return folded.arg if folded.op is Ops.CONST else UNBOUNDED


def sympy_to_uop(expr: Any, shape_env: Any) -> UOp:
    """An integer sympy expression of the shape environment as a UOp, or SymbolicSizeError."""
    import sympy
    from torch.utils._sympy.functions import (
        CeilToInt,
        CleanDiv,
        FloorDiv,
        FloorToInt,
        IntTrueDiv,
        Max,
        Min,
        Mod,
        PythonMod,
    )

    if isinstance(expr, sympy.Integer):
        return UOp.const(dtypes.index, int(expr))
    if isinstance(expr, sympy.Symbol):
        return _symbol_variable(expr, shape_env)
    if isinstance(expr, (FloorToInt, CeilToInt)) and isinstance(expr.args[0], IntTrueDiv):  # math.ceil(s / 32)
        a, b = (sympy_to_uop(x, shape_env) for x in expr.args[0].args)
        if a.vmin < 0 or b.vmin < 1:
            raise SymbolicSizeError(f"size expression {expr} may divide a negative number or by 0")
        return a // b if isinstance(expr, FloorToInt) else (a + b - UOp.const(dtypes.index, 1)) // b
    args = [sympy_to_uop(a, shape_env) for a in expr.args] if not isinstance(expr, sympy.Pow) else []
    if isinstance(expr, sympy.Add):
        return _fold(args, lambda a, b: a + b)
    if isinstance(expr, sympy.Mul):
        return _fold(args, lambda a, b: a * b)
    if isinstance(expr, (FloorDiv, CleanDiv, Mod, PythonMod)):
        # sympy's floor division and remainder are C's (IDIV, MOD) only for a dividend >= 0, divisor > 0
        if args[0].vmin < 0 or args[1].vmin < 1:
            raise SymbolicSizeError(f"size expression {expr} may divide a negative number or by 0")
        return args[0] // args[1] if isinstance(expr, (FloorDiv, CleanDiv)) else args[0] % args[1]
    if isinstance(expr, (sympy.Max, sympy.Min, Max, Min)):
        op = Ops.MAX if isinstance(expr, (sympy.Max, Max)) else Ops.MIN
        return _fold(args, lambda a, b: a.alu(op, b))
    if isinstance(expr, sympy.Pow) and isinstance(expr.exp, sympy.Integer) and int(expr.exp) >= 1:
        base = sympy_to_uop(expr.base, shape_env)
        return _fold([base] * int(expr.exp), lambda a, b: a * b)
    raise SymbolicSizeError(f"size expression {expr} ({type(expr).__name__}) has no index form")


def sympy_to_float_uop(expr: Any, shape_env: Any) -> UOp:
    """A float sympy expression of sizes (torch's IntTrueDiv, FloatTrueDiv, ToFloat over integer
    expressions) as a float64 UOp, computed as Python computes it; or SymbolicSizeError."""
    import sympy
    from torch.utils._sympy.functions import FloatTrueDiv, IntTrueDiv, ToFloat

    if isinstance(expr, sympy.Number):
        return UOp.const(dtypes.float64, float(expr))
    if expr.is_integer or isinstance(expr, ToFloat):
        return sympy_to_uop(expr.args[0] if isinstance(expr, ToFloat) else expr, shape_env).cast(dtypes.float64)
    if isinstance(expr, (IntTrueDiv, FloatTrueDiv)):
        return sympy_to_float_uop(expr.args[0], shape_env).alu(Ops.FDIV, sympy_to_float_uop(expr.args[1], shape_env))
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        args = [sympy_to_float_uop(a, shape_env) for a in expr.args]
        return _fold(args, (lambda a, b: a + b) if isinstance(expr, sympy.Add) else (lambda a, b: a * b))
    if isinstance(expr, sympy.Pow) and isinstance(expr.exp, sympy.Integer) and int(expr.exp) != 0:
        power = _fold([sympy_to_float_uop(expr.base, shape_env)] * abs(int(expr.exp)), lambda a, b: a * b)
        return power if int(expr.exp) > 0 else UOp.const(dtypes.float64, 1.0).alu(Ops.FDIV, power)
    raise SymbolicSizeError(f"float expression {expr} ({type(expr).__name__}) of sizes has no kernel form")


def _fold(args: list[UOp], combine) -> UOp:
    result = args[0]
    for a in args[1:]:
        result = combine(result, a)
    return result


def _symbol_variable(symbol: Any, shape_env: Any) -> UOp:
    name = str(symbol)
    if not name.startswith("s"):  # u0, ...: an unbacked size (nonzero's count), no input gives it
        raise SymbolicSizeError(f"size {name} is data-dependent (unbacked): no input tells its value")
    import sympy

    bound = shape_env.var_to_range.get(symbol) if shape_env is not None else None
    lower = int(bound.lower) if bound is not None and isinstance(bound.lower, sympy.Integer) else 0
    upper = int(bound.upper) if bound is not None and isinstance(bound.upper, sympy.Integer) else UNBOUNDED
    return variable(name, max(lower, 0), min(upper, UNBOUNDED))


def variables_of(u: UOp) -> list[UOp]:
    """The DEFINE_VARs `u` reads, ordered by name."""
    found = {x for x in u.toposort if x.op is Ops.DEFINE_VAR}
    return sorted(found, key=lambda v: v.arg.name)


# ---- sizes as Python source (the wrapper) ------------------------------------------------


@dataclass(frozen=True)
class SizeSpelling:
    """How one language spells an index expression of constants and size variables."""

    language: str
    binary: dict[Ops, str]
    extreme: Callable[[str, str, str], str]  # ("max" | "min", a, b) -> source
    negates: bool  # NEG has a spelling
    error: type[Exception]  # raised for an expression with no spelling
    float_cast: str | None = None  # how a size becomes a float64 (a SymFloat's expression), if it can


def spell_size(u: UOp, spelling: SizeSpelling) -> str:
    """Source for an index UOp of constants and size variables, each variable by its name."""
    if u.op is Ops.CONST:
        return str(u.arg)
    if u.op is Ops.DEFINE_VAR:
        return u.arg.name
    if u.op in spelling.binary:
        return f"({spell_size(u.src[0], spelling)} {spelling.binary[u.op]} {spell_size(u.src[1], spelling)})"
    if u.op in (Ops.MAX, Ops.MIN):
        return spelling.extreme(u.op.name.lower(), spell_size(u.src[0], spelling), spell_size(u.src[1], spelling))
    if u.op is Ops.NEG and spelling.negates:
        return f"(-{spell_size(u.src[0], spelling)})"
    if u.op is Ops.CAST and u.dtype == dtypes.float64 and spelling.float_cast is not None:
        return f"{spelling.float_cast}({spell_size(u.src[0], spelling)})"
    raise spelling.error(f"size expression {u} has no {spelling.language} form")


PYTHON_SIZES = SizeSpelling(
    "Python", {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.IDIV: "//", Ops.MOD: "%", Ops.FDIV: "/"},
    lambda op, a, b: f"{op}({a}, {b})", negates=True, error=SymbolicSizeError, float_cast="float",
)  # fmt: skip


def python_source(u: UOp) -> str:
    """Python for an index UOp of constants and size variables (the wrapper binds each variable
    by its name)."""
    return spell_size(u, PYTHON_SIZES)


def size_source(value: Any) -> str:
    """Python for a size, a stride or a tuple of them, symbolic or not."""
    if isinstance(value, (tuple, list)):
        items = ", ".join(size_source(v) for v in value)
        return f"({items}{',' if len(value) == 1 else ''})" if isinstance(value, tuple) else f"[{items}]"
    if isinstance(value, UOp):
        return python_source(value)
    size = symbolic_value(value)
    return python_source(size) if size is not None else repr(value)


def known_zero(n) -> bool:
    """Whether the size `n` (an int, or an expression of symbolic sizes) is 0, asking no guard of
    a symbolic one (Note: symbolic sizes, uop/variables.py): dynamo passes sizes 0 and 1 as
    constants, so a symbolic size is at least 2, and an expression of them is 0 only where that
    is provable (a constant factor 0). Asking `n == 0` of a padded length (s - s % 8 + 8, as the
    attention mask's padding on the GPU makes) would need a guard the symbolic compile refuses."""
    return _known_equal(n, 0)


def known_one(n) -> bool:
    """Whether the size `n` is 1, asking no guard of a symbolic one (as `known_zero`)."""
    return _known_equal(n, 1)


def _known_equal(n, value: int) -> bool:
    if isinstance(n, int):
        return n == value
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(n == value)
