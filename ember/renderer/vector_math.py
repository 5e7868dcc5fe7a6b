"""Vectorizable float32 approximations that beat glibc's libmvec in ember's `omp simd` loops.

Note: vector math
    glibc's libmvec erff is an out-of-line call per vector. `ember_erff` is branch-free float
    code (both arms computed, then selected) that gcc inlines and vectorizes with the loop:
    about 1.25x libmvec's speed in cache (benchmarks/vector_math.py). The coefficients are
    least-squares fits in float64 (Chebyshev nodes, weighted by the float32 ulp of the result)
    rounded to float. Error against float64 erf on every 97th float32 bit pattern (44M inputs,
    benchmarks/vector_math.py --stride 97): at most 1.255 ulp (at -0.92924, just past
    the switch between arms), MAX_ULP below (asserted on a sweep by
    tests/test_vector_math.py; eager's own vectorized erf is an Abramowitz-Stegun formula off
    by up to ~1e-7 absolute). NaN stays NaN, erf(+-inf) = +-1, erf(-0) = -0, denormals give
    2x/sqrt(pi) rounded (no flush to zero). fmaf is explicit: ember compiles with -ffp-contract=off.
"""

from __future__ import annotations

from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import Ops, UOp

MAX_ULP = {"erf": 1.3}  # the worst error measured (the full 2^32 sweep is `python -m benchmarks.vector_math`)

# erf: |x| <= 0.9277 -> x + x * p(x^2); beyond, 1 - 2^q(|x|) with q ~ log2(erfc), degree 7,
# fitted on [0.9277, 4] (|x| is capped at 4, where erf rounds to 1; a NaN passes the cap).
# 2^q for q in [-25.4, -2.4]: n = rint(q) (exact), 2^(q - n) by a degree-6 fit on
# [-0.5, 0.5] (relative error 1.6e-8), 2^n added to the exponent bits (never denormal).
ERF_SOURCE = r"""static inline float ember_erff(float x) {
  float a = __builtin_fabsf(x), s = x * x;
  float small = -0x1.39a77cp-11f;
  small = __builtin_fmaf(small, s, 0x1.47272cp-8f);
  small = __builtin_fmaf(small, s, -0x1.b6894ep-6f);
  small = __builtin_fmaf(small, s, 0x1.ce1a68p-4f);
  small = __builtin_fmaf(small, s, -0x1.8126e6p-2f);
  small = __builtin_fmaf(small, s, 0x1.06eba6p-3f);
  small = __builtin_fmaf(small, x, x);
  float t = a > 4.0f ? 4.0f : a;
  float q = -0x1.03566cp-15f;
  q = __builtin_fmaf(q, t, 0x1.4b77e2p-11f);
  q = __builtin_fmaf(q, t, -0x1.8c0c4ep-8f);
  q = __builtin_fmaf(q, t, 0x1.296a30p-5f);
  q = __builtin_fmaf(q, t, -0x1.4021ccp-3f);
  q = __builtin_fmaf(q, t, -0x1.d3c868p-1f);
  q = __builtin_fmaf(q, t, -0x1.a12cb0p+0f);
  q = __builtin_fmaf(q, t, 0x1.1151d6p-12f);
  float n = __builtin_rintf(q), f = q - n;
  float p = 0x1.41a6fep-13f;
  p = __builtin_fmaf(p, f, 0x1.5f44f0p-10f);
  p = __builtin_fmaf(p, f, 0x1.3b2dfep-7f);
  p = __builtin_fmaf(p, f, 0x1.c6aed6p-5f);
  p = __builtin_fmaf(p, f, 0x1.ebfbdap-3f);
  p = __builtin_fmaf(p, f, 0x1.62e430p-1f);
  p = __builtin_fmaf(p, f, 1.0f);
  float e = __builtin_bit_cast(float, __builtin_bit_cast(int32_t, p) + ((int32_t)n << 23));
  float big = __builtin_copysignf(1.0f - e, x);
  return a > 0.9277f ? big : small;
}
"""


def vector_math_call(op: Ops, dtype: DType) -> str | None:
    """The inline function for `op` at `dtype` when this module has one (Note: vector math)."""
    return "ember_erff" if op is Ops.ERF and dtype is dtypes.float32 else None


def vector_math_prelude(program: list[UOp]) -> str:
    """The definitions the kernel's vector-math calls need."""
    uses = any(vector_math_call(u.op, u.src[0].dtype) for u in program if u.op is Ops.ERF)
    return ERF_SOURCE if uses else ""
