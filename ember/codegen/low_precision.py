"""Stage `codegen`, phase early: float16 and bfloat16 arithmetic runs in float32.

Note: low-precision floats (see also uop/dtypes.py)
    A float16/bfloat16 value in a kernel is only loaded, stored, selected (WHERE), cast or a
    constant. Every other ALU op and every REDUCE on one is rewritten here to compute in
    float32 and round its result back. For one op that is exact: float32 carries more than
    twice the low-precision significand plus two bits (24 >= 2*11+2), so +, -, *, /, sqrt
    rounded to float32 and then to float16/bfloat16 equal the correctly rounded result, and
    max/min/comparisons are exact in any wider type. Reductions accumulate in float32 (or
    the wider accumulator the lowering chose) and round once at the end, as eager does.

    Lowerings keep eager's own rounding points: an aten op whose result is float16/bfloat16
    casts its float32 result to that type, and its consumer casts it back to compute, so a
    fused chain of ops rounds after each op exactly where eager does (inductor's
    `emulate_precision_casts`). Nothing folds CAST(CAST(x, bfloat16), float32): it is a
    rounding, not a no-op.
"""

from __future__ import annotations

from ember.uop.dtypes import LOW_PRECISION, dtypes, is_low_precision
from ember.uop.ops import ALU_OPS, Ops, UOp
from ember.uop.pattern import PatternMatcher, UPat

COMPUTE = dtypes.float32


def compute_in_float32(u: UOp) -> UOp | None:
    """An ALU op on float16/bfloat16 -> the same op on float32 operands, rounded back."""
    if not (is_low_precision(u.dtype) or any(is_low_precision(s.dtype) for s in u.src)):
        return None
    src = tuple(s.cast(COMPUTE) if is_low_precision(s.dtype) else s for s in u.src)
    result = UOp(u.op, COMPUTE if is_low_precision(u.dtype) else u.dtype, src, u.arg)
    return result.cast(u.dtype)


def reduce_in_float32(red: UOp) -> UOp:
    value = red.src[0].cast(COMPUTE)
    return UOp(Ops.REDUCE, COMPUTE, (value, *red.src[1:]), red.arg).cast(red.dtype)


def widen_constant(c: UOp, u: UOp) -> UOp | None:
    """A low-precision constant holds its rounded value already (`normalize_const`)."""
    return UOp.const(u.dtype, c.arg) if u.dtype.is_float and not is_low_precision(u.dtype) else None


_ARITHMETIC = tuple(ALU_OPS - {Ops.CAST, Ops.WHERE})
_LOW = tuple(LOW_PRECISION)
_WIDE = (dtypes.float32, dtypes.float64)

pm_low_precision = PatternMatcher(
    [
        # op(bf16...) -> CAST(op(CAST(x, f32)...), bf16)
        (UPat(_ARITHMETIC, name="u"), compute_in_float32),
        # REDUCE(bf16) -> CAST(REDUCE(CAST(x, f32)), bf16)
        (UPat(Ops.REDUCE, dtype=_LOW, name="red"), reduce_in_float32),
        # CAST(CONST bf16 c, f32) -> CONST f32 c
        (UPat(Ops.CAST, src=(UPat.cvar("c", dtype=_LOW),), name="u"), widen_constant),
        # CAST(CAST(x bf16, f32), bf16) -> x: the widening is exact, so the round trip is too
        (
            UPat(Ops.CAST, src=(UPat(Ops.CAST, dtype=_WIDE, src=(UPat.var("x", dtype=_LOW),)),), name="u"),
            lambda x, u: x if u.dtype is x.dtype else None,
        ),  # fmt: skip
    ]
)
