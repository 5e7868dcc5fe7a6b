"""Stage `renderer`: a linearized kernel -> C++ source (no ATen headers; compiles fast).

A renderer is a table from ops to C++ expressions plus what is specific to C++: types,
literals, loops and OpenMP. Semantics that C lacks (NaN-propagating max, safe integer
division, integer powers, shifts past the width) come from the small prelude below.

Note: kernel errors
    A kernel with CHECKs takes one more parameter, `int32_t* ember_error`; a failed check
    stores its code (1 + its position in `RenderedKernel.errors`) there and the kernel goes
    on with a safe value. The wrapper raises the matching Python exception after the call.
    Racing threads store nonzero codes to one int: whichever lands, an error is reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import CheckArg, Ops, UOp

# No FMA contraction (-ffp-contract=off in runtime/cpu.py): eager rounds a product and a sum
# separately, so kernels must too. (Not `#pragma GCC optimize`: it stops gcc from inlining
# the helpers below into loops, which then do not vectorize.)
PRELUDE = r"""#include <cstdint>
template <typename T> static inline T ember_max(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
template <typename T> static inline T ember_min(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a < b ? a : b)); }
// Integer division by zero gives 0 here, never a crash; a CHECK reports it (Note: kernel errors).
template <typename T> static inline T ember_idiv(T a, T b) {
  return b == 0 ? 0 : (b == -1 ? (T)(0 - (uint64_t)a) : a / b);
}
template <typename T> static inline T ember_mod(T a, T b) { return (b == 0 || b == -1) ? 0 : a % b; }
template <typename T> static inline T ember_ipow(T a, T b) {
  if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
  T r = 1; while (b) { if (b & 1) r = (T)((uint64_t)r * (uint64_t)a); a = (T)((uint64_t)a * (uint64_t)a); b >>= 1; }
  return r;
}
template <typename T, typename S> static inline T ember_shl(T a, S b) {
  return (b < 0 || b >= (S)(8 * sizeof(T))) ? 0 : (T)((uint64_t)a << b);
}
template <typename T, typename S> static inline T ember_shr(T a, S b) {
  return (b < 0 || b >= (S)(8 * sizeof(T))) ? (a < 0 ? -1 : 0) : (T)(a >> b);
}
"""

# libm through gcc builtins: no <cmath> to parse (half of a small kernel's compile time).
# A builtin binds to the C library function, so the simd declarations below still apply.
UNARY_CALLS = {
    Ops.EXP: "exp", Ops.EXP2: "exp2", Ops.EXPM1: "expm1", Ops.LOG: "log", Ops.LOG2: "log2", Ops.LOG10: "log10",
    Ops.LOG1P: "log1p", Ops.SQRT: "sqrt", Ops.SIN: "sin", Ops.COS: "cos", Ops.TAN: "tan", Ops.ASIN: "asin",
    Ops.ACOS: "acos", Ops.ATAN: "atan", Ops.SINH: "sinh", Ops.COSH: "cosh", Ops.TANH: "tanh", Ops.ERF: "erf",
    Ops.FLOOR: "floor", Ops.CEIL: "ceil", Ops.ROUND: "nearbyint", Ops.TRUNC: "trunc", Ops.ABS: "fabs",
}  # fmt: skip


def libm(name: str, dtype: DType) -> str:
    """The gcc builtin for libm function `name` at `dtype` (sinf for float, sin for double)."""
    return f"__builtin_{name}{'f' if dtype is dtypes.float32 else ''}"


INFIX = {
    Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.FDIV: "/", Ops.CMPLT: "<", Ops.CMPLE: "<=", Ops.CMPEQ: "==",
    Ops.CMPNE: "!=", Ops.AND: "&", Ops.OR: "|", Ops.XOR: "^",
}  # fmt: skip


def _wraps(dtype: DType) -> str | None:
    """Note: integer overflow wraps. Eager's signed +, -, * and neg wrap around (two's complement);
    in C++ signed overflow is undefined, and gcc folds (x + 1) > x to true. So data (not index)
    arithmetic on signed ints goes through the unsigned type of at least its width, which wraps."""
    if dtype.kind != "int":
        return None
    return "uint64_t" if dtype.itemsize == 8 else "uint32_t"


def _binary_call(u: UOp, a: str, b: str) -> str:
    operand = u.src[0].dtype
    if u.op in (Ops.ADD, Ops.SUB, Ops.MUL) and (unsigned := _wraps(operand)) is not None:
        return f"(({operand.ctype})(({unsigned}){a} {INFIX[u.op]} ({unsigned}){b}))"
    if u.op is Ops.IDIV:
        return f"({a} / {b})" if operand is dtypes.index else f"ember_idiv<{operand.ctype}>({a}, {b})"
    if u.op is Ops.MOD:
        return f"({a} % {b})" if operand is dtypes.index else f"ember_mod<{operand.ctype}>({a}, {b})"
    if u.op is Ops.FMOD:
        return f"{libm('fmod', operand)}({a}, {b})"
    if u.op in (Ops.MAX, Ops.MIN):
        return f"ember_{u.op.name.lower()}<{operand.ctype}>({a}, {b})"
    if u.op is Ops.POW:
        return f"{libm('pow', operand)}({a}, {b})" if operand.is_float else f"ember_ipow<{operand.ctype}>({a}, {b})"
    if u.op is Ops.ATAN2:
        return f"{libm('atan2', operand)}({a}, {b})"
    if u.op in (Ops.SHL, Ops.SHR):
        return f"ember_{u.op.name.lower()}<{operand.ctype}>({a}, {b})"
    return f"({a} {INFIX[u.op]} {b})"


def _unary_call(u: UOp, x: str) -> str:
    if u.op is Ops.NEG and (unsigned := _wraps(u.dtype)) is not None:
        return f"(({u.dtype.ctype})(0 - ({unsigned}){x}))"
    if u.op is Ops.NEG:
        return f"(- {x})"  # the space: x may be a negative literal, and --0.5f is a decrement
    if u.op is Ops.NOT:
        return f"(!{x})" if u.src[0].dtype.is_bool else f"(~{x})"
    if u.op is Ops.ABS and (unsigned := _wraps(u.dtype)) is not None:
        return f"({x} < 0 ? ({u.dtype.ctype})(0 - ({unsigned}){x}) : {x})"
    if u.op is Ops.ABS and not u.dtype.is_float:
        return f"({x} < 0 ? -{x} : {x})"
    if u.op is Ops.CAST:
        return f"static_cast<{u.dtype.ctype}>({x})"
    if u.op in (Ops.ISNAN, Ops.ISINF):
        return f"__builtin_{u.op.name.lower()}({x})"
    return f"{libm(UNARY_CALLS[u.op], u.src[0].dtype)}({x})"


def render_const(value: int | float | bool, dtype: DType) -> str:
    if dtype.is_bool:
        return "true" if value else "false"
    if dtype.is_float:
        suffix = "f" if dtype is dtypes.float32 else ""
        if math.isnan(value):
            return f'__builtin_nan{suffix}("")'
        if math.isinf(value):
            return f"{'-' if value < 0 else ''}__builtin_inf{suffix}()"
        return f"{value!r}{suffix}"
    if dtype.itemsize == 8:
        return "INT64_MIN" if value == -(2**63) else f"INT64_C({value})"
    return f"(({dtype.ctype}){value})"


@dataclass
class RenderedKernel:
    name: str
    source: str
    params: list[tuple[str, DType, bool]]  # (name, dtype, written)
    errors: list[CheckArg] = field(default_factory=list)  # error code i+1 is errors[i]


def render(name: str, program: list[UOp], written: frozenset[str], parallel_threshold: int,
           simd_math: tuple[tuple[str, int], ...] = ()) -> RenderedKernel:  # fmt: skip
    """`simd_math`: (name, arity) of the libm functions the host can call on vectors."""
    buffers = sorted({u.arg.name: u for p in program for u in p.src if u.op is Ops.BUFFER}.values(),
                     key=lambda b: int(b.arg.name[1:]))  # fmt: skip
    params = [(b.arg.name, b.dtype, b.arg.name in written) for b in buffers]
    signature = ", ".join(f"{'' if w else 'const '}{d.ctype}* __restrict__ {n}" for n, d, w in params)
    errors = list(dict.fromkeys(u.arg for u in program if u.op is Ops.CHECK))
    if errors:  # Note: kernel errors
        signature += ", int32_t* ember_error"
    body = _render_body(program, parallel_threshold, errors)
    declarations = simd_declarations(simd_math) + reduction_declarations(program)
    source = f'{PRELUDE}{declarations}\nextern "C" void {name}({signature}) {{\n{body}}}\n'
    return RenderedKernel(name, source, params, errors)


def simd_declarations(functions: tuple[tuple[str, int], ...]) -> str:
    """Declaring libm functions `simd` lets gcc call glibc's vector versions (libmvec) in
    vectorized loops: about 10x on transcendental-heavy loops, accurate to a few ulp."""
    if not functions:
        return ""
    lines = ['extern "C" {']
    for name, arity in functions:
        for ctype, suffix in (("float", "f"), ("double", "")):
            params = ", ".join([ctype] * arity)
            lines.append(f'__attribute__((simd("notinbranch"))) {ctype} {name}{suffix}({params}) noexcept;')
    return "\n".join(lines) + "\n}\n"


def reduction_declarations(program: list[UOp]) -> str:
    """OpenMP reductions for max/min with ember's NaN semantics, per type the kernel uses."""
    lines = []
    for combine, ctype in sorted({(u.arg.combine.name, u.dtype.ctype) for u in program if u.op is Ops.DEFINE_ACC
                                  and u.arg.combine in (Ops.MAX, Ops.MIN)}):  # fmt: skip
        fn = f"ember_{combine.lower()}<{ctype}>"
        lines.append(f"#pragma omp declare reduction({_reduction_name(combine, ctype)} : {ctype} : "
                     f"omp_out = {fn}(omp_out, omp_in)) initializer(omp_priv = omp_orig)")  # fmt: skip
    return "\n".join(lines) + ("\n" if lines else "")


