"""Stage `renderer` (GPU): the special math functions of lower/math_functions.py in Triton.

Note: special functions in Triton
    The C++ renderer runs ATen's own CPU code (Note: special functions, renderer/cpp.py).
    Triton kernels call libdevice (CUDA's math library, the functions CUDA's own ATen kernels
    call too: erfinv, lgamma, erfcx, the Bessel functions, normcdfinv) where it has the
    function, and otherwise the jit helpers below, which transcribe ATen's code (digamma,
    trigamma) with its branches as selects and its data-dependent loops as a fixed number
    of masked steps. Under the interpreter, libdevice is runtime/triton_libdevice.py (numpy
    and torch's CPU functions), so the interpreter tests check the rendering and the
    helpers' arithmetic; libdevice's own accuracy is checked on the GPU.
"""

from __future__ import annotations

from ember.uop.dtypes import DType
from ember.uop.ops import Ops, UOp

LIBDEVICE_CALLS = {
    Ops.ACOSH: "acosh", Ops.ASINH: "asinh", Ops.ATANH: "atanh", Ops.ERFC: "erfc", Ops.LGAMMA: "lgamma",
    Ops.ERFINV: "erfinv", Ops.ERFCX: "erfcx", Ops.NDTRI: "normcdfinv",
    Ops.COPYSIGN: "copysign", Ops.NEXTAFTER: "nextafter", Ops.HYPOT: "hypot",
}  # fmt: skip

HELPER_CALLS = {Ops.DIGAMMA: "ember_digamma", Ops.TRIGAMMA: "ember_trigamma"}

# Ops with no Triton rendering yet: the backend declares them (compile_triton.TritonBackend), and
# lowering sends each call that would need one to aten alone (a fallback extern, lower/graph.py)
# rather than the whole graph running eagerly. libdevice's Bessel functions (j0/j1/y0/y1,
# cyl_bessel_i0/i1) miss ATen's values on an H100: NaN where eager is finite at special values,
# and float64 errors of ~3e-7 relative.
UNRENDERABLE = frozenset({
    Ops.BESSEL_J0, Ops.BESSEL_J1, Ops.BESSEL_Y0, Ops.BESSEL_Y1, Ops.I0, Ops.I1, Ops.MODIFIED_BESSEL_I0,
    Ops.MODIFIED_BESSEL_I1,
    Ops.I0E, Ops.I1E, Ops.AIRY_AI, Ops.MODIFIED_BESSEL_K0, Ops.MODIFIED_BESSEL_K1, Ops.SCALED_MODIFIED_BESSEL_K0,
    Ops.SCALED_MODIFIED_BESSEL_K1, Ops.SPHERICAL_BESSEL_J0, Ops.ZETA, Ops.POLYGAMMA, Ops.IGAMMA, Ops.IGAMMAC,
    Ops.FREXP_MANTISSA, Ops.FREXP_EXPONENT, Ops.CHEBYSHEV_T, Ops.CHEBYSHEV_U, Ops.CHEBYSHEV_V, Ops.CHEBYSHEV_W,
    Ops.SHIFTED_CHEBYSHEV_T, Ops.SHIFTED_CHEBYSHEV_U, Ops.SHIFTED_CHEBYSHEV_V, Ops.SHIFTED_CHEBYSHEV_W,
    Ops.HERMITE_H, Ops.HERMITE_HE, Ops.LAGUERRE_L, Ops.LEGENDRE_P,
})  # fmt: skip

HELPERS = """

@triton.jit
def ember_divide(a, b):
    # IEEE division: Triton's float32 `/` is approximate, and div_rn is float32 only
    if a.dtype == tl.float32:
        return tl.div_rn(a, b)
    else:
        return a / b

@triton.jit
def ember_digamma(x):
    # ATen's calc_digamma (Cephes): reflection below 0, recurrence up to 10, asymptotic series
    pi: tl.constexpr = 3.141592653589793
    zero = tl.zeros_like(x)
    one = zero + 1
    negative = x < 0
    fraction = x - libdevice.trunc(x)
    reflection = (pi / libdevice.tan(pi * fraction.to(tl.float64))).to(x.dtype)  # in double, as ATen
    y = tl.where(negative, 1 - x, x)
    result = zero
    for _ in tl.static_range(10):  # y >= 0 reaches 10 in at most 10 steps
        below = y < 10
        result = tl.where(below, result - ember_divide(one, y), result)
        y = tl.where(below, y + 1, y)
    z = ember_divide(one, y * y)
    polevl = z * 8.33333333333333333333e-2 + -2.10927960927960927961e-2
    polevl = polevl * z + 7.57575757575757575758e-3
    polevl = polevl * z + -4.16666666666666666667e-3
    polevl = polevl * z + 3.96825396825396825397e-3
    polevl = polevl * z + -8.33333333333333333333e-3
    polevl = polevl * z + 8.33333333333333333333e-2
    series = tl.where(y < 1.0e17, z * polevl, zero)
    asymptotic = result + libdevice.log(y) - ember_divide(zero + 0.5, y) - series
    positive = tl.where(y == 10, result + 2.25175258906672110764, asymptotic)
    value = tl.where(negative, positive - reflection, positive)
    value = tl.where(negative & (x == libdevice.trunc(x)), float("nan"), value)
    return tl.where(x == 0, zero - ember_divide(one, x), value)  # -copysign(inf, x) at +-0


@triton.jit
def ember_trigamma(x):
    # ATen's trigamma: reflection below 1/2, six recurrence steps, asymptotic series
    zero = tl.zeros_like(x)
    one = zero + 1
    pi = zero + 3.141592653589793
    reflected = x < 0.5
    sin_pi_x = libdevice.sin(pi * x)
    result = tl.where(reflected, zero - ember_divide(pi * pi, sin_pi_x * sin_pi_x), zero)
    y = tl.where(reflected, 1 - x, x)
    for _ in tl.static_range(6):
        result += ember_divide(one, y * y)
        y += 1
    ixx = ember_divide(one, y * y)
    tail = 1 + ember_divide(one, 2 * y) + ixx * (1.0 / 6 - ixx * (1.0 / 30 - ixx * (1.0 / 42)))
    result += ember_divide(tail, y)
    return tl.where(reflected, zero - result, result)
"""


def render_math(u: UOp, srcs: list[str]) -> str | None:
    """The call for a special function, or None when `u` is not one."""
    if u.op in LIBDEVICE_CALLS:
        return f"libdevice.{LIBDEVICE_CALLS[u.op]}({', '.join(srcs)})"
    if u.op in HELPER_CALLS:
        return f"{HELPER_CALLS[u.op]}({', '.join(srcs)})"
    if u.op in (Ops.FMAX, Ops.FMIN):  # C's fmax: a NaN loses to a number
        a, b = srcs
        fn = "tl.maximum" if u.op is Ops.FMAX else "tl.minimum"
        return f"tl.where({a} != {a}, {b}, tl.where({b} != {b}, {a}, {fn}({a}, {b})))"
    if u.op is Ops.SIGNBIT:
        return f"({srcs[0]}.to({_same_width_int(u.src[0].dtype)}, bitcast=True) < 0)"
    return None


def _same_width_int(dtype: DType) -> str:
    return "tl.int64" if dtype.itemsize == 8 else "tl.int32"


def uses_helpers(sink: UOp) -> bool:
    return any(u.op in HELPER_CALLS for u in sink.toposort)
