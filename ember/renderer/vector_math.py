"""Vectorizable float32 approximations that beat glibc's libmvec in ember's `omp simd` loops.

Note: vector math
    libmvec's erff is a call per vector with a slow path per lane; eager's erf is an inlined
    polynomial about 2.4x faster. `ember_erff` is branch-free float code (both arms computed,
    then selected) that gcc inlines and vectorizes with the loop. The coefficients are least-
    squares fits in float64 (Chebyshev nodes) rounded to float. Error over all 2^32 float32
    inputs against float64 erf, measured by benchmarks/vector_math.py: at most 1 ulp (bound
    asserted by tests/test_vector_math.py). NaN stays NaN, erf(+-inf) = +-1, erf(-0) = -0,
    denormals give 2x/sqrt(pi) rounded (no flush to zero). Explicit fmaf: ember compiles with
    -ffp-contract=off.
"""

from __future__ import annotations

from ember.uop.ops import Ops
from ember.uop.dtypes import dtypes

# erf: |x| <= 0.9277 -> x + x * p(x^2); beyond, 1 - exp(q(|x|)) with q ~ log(erfc) fitted on
# [0.9277, 4] (|x| is capped at 4, where erf rounds to 1). exp of q in [-17.6, -1.7]:
# q = n ln2 + f (Cody-Waite), exp(f) by its degree-7 Taylor polynomial, 2^n added to the bits.
ERF_SOURCE = r"""static inline float ember_expf_erf_arm(float q) {
  float n = __builtin_rintf(q * 1.44269504f);
  float f = __builtin_fmaf(n, -0x1.62e400p-1f, q);
  f = __builtin_fmaf(n, -0x1.7f7d1cp-20f, f);
  float p = 1.0f / 5040.0f;
  p = __builtin_fmaf(p, f, 1.0f / 720.0f);
  p = __builtin_fmaf(p, f, 1.0f / 120.0f);
  p = __builtin_fmaf(p, f, 1.0f / 24.0f);
  p = __builtin_fmaf(p, f, 1.0f / 6.0f);
  p = __builtin_fmaf(p, f, 0.5f);
  p = __builtin_fmaf(p, f, 1.0f);
  p = __builtin_fmaf(p, f, 1.0f);
  int32_t scale = (int32_t)n << 23;
  return __builtin_bit_cast(float, __builtin_bit_cast(int32_t, p) + scale);
}
static inline float ember_erff(float x) {
  float a = __builtin_fabsf(x), s = x * x;
  float small = -0x1.39a77cp-11f;
  small = __builtin_fmaf(small, s, 0x1.47272cp-8f);
  small = __builtin_fmaf(small, s, -0x1.b6894ep-6f);
  small = __builtin_fmaf(small, s, 0x1.ce1a68p-4f);
  small = __builtin_fmaf(small, s, -0x1.8126e6p-2f);
  small = __builtin_fmaf(small, s, 0x1.06eba6p-3f);
  small = __builtin_fmaf(small, x, x);
  float t = a > 4.0f ? 4.0f : a;
  float q = -0x1.6784acp-16f;
  q = __builtin_fmaf(q, t, 0x1.cb833cp-12f);
  q = __builtin_fmaf(q, t, -0x1.128504p-8f);
  q = __builtin_fmaf(q, t, 0x1.9c4df0p-6f);
  q = __builtin_fmaf(q, t, -0x1.bbcc16p-4f);
  q = __builtin_fmaf(q, t, -0x1.443e0cp-1f);
  q = __builtin_fmaf(q, t, -0x1.2129d2p+0f);
  q = __builtin_fmaf(q, t, 0x1.7ae6cap-13f);
  float big = __builtin_copysignf(1.0f - ember_expf_erf_arm(q), x);
  return a > 0.9277f ? big : small;
}
"""


def vector_math_call(op: Ops, dtype) -> str | None:
    """The inline function for `op` at `dtype` when this module has one (Note: vector math)."""
    return "ember_erff" if op is Ops.ERF and dtype is dtypes.float32 else None


def vector_math_prelude(program) -> str:
    """The definitions the kernel's vector-math calls need."""
    uses = any(vector_math_call(u.op, u.src[0].dtype) for u in program if u.op is Ops.ERF)
    return ERF_SOURCE if uses else ""