def _reduction_name(combine: str, ctype: str) -> str:
    return f"ember_{combine.lower()}_{ctype.replace('_t', '')}"


def loop_pragma(program: list[UOp], start: int, outermost: bool, parallel_threshold: int) -> str | None:
    """OpenMP for the loop opened at program[start]: `parallel for` on a large outermost
    loop, `simd` on an innermost one, with a reduction clause for each accumulator updated
    inside and declared outside (but none on the lane loop of a lane accumulator, whose
    iterations update distinct elements: Note: lane accumulators, codegen/lanes.py)."""
    loop = program[start]
    innermost, updated, declared_inside, depth = True, [], set(), 0
    for u in program[start + 1 :]:
        if u.op is Ops.RANGE:
            innermost, depth = False, depth + 1
        elif u.op is Ops.ENDRANGE:
            if depth == 0:
                break
            depth -= 1
        elif u.op is Ops.DEFINE_ACC:
            declared_inside.add(u)
        elif u.op is Ops.ACC_UPDATE and u.src[0] not in declared_inside and u.src[0] not in updated:
            if not (u.src[0].arg.lanes > 1 and u.src[-1] is loop):
                updated.append(u.src[0])
    size = loop.src[0].arg
    parallel = outermost and size > 1 and _work(program, loop) >= parallel_threshold
    if not parallel and not innermost:
        return None
    words = (["parallel for"] if parallel else []) + (["simd"] if innermost else [])
    clauses = [f"reduction({_clause_op(acc)}:{_acc_section(acc)})" for acc in updated]
    return "#pragma omp " + " ".join(words + clauses)


