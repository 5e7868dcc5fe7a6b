"""Stage `renderer`: a linearized kernel -> C++ source (no ATen headers; compiles fast).

A renderer is a table from ops to C++ expressions plus what is specific to C++: types,
literals, loops and OpenMP. Semantics that C lacks (NaN-propagating max, safe integer
division, integer powers, shifts past the width) come from the small prelude below.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import Ops, UOp

PRELUDE = r"""#include <cmath>
#include <cstdint>
#include <climits>
template <typename T> static inline T ember_max(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
template <typename T> static inline T ember_min(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a < b ? a : b)); }
// Note: integer division by zero raises in eager; here it gives 0 instead of a crash.
template <typename T> static inline T ember_idiv(T a, T b) { return b == 0 ? 0 : (b == -1 ? (T)(0 - (uint64_t)a) : a / b); }
template <typename T> static inline T ember_mod(T a, T b) { return (b == 0 || b == -1) ? 0 : a % b; }
template <typename T> static inline T ember_ipow(T a, T b) {
  if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
  T r = 1; while (b) { if (b & 1) r = (T)(r * a); a = (T)(a * a); b >>= 1; } return r;
}
template <typename T, typename S> static inline T ember_shl(T a, S b) {
  return (b < 0 || b >= (S)(8 * sizeof(T))) ? 0 : (T)((uint64_t)a << b);
}
template <typename T, typename S> static inline T ember_shr(T a, S b) {
  return (b < 0 || b >= (S)(8 * sizeof(T))) ? (a < 0 ? -1 : 0) : (T)(a >> b);
}
"""

UNARY_CALLS = {
    Ops.EXP: "std::exp", Ops.EXP2: "std::exp2", Ops.EXPM1: "std::expm1", Ops.LOG: "std::log", Ops.LOG2: "std::log2",
    Ops.LOG10: "std::log10", Ops.LOG1P: "std::log1p", Ops.SQRT: "std::sqrt", Ops.SIN: "std::sin", Ops.COS: "std::cos",
    Ops.TAN: "std::tan", Ops.ASIN: "std::asin", Ops.ACOS: "std::acos", Ops.ATAN: "std::atan", Ops.SINH: "std::sinh",
    Ops.COSH: "std::cosh", Ops.TANH: "std::tanh", Ops.ERF: "std::erf", Ops.FLOOR: "std::floor", Ops.CEIL: "std::ceil",
    Ops.ROUND: "std::nearbyint", Ops.TRUNC: "std::trunc", Ops.ISNAN: "std::isnan", Ops.ISINF: "std::isinf",
}  # fmt: skip
INFIX = {
    Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.FDIV: "/", Ops.CMPLT: "<", Ops.CMPLE: "<=", Ops.CMPEQ: "==",
    Ops.CMPNE: "!=", Ops.AND: "&", Ops.OR: "|", Ops.XOR: "^",
}  # fmt: skip


def _binary_call(u: UOp, a: str, b: str) -> str:
    operand = u.src[0].dtype
    if u.op is Ops.IDIV:
        return f"({a} / {b})" if operand is dtypes.index else f"ember_idiv<{operand.ctype}>({a}, {b})"
    if u.op is Ops.MOD:
        return f"({a} % {b})" if operand is dtypes.index else f"ember_mod<{operand.ctype}>({a}, {b})"
    if u.op is Ops.FMOD:
        return f"std::fmod({a}, {b})"
    if u.op in (Ops.MAX, Ops.MIN):
        return f"ember_{u.op.name.lower()}<{operand.ctype}>({a}, {b})"
    if u.op is Ops.POW:
        return f"std::pow({a}, {b})" if operand.is_float else f"ember_ipow<{operand.ctype}>({a}, {b})"
    if u.op is Ops.ATAN2:
        return f"std::atan2({a}, {b})"
    if u.op in (Ops.SHL, Ops.SHR):
        return f"ember_{u.op.name.lower()}<{operand.ctype}>({a}, {b})"
    return f"({a} {INFIX[u.op]} {b})"


def _unary_call(u: UOp, x: str) -> str:
    if u.op is Ops.NEG:
        return f"(-{x})"
    if u.op is Ops.NOT:
        return f"(!{x})" if u.src[0].dtype.is_bool else f"(~{x})"
    if u.op is Ops.ABS:
        return f"std::abs({x})"
    if u.op is Ops.CAST:
        return f"static_cast<{u.dtype.ctype}>({x})"
    return f"{UNARY_CALLS[u.op]}({x})"


def render_const(value: int | float | bool, dtype: DType) -> str:
    if dtype.is_bool:
        return "true" if value else "false"
    if dtype.is_float:
        suffix = "f" if dtype is dtypes.float32 else ""
        if math.isnan(value):
            return f"NAN"
        if math.isinf(value):
            return f"{'-' if value < 0 else ''}INFINITY"
        return f"{value!r}{suffix}"
    if dtype.itemsize == 8:
        return "INT64_MIN" if value == -(2**63) else f"INT64_C({value})"
    return f"(({dtype.ctype}){value})"


@dataclass
class RenderedKernel:
    name: str
    source: str
    params: list[tuple[str, DType, bool]]  # (name, dtype, written)


def render(name: str, program: list[UOp], written: frozenset[str], parallel_threshold: int) -> RenderedKernel:
    buffers = sorted({u.arg.name: u for p in program for u in p.src if u.op is Ops.BUFFER}.values(),
                     key=lambda b: int(b.arg.name[1:]))  # fmt: skip
    params = [(b.arg.name, b.dtype, b.arg.name in written) for b in buffers]
    signature = ", ".join(
        f"{'' if w else 'const '}{d.ctype}* __restrict__ {n}" for n, d, w in params
    )
    body = _render_body(program, parallel_threshold)
    source = f'{PRELUDE}\nextern "C" void {name}({signature}) {{\n{body}}}\n'
    return RenderedKernel(name, source, params)


def _render_body(program: list[UOp], parallel_threshold: int) -> str:
    names: dict[UOp, str] = {}
    lines: list[str] = []
    depth = 1
    counter = 0

    def ref(u: UOp) -> str:
        if u.op is Ops.CONST:
            return render_const(u.arg, u.dtype)
        if u.op is Ops.RANGE:
            return f"r{u.arg.axis}"
        return names[u]

    for u in program:
        pad = "  " * depth
        if u.op is Ops.RANGE:
            size = u.src[0].arg
            if depth == 1 and not u.arg.reduce and _work(program, u) >= parallel_threshold and size > 1:
                lines.append(f"{pad}#pragma omp parallel for")
            lines.append(f"{pad}for (int64_t r{u.arg.axis} = 0; r{u.arg.axis} < {size}; r{u.arg.axis}++) {{")
            depth += 1
        elif u.op is Ops.ENDRANGE:
            depth -= 1
            lines.append(f"{'  ' * depth}}}")
        elif u.op is Ops.INDEX:
            names[u] = f"{u.src[0].arg.name}[{ref(u.src[1])}]"
        elif u.op is Ops.LOAD:
            names[u] = ref(u.src[0])
        elif u.op is Ops.STORE:
            lines.append(f"{pad}{ref(u.src[0])} = {ref(u.src[1])};")
        elif u.op is Ops.DEFINE_ACC:
            names[u] = f"acc{u.arg.id}"
            lines.append(f"{pad}{u.dtype.ctype} acc{u.arg.id} = {render_const(u.arg.identity, u.dtype)};")
        elif u.op is Ops.ACC_UPDATE:
            acc = names[u.src[0]]
            combined = _combine(u.src[0].arg.combine, u.dtype, acc, ref(u.src[1]))
            lines.append(f"{pad}{acc} = {combined};")
        elif u.op is Ops.ACC_READ:
            names[u] = names[u.src[0]]
        else:
            names[u] = f"v{counter}"
            counter += 1
            lines.append(f"{pad}const {u.dtype.ctype} {names[u]} = {_expression(u, [ref(s) for s in u.src])};")
    return "\n".join(lines) + "\n"


def _expression(u: UOp, srcs: list[str]) -> str:
    if u.op is Ops.WHERE:
        return f"({srcs[0]} ? {srcs[1]} : {srcs[2]})"
    if len(srcs) == 2:
        return _binary_call(u, *srcs)
    return _unary_call(u, srcs[0])


_COMBINE: dict[Ops, Callable[[str, str, str], str]] = {
    Ops.ADD: lambda t, a, b: f"{a} + {b}",
    Ops.MUL: lambda t, a, b: f"{a} * {b}",
    Ops.MAX: lambda t, a, b: f"ember_max<{t}>({a}, {b})",
    Ops.MIN: lambda t, a, b: f"ember_min<{t}>({a}, {b})",
}


def _combine(op: Ops, dtype: DType, acc: str, value: str) -> str:
    return _COMBINE[op](dtype.ctype, acc, value)


def _work(program: list[UOp], outer: UOp) -> int:
    """Iterations of the loop nest under `outer`: the product of the ranges opened in it."""
    total, depth, inside = 1, 0, False
    for u in program:
        if u is outer:
            inside, depth = True, 0
        if not inside:
            continue
        if u.op is Ops.RANGE:
            depth += 1
            total = max(total, 1) * u.src[0].arg if depth > 0 else total
        elif u.op is Ops.ENDRANGE:
            depth -= 1
            if depth == 0:
                break
    return total
