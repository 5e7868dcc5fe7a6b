"""Stage `renderer`: a linearized kernel -> C++ source (no ATen headers; compiles fast).

A renderer is a table from ops to C++ expressions plus what is specific to C++: types,
literals, loops and OpenMP. Semantics that C lacks (NaN-propagating max, integer powers) come
from the small prelude below; safe integer division, shifts past the width and casts are
rewritten into plain ops before rendering (Note: semantics written once, codegen/primitives.py).

Note: kernel errors
    A kernel with CHECKs takes one more parameter, `int64_t* ember_error`; a failed check
    stores its code k (1 + its position in `RenderedKernel.errors`) in ember_error[0] and
    the value it reports (the offending index) in ember_error[k], and the kernel goes on
    with a safe value. The wrapper raises the matching Python exception after the call, its
    message naming that value. Racing OpenMP threads store to the same slots: whichever code
    lands, an error is reported, and its slot holds a value its own check reported (one slot
    per check, so a message never names another check's value). The ints are the wrapper
    call's own (`KernelErrorFlag`, made per call): Python threads running one graph at once
    each read only what their own kernels reported.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from ember.codegen.tiling import is_element_loop, is_tile_loop, trip_count
from ember.renderer.choices import (
    DEFAULT_CHOICES,
    KernelChoices,
    file_pragmas,
    nest_perfectly,
    parallel_clauses,
    runs_parallel,
)
from ember.renderer.common import RenderedKernel, kernel_errors, kernel_params, kernel_variables, size_expression
from ember.renderer.tiles import loop_lines
from ember.renderer.vector_math import vector_math_call, vector_math_prelude
from ember.uop.dtypes import LOW_PRECISION, DType, bits_of, dtypes
from ember.uop.ops import CheckArg, Ops, ScatterArg, UOp

# No FMA contraction (-ffp-contract=off in runtime/cpu.py): eager rounds a product and a sum
# separately, so kernels must too. (Not `#pragma GCC optimize`: it stops gcc from inlining
# the helpers below into loops, which then do not vectorize.)
PRELUDE = r"""#include <cstdint>
template <typename T> static inline T ember_max(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
template <typename T> static inline T ember_min(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a < b ? a : b)); }
template <typename T> static inline T ember_ipow(T a, T b) {
  if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
  T r = 1; while (b) { if (b & 1) r = (T)((uint64_t)r * (uint64_t)a); a = (T)((uint64_t)a * (uint64_t)a); b >>= 1; }
  return r;
}
// Stores at computed positions (Note: stores at computed positions, lower/scatter.py): atomic,
// so iterations that hit one element never race; relaxed, as nothing else orders on them.
template <typename T> static inline void ember_store(T* p, T v) { __atomic_store(p, &v, __ATOMIC_RELAXED); }
template <typename T, typename F> static inline void ember_update(T* p, T v, F combine) {
  T old, want;
  __atomic_load(p, &old, __ATOMIC_RELAXED);
  do {
    want = combine(old, v);
  } while (!__atomic_compare_exchange(p, &old, &want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}
// logcumsumexp's step: log(e^a + e^b) = hi + log1p(e^(lo - hi)), with hi the larger. lo - hi is
// NaN only for a NaN operand (the result is NaN) or one infinity twice (the result is it).
template <typename T> static inline T ember_logaddexp(T a, T b) {
  T hi = a > b ? a : b, lo = a > b ? b : a;
  return (hi == lo && hi - lo != 0) ? hi : hi + __builtin_log1p(__builtin_exp(lo - hi));
}
"""

# Philox4x32-10, bit for bit as Triton's tl.randint4x (triton/language/random.py): counter
# (c0, c1, c2, c3) = (offset low, offset high, 0, 0), key (k0, k1) = (seed low, seed high).
# Straight-line integer code, so loops calling it vectorize (Note: counter-based random numbers).
PHILOX = r"""template <int W> static inline uint32_t ember_philox(uint64_t seed, uint64_t offset) {
  uint32_t c0 = (uint32_t)offset, c1 = (uint32_t)(offset >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma GCC unroll 10
  for (int i = 0; i < 10; i++) {
    const uint64_t a = (uint64_t)0xD2511F53u * c0, b = (uint64_t)0xCD9E8D57u * c2;
    c0 = (uint32_t)(b >> 32) ^ c1 ^ k0;
    c2 = (uint32_t)(a >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)b;
    c3 = (uint32_t)a;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return W == 0 ? c0 : (W == 1 ? c1 : (W == 2 ? c2 : c3));
}
"""
# Note: low-precision floats (uop/dtypes.py). float16/bfloat16 are uint16_t bits; these exact,
# branch-free conversions (selects, no tables) vectorize on any x86-64 (gcc 12's _Float16 casts
# vectorize only with AVX512-FP16). They round to nearest even, as eager. (bfloat16 converts in
# UOps shared by every backend: Note: semantics written once, codegen/primitives.py.)
# float16 (IEEE binary16: sign, 5 exponent bits with bias 15, 10 fraction bits):
#   to float32: exponent and fraction moved under float32's (bits 13..30) read as a float32 are
#     the half's value times 2^-112 (bias 127 against 15) for every finite half, a subnormal half
#     becoming a float32 subnormal, so one exact multiplication by 2^112 finishes; exponent 31
#     (infinity, NaN) gets float32's all-ones exponent instead, the fraction kept, NaN quieted.
#   from float32: a result of 2^-14 or more re-biases the exponent and rounds away the 13 low
#     fraction bits to nearest even (a carry runs into the exponent, up to 0x7C00 = infinity from
#     65520 on); a smaller one is a whole number of 2^-24, |f| * 2^24 (exact) rounded to an integer
#     by the FPU's own round-to-nearest-even when added to 2^23. NaN -> 0x7E00 with its sign.
# They need IEEE float arithmetic (no -ffast-math, no flush-to-zero). tests/test_lowp.py checks all
# 65536 halves, every rounding tie, and random float32 bit patterns against eager.
LOW_PRECISION_PRELUDE = r"""static inline float ember_bits_f32(uint32_t u) { return __builtin_bit_cast(float, u); }
static inline uint32_t ember_f32_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
static inline float ember_f16_to_f32(uint16_t h) {
  uint32_t magnitude = ((uint32_t)h & 0x7FFFu) << 13, sign = ((uint32_t)h & 0x8000u) << 16;
  uint32_t finite = ember_f32_bits(ember_bits_f32(magnitude) * 0x1p112f);
  uint32_t quiet = (magnitude & 0x007FFFFFu) != 0 ? 0x00400000u : 0u;
  uint32_t not_finite = magnitude | 0x7F800000u | quiet;
  return ember_bits_f32(sign | (magnitude >= 0x0F800000u ? not_finite : finite));
}
static inline uint16_t ember_f32_to_f16(float f) {
  uint32_t u = ember_f32_bits(f), magnitude = u & 0x7FFFFFFFu, sign = (u >> 16) & 0x8000u;
  uint32_t normal = (magnitude - (112u << 23) + 0x0FFFu + ((magnitude >> 13) & 1u)) >> 13;
  uint32_t subnormal = ember_f32_bits(__builtin_fabsf(f) * 0x1p24f + 0x1p23f) - 0x4B000000u;
  uint32_t half = magnitude < 0x38800000u ? subnormal : (magnitude < 0x47800000u ? normal : 0x7C00u);
  return (uint16_t)(sign | (magnitude > 0x7F800000u ? 0x7E00u : half));
}
"""


def render_cast(x: str, source: DType, target: DType) -> str:
    """A conversion C++ does as eager (codegen/primitives.py leaves no other: Note: semantics
    written once); float16 converts to and from float32 through the exact helpers above."""
    if source is dtypes.float16:
        return f"ember_f16_to_f32({x})"
    if target is dtypes.float16:
        return f"ember_f32_to_f16({x})"
    return x if source is target else f"static_cast<{target.ctype}>({x})"


# libm through gcc builtins: no <cmath> to parse (half of a small kernel's compile time).
# A builtin binds to the C library function, so the simd declarations below still apply.
UNARY_CALLS = {
    Ops.EXP: "exp", Ops.EXP2: "exp2", Ops.EXPM1: "expm1", Ops.LOG: "log", Ops.LOG2: "log2", Ops.LOG10: "log10",
    Ops.LOG1P: "log1p", Ops.SQRT: "sqrt", Ops.SIN: "sin", Ops.COS: "cos", Ops.TAN: "tan", Ops.ASIN: "asin",
    Ops.ACOS: "acos", Ops.ATAN: "atan", Ops.SINH: "sinh", Ops.COSH: "cosh", Ops.TANH: "tanh", Ops.ERF: "erf",
    Ops.FLOOR: "floor", Ops.CEIL: "ceil", Ops.ROUND: "nearbyint", Ops.TRUNC: "trunc", Ops.ABS: "fabs",
}  # fmt: skip


# More libm functions (unary and binary), called like the ones above.
MATH_CALLS = {
    Ops.ACOSH: "acosh", Ops.ASINH: "asinh", Ops.ATANH: "atanh", Ops.ERFC: "erfc", Ops.LGAMMA: "lgamma",
    Ops.COPYSIGN: "copysign", Ops.NEXTAFTER: "nextafter", Ops.HYPOT: "hypot", Ops.FMAX: "fmax", Ops.FMIN: "fmin",
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
    if u.op in (Ops.IDIV, Ops.MOD):  # divisors never 0 or -1 (Note: semantics written once)
        return f"({a} {'/' if u.op is Ops.IDIV else '%'} {b})"
    if u.op is Ops.FMOD:
        return f"{libm('fmod', operand)}({a}, {b})"
    if u.op in (Ops.MAX, Ops.MIN):
        return f"ember_{u.op.name.lower()}<{operand.ctype}>({a}, {b})"
    if u.op is Ops.POW:
        return f"{libm('pow', operand)}({a}, {b})" if operand.is_float else f"ember_ipow<{operand.ctype}>({a}, {b})"
    if u.op is Ops.ATAN2:
        return f"{libm('atan2', operand)}({a}, {b})"
    if u.op in MATH_CALLS:
        return f"{libm(MATH_CALLS[u.op], operand)}({a}, {b})"
    if u.op is Ops.SHL and (unsigned := _wraps(operand)) is not None:  # amounts within the width
        return f"(({operand.ctype})(({unsigned}){a} << {b}))"  # a signed shift overflows, an unsigned one wraps
    if u.op in (Ops.SHL, Ops.SHR):
        return f"({a} {'<<' if u.op is Ops.SHL else '>>'} {b})"
    return f"({a} {INFIX[u.op]} {b})"


def _multiply_add(dtype: DType, a: str, b: str, c: str) -> str:
    """a * b + c: one rounding for floats (fma: gcc vectorizes it to vfmadd under -march=native;
    the file is compiled with -ffp-contract=off, so only this op fuses), wrapping for integers."""
    if dtype.is_float:
        return f"{libm('fma', dtype)}({a}, {b}, {c})"
    if (unsigned := _wraps(dtype)) is not None:
        return f"(({dtype.ctype})(({unsigned}){a} * ({unsigned}){b} + ({unsigned}){c}))"
    return f"({a} * {b} + {c})"


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
        return render_cast(x, u.src[0].dtype, u.dtype)
    if u.op is Ops.BITCAST:
        return f"__builtin_bit_cast({u.dtype.ctype}, {x})"
    if u.op in (Ops.ISNAN, Ops.ISINF):
        return f"__builtin_{u.op.name.lower()}({x})"
    if u.op in MATH_CALLS:
        return f"{libm(MATH_CALLS[u.op], u.src[0].dtype)}({x})"
    if u.op is Ops.COS:
        return f"{cos_alias(u.src[0].dtype)}({x})"
    if (inline := vector_math_call(u.op, u.src[0].dtype)) is not None:
        return f"{inline}({x})"
    return f"{libm(UNARY_CALLS[u.op], u.src[0].dtype)}({x})"


def cos_alias(dtype: DType) -> str:
    """Note: cos through an alias. gcc merges sin(x) and cos(x) of one x into sincos (cexpi),
    which has no vector version, so a loop computing both (rotary embeddings) stays scalar.
    cos called under another name that binds to the same libm symbol is not merged, and its
    `simd` declaration (cos_alias_declarations) still reaches libmvec's vector cos."""
    return f"ember_cos{'f' if dtype is dtypes.float32 else ''}"


def cos_alias_declarations(code: str, simd_math: tuple[tuple[str, int], ...]) -> str:
    """The aliases cos_alias names that `code` calls, declared `simd` where the host has a vector
    cos, and `const` (no errno: -fno-math-errno), which the builtin cos is without saying: a call
    gcc thinks may write memory keeps the loop's loads from being if-converted and vectorized."""
    simd = 'simd("notinbranch"), ' if ("cos", 1) in simd_math else ""
    called = called_functions(code)
    lines = [f'__attribute__(({simd}const)) {ctype} ember_cos{suffix}({ctype}) noexcept __asm__("cos{suffix}");'
             for ctype, suffix in LIBM_TYPES if f"ember_cos{suffix}" in called]  # fmt: skip
    return extern_c_block(lines)


def render_const(value: int | float | bool, dtype: DType) -> str:
    if dtype.is_bool:
        return "true" if value else "false"
    if dtype in LOW_PRECISION:  # the bits of the value it rounds to
        return f"((uint16_t){bits_of(dtype, value):#06x})"
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


def render(name: str, program: list[UOp], written: frozenset[str], parallel_threshold: int,
           simd_math: tuple[tuple[str, int], ...] = (),
           choices: KernelChoices = DEFAULT_CHOICES) -> RenderedKernel:  # fmt: skip
    """`simd_math`: (name, arity) of the libm functions the host can call on vectors;
    `choices`: the decisions the kernel search may vary (Note: kernel choices, choices.py)."""
    program = nest_perfectly(program) if choices.collapse else program
    params = kernel_params(program, written)
    signature = ", ".join(f"{'' if w else 'const '}{d.ctype}* __restrict__ {n}" for n, d, w in params)
    variables = kernel_variables(program)  # Note: symbolic sizes
    signature += "".join(f", const int64_t {v}" for v in variables)
    errors = kernel_errors(program)
    if errors:  # Note: kernel errors
        signature += ", int64_t* ember_error"
    body = render_body(program, parallel_threshold, errors, choices)
    declarations = kernel_declarations(program, body, simd_math)
    source = f'{PRELUDE}{declarations}\nextern "C" void {name}({signature}) {{\n{body}}}\n'
    source = file_pragmas(choices) + source
    tiled = any(is_tile_loop(u) for u in program)
    return RenderedKernel(name, source, params, errors, tiled=tiled, variables=variables)


def kernel_declarations(program: list[UOp], body: str, simd_math: tuple[tuple[str, int], ...]) -> str:
    """What a kernel's `body` needs declared before it: reduction combiners, Philox, float16
    conversions, vector math, and the host's SIMD libm functions it calls (through helpers too)."""
    declarations = reduction_declarations(program)
    if any(u.op is Ops.PHILOX for u in program):
        declarations += PHILOX
    if any(u.dtype is dtypes.float16 for u in program):
        declarations = LOW_PRECISION_PRELUDE + declarations
    declarations += vector_math_prelude(program)
    code = declarations + body  # every call the kernel makes, through helpers too
    return simd_declarations(simd_math, code) + cos_alias_declarations(body, simd_math) + declarations


LIBM_TYPES = (("float", "f"), ("double", ""))  # (C type, libm suffix)


def simd_declarations(functions: tuple[tuple[str, int], ...], code: str) -> str:
    """Declaring libm functions `simd` lets gcc call glibc's vector versions (libmvec) in
    vectorized loops: about 10x on transcendental-heavy loops, accurate to a few ulp. Only the
    functions `code` calls are declared."""
    lines = []
    called = called_functions(code)
    for name, arity in functions:
        for ctype, suffix in LIBM_TYPES:
            if f"{name}{suffix}" in called:
                params = ", ".join([ctype] * arity)
                lines.append(f'__attribute__((simd("notinbranch"))) {ctype} {name}{suffix}({params}) noexcept;')
    return extern_c_block(lines)


def calls(code: str, function: str) -> bool:
    """Whether `code` calls the C function `function`, by name or as a gcc builtin (which binds to
    the same declaration)."""
    return function in called_functions(code)


_CALLED_NAME = re.compile(r"(?<![\w.:])([A-Za-z_]\w*)\(")  # a name called, not a member's or a namespace's
_CALLED_BUILTIN = re.compile(r"__builtin_(\w+)\(")


def called_functions(code: str) -> frozenset[str]:
    """Every C function `code` calls, by name or as a gcc builtin (`__builtin_expf(` calls expf):
    one scan of the source, where asking per function scanned it once per libm function."""
    return frozenset(_CALLED_NAME.findall(code)) | frozenset(_CALLED_BUILTIN.findall(code))


def extern_c_block(lines: list[str]) -> str:
    return 'extern "C" {\n' + "\n".join(lines) + "\n}\n" if lines else ""


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


def loop_pragma(program: list[UOp], start: int, outermost: bool, parallel_threshold: int,
                choices: KernelChoices = DEFAULT_CHOICES, region: str | None = None) -> str | None:  # fmt: skip
    """OpenMP for the loop opened at program[start]: `parallel for` on a large outermost
    loop, `simd` on an innermost one, with a reduction clause for each accumulator updated
    inside and declared outside (but none on the lane loop of a lane accumulator, whose
    iterations update distinct elements: Note: lane accumulators, codegen/lanes.py). In a
    horizontal kernel's parallel region the large loop is `for` instead, work-shared by the
    region's threads, with the clause `region` ("nowait": they go on to the next part without
    waiting; renderer/cpp_horizontal.py)."""
    loop = program[start]
    innermost, updated, declared_inside, depth, scatters = True, [], set(), 0, False
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
        elif u.op is Ops.ACC_RUNNING and u.src[0] not in declared_inside:
            return None  # a scan loop: each step reads the last one's accumulator (Note: scans)
        elif u.op is Ops.STORE and isinstance(u.arg, ScatterArg):
            scatters = True  # iterations may hit one element: threads (atomic stores), never SIMD lanes
    splittable = outermost and trip_count(loop, choices.tile) > 1
    work = _work(program, loop, choices.tile) if splittable else 0
    parallel = runs_parallel(choices, splittable, work, parallel_threshold, carries=bool(updated))
    simd = innermost and not scatters
    if not parallel and not simd:
        return None
    words = (["for" if region is not None else "parallel for"] if parallel else []) + (["simd"] if simd else [])
    clauses = [f"reduction({_clause_op(acc)}:{_acc_section(acc)})" for acc in updated]
    if parallel and region is not None:
        clauses += [region] if region else []
    elif parallel:
        clauses = parallel_clauses(choices, program, start, carries=bool(updated)) + clauses
        if (symbolic := _symbolic_work(program, loop, choices.tile)) is not None:  # decided at run time
            clauses.append(f"if({symbolic} >= {parallel_threshold})")
    return "#pragma omp " + " ".join(words + clauses)


def _acc_section(acc: UOp) -> str:
    """An accumulator in a reduction clause: a scalar, or the whole array of a lane accumulator."""
    return f"acc{acc.arg.id}[:{acc.arg.lanes}]" if acc.arg.lanes > 1 else f"acc{acc.arg.id}"


def _clause_op(acc: UOp) -> str:
    combine = acc.arg.combine
    if combine in (Ops.ADD, Ops.MUL):
        return "+" if combine is Ops.ADD else "*"
    return _reduction_name(combine.name, acc.dtype.ctype)


def render_body(program: list[UOp], parallel_threshold: int, errors: list[CheckArg],
                choices: KernelChoices = DEFAULT_CHOICES, region: str | None = None,
                rename: dict[str, str] | None = None, depth: int = 1,
                deferred: list[str] | None = None) -> str:  # fmt: skip
    """`region`, `rename`, `depth` and `deferred`: a part of a horizontal kernel inside its parallel
    region (`loop_pragma`), its parameters renamed to the kernel's, the stores outside its loops
    put in `deferred` rather than in place (renderer/cpp_horizontal.py)."""
    names: dict[UOp, str] = {}
    outermost = depth
    lines: list[str] = []
    counter = 0

    def ref(u: UOp) -> str:
        if u.op is Ops.CONST:
            return render_const(u.arg, u.dtype)
        if u.op in (Ops.RANGE, Ops.DEFINE_VAR):
            return u.arg.name
        return names[u]

    for i, u in enumerate(program):
        pad = "  " * depth
        if u.op is Ops.RANGE:
            before, header = loop_lines(u, choices.tile)
            lines.extend(pad + line for line in before)
            pragma = loop_pragma(program, i, depth == outermost, parallel_threshold, choices, region)
            if pragma is not None:
                lines.append(f"{pad}{pragma}")
            lines.append(pad + header)
            depth += 1
        elif u.op is Ops.ENDRANGE:
            depth -= 1
            lines.append(f"{'  ' * depth}}}")
        elif u.op is Ops.INDEX:
            buffer = u.src[0].arg.name
            names[u] = f"{rename.get(buffer, buffer) if rename else buffer}[{ref(u.src[1])}]"
        elif u.op is Ops.LOAD:
            names[u] = ref(u.src[0])
        elif u.op is Ops.STORE and isinstance(u.arg, ScatterArg):
            lines.append(f"{pad}{_scatter_store(u.arg, u.src[1].dtype, ref(u.src[0]), ref(u.src[1]))};")
        elif u.op is Ops.STORE:
            stores = deferred if deferred is not None and depth == outermost else lines
            stores.append(f"{pad}{ref(u.src[0])} = {ref(u.src[1])};")
        elif u.op is Ops.DEFINE_ACC:
            names[u] = f"acc{u.arg.id}"
            lines.extend(_declare_acc(u, pad))
        elif u.op is Ops.ACC_UPDATE:
            acc = names[u.src[0]] + (f"[{ref(u.src[-1])}]" if u.src[0].arg.lanes > 1 else "")
            combined = _combine(u.src[0].arg.combine, u.dtype, acc, ref(u.src[1]))
            lines.append(f"{pad}{acc} = {combined};")
        elif u.op is Ops.ACC_READ:
            names[u] = names[u.src[0]] + (f"[{ref(u.src[2])}]" if u.src[0].arg.lanes > 1 else "")
        elif u.op is Ops.ACC_RUNNING:
            names[u] = names[u.src[0]]
        elif u.op is Ops.CHECK:
            names[u] = ref(u.src[0])
            code = errors.index(u.arg) + 1
            reported = f"ember_error[{code}] = (int64_t)({ref(u.src[2])}); ember_error[0] = {code};"
            lines.append(f"{pad}if (!{ref(u.src[1])}) {{ {reported} }}")
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
    if u.op is Ops.PHILOX:
        return f"ember_philox<{u.arg}>({srcs[0]}, (uint64_t){srcs[1]} + (uint64_t){srcs[2]})"
    if u.op is Ops.WHERE:
        return f"({srcs[0]} ? {srcs[1]} : {srcs[2]})"
    if u.op is Ops.MULACC:
        return _multiply_add(u.dtype, *srcs)
    if len(srcs) == 2:
        return _binary_call(u, *srcs)
    return _unary_call(u, srcs[0])


# A float max/min as one select, ember_max/ember_min(a, b) exactly (a NaN accumulator stays, a NaN
# value wins, ties keep b): gcc vectorizes it next to other accumulators where it does not
# vectorize the helper's nested selects.
def _extreme(compare: str, name: str, ctype: str, a: str, b: str) -> str:
    if ctype in ("float", "double"):
        return f"(({a} {compare} {b} || {a} != {a}) ? {a} : {b})"
    return f"ember_{name}<{ctype}>({a}, {b})"


_COMBINE: dict[Ops, Callable[[str, str, str], str]] = {
    Ops.ADD: lambda t, a, b: f"{a} + {b}",
    Ops.MUL: lambda t, a, b: f"{a} * {b}",
    Ops.MAX: lambda t, a, b: _extreme(">", "max", t, a, b),
    Ops.MIN: lambda t, a, b: _extreme("<", "min", t, a, b),
    Ops.LOGADDEXP: lambda t, a, b: f"ember_logaddexp<{t}>({a}, {b})",
}


def _scatter_store(arg: ScatterArg, dtype: DType, target: str, value: str) -> str:
    """An atomic store, or an atomic read-combine-write, of `value` into `target`. Integer
    sums use fetch_add (which wraps, as eager does); the rest a compare-and-swap loop. A store
    that no other thread can reach (not `atomic`) is a plain one."""
    combine = arg.combine
    if not arg.atomic:
        return f"{target} = {_combine_expression(combine, dtype, target, value) if combine else value}"
    if combine is None:
        return f"ember_store<{dtype.ctype}>(&{target}, {value})"
    if combine is Ops.ADD and dtype.kind in ("int", "uint"):
        return f"__atomic_fetch_add(&{target}, {value}, __ATOMIC_RELAXED)"
    t, expression = dtype.ctype, _combine_expression(combine, dtype, "a", "b")
    return f"ember_update<{t}>(&{target}, {value}, []({t} a, {t} b) -> {t} {{ return {expression}; }})"


def _combine_expression(combine: Ops, dtype: DType, a: str, b: str) -> str:
    """combine(a, b) with eager's semantics: bools as logic, integer sums and products wrap."""
    if dtype.is_bool and combine in (Ops.ADD, Ops.MAX, Ops.MUL, Ops.MIN):
        return f"({a} || {b})" if combine in (Ops.ADD, Ops.MAX) else f"({a} && {b})"
    if combine in (Ops.ADD, Ops.MUL) and (unsigned := _wraps(dtype)) is not None:
        return f"({dtype.ctype})(({unsigned}){a} {INFIX[combine]} ({unsigned}){b})"
    return _combine(combine, dtype, a, b)


def _combine(op: Ops, dtype: DType, acc: str, value: str) -> str:
    return _COMBINE[op](dtype.ctype, acc, value)


def _symbolic_work(program: list[UOp], outer: UOp, tile: int = 0) -> str | None:
    """C for the iterations of the loop nest under `outer` when a loop of it has a symbolic size
    (Note: symbolic sizes), whose `_work` counts it at its upper bound; None when all are static."""
    nest, depth, inside = [], 0, False
    for u in program:
        if u is outer:
            inside = True
        if not inside:
            continue
        if u.op is Ops.RANGE:
            depth += 1
            nest.append(u)
        elif u.op is Ops.ENDRANGE:
            depth -= 1
            if depth == 0:
                break
    if all(r.src[0].op is Ops.CONST for r in nest):
        return None
    return "(" + " * ".join(_trip_count_expression(r, tile) for r in nest) + ")"


def _trip_count_expression(r: UOp, tile: int) -> str:
    """C for `trip_count(r, tile)` where r's size may be symbolic."""
    if r.src[0].op is Ops.CONST or is_element_loop(r):  # an element loop: a full tile's
        return str(trip_count(r, tile))
    if is_tile_loop(r):
        step = tile or r.arg.tile
        return f"(({size_expression(r.src[0])} + {step - 1}) / {step})"
    return size_expression(r.src[0])


def _work(program: list[UOp], outer: UOp, tile: int = 0) -> int:
    """Iterations of the loop nest under `outer`: the product of the ranges opened in it
    (`tile`: KernelChoices.tile, the tile size of a 2-D tiling's loops)."""
    total, depth, inside = 1, 0, False
    for u in program:
        if u is outer:
            inside, depth = True, 0
        if not inside:
            continue
        if u.op is Ops.RANGE:
            depth += 1
            total = max(total, 1) * trip_count(u, tile) if depth > 0 else total
        elif u.op is Ops.ENDRANGE:
            depth -= 1
            if depth == 0:
                break
    return total