def _acc_section(acc: UOp) -> str:
    """An accumulator in a reduction clause: a scalar, or the whole array of a lane accumulator."""
    return f"acc{acc.arg.id}[:{acc.arg.lanes}]" if acc.arg.lanes > 1 else f"acc{acc.arg.id}"


def _clause_op(acc: UOp) -> str:
    combine = acc.arg.combine
    if combine in (Ops.ADD, Ops.MUL):
        return "+" if combine is Ops.ADD else "*"
    return _reduction_name(combine.name, acc.dtype.ctype)


def _render_body(program: list[UOp], parallel_threshold: int, errors: list[CheckArg]) -> str:
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

    for i, u in enumerate(program):
        pad = "  " * depth
        if u.op is Ops.RANGE:
            size = u.src[0].arg
            if (pragma := loop_pragma(program, i, depth == 1, parallel_threshold)) is not None:
                lines.append(f"{pad}{pragma}")
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
            lines.extend(_declare_acc(u, pad))
        elif u.op is Ops.ACC_UPDATE:
            acc = names[u.src[0]] + (f"[{ref(u.src[-1])}]" if u.src[0].arg.lanes > 1 else "")
            combined = _combine(u.src[0].arg.combine, u.dtype, acc, ref(u.src[1]))
            lines.append(f"{pad}{acc} = {combined};")
        elif u.op is Ops.ACC_READ:
            names[u] = names[u.src[0]] + (f"[{ref(u.src[2])}]" if u.src[0].arg.lanes > 1 else "")
        elif u.op is Ops.CHECK:
            names[u] = ref(u.src[0])
            lines.append(f"{pad}if (!{ref(u.src[1])}) ember_error[0] = {errors.index(u.arg) + 1};")
        else:
            names[u] = f"v{counter}"
            counter += 1
            lines.append(f"{pad}const {u.dtype.ctype} {names[u]} = {_expression(u, [ref(s) for s in u.src])};")
    return "\n".join(lines) + "\n"


def _declare_acc(acc: UOp, pad: str) -> list[str]:
    identity, name = render_const(acc.arg.identity, acc.dtype), f"acc{acc.arg.id}"
    if acc.arg.lanes == 1:
        return [f"{pad}{acc.dtype.ctype} {name} = {identity};"]
    return [f"{pad}{acc.dtype.ctype} {name}[{acc.arg.lanes}];", f"{pad}#pragma omp simd",
            f"{pad}for (int64_t i = 0; i < {acc.arg.lanes}; i++) {name}[i] = {identity};"]  # fmt: skip


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
