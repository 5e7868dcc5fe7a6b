"""Stage `codegen`, late phase: ops whose semantics a target language lacks, rewritten once into
primitive ops every renderer spells as its plain operator or conversion.

Note: semantics written once
    Eager's meaning of a cast, an integer division or a shift is not C's nor Triton's, and it
    used to be spelled in each renderer (a C++ helper, a Triton expression). Here it is written
    once as UOps; after this step:
      - IDIV and MOD on integer data never see a divisor of 0 or -1: a zero divisor gives 0 (the
        CHECK of codegen/phases.check_integer_division reports it), -1 gives the wrapped negation
        (IDIV) or 0 (MOD), and the division itself runs on a divisor made safe, so C's `/` and
        Triton's `//` (both truncating) are exact and never trap (INT_MIN / -1).
      - SHL and SHR never see an amount outside [0, bits): past the width a left shift gives 0 and
        a right shift the sign (0 or -1), as eager; the plain shift runs on a clamped amount.
      - ADD and MUL of bools are OR and AND (Triton's i1 arithmetic wraps; torch's is logic), and
        SIGNBIT is a comparison of the float's bits read as a signed integer.
      - CAST is only a conversion both languages do as eager does: to bool it is `x != 0`, from
        bool to a float a select (gcc 12 vectorizes that, not the conversion), and float16/
        bfloat16 convert only to and from float32 (eager converts a double or an integer to float
        first, then rounds that). bfloat16 converts through its bits (round to nearest even, NaN
        -> 0x7FC0 as eager): the Triton interpreter keeps bfloat16 as uint16 and its own
        conversion truncates, so the bit formulas are what runs the same everywhere, except on a
        GPU (`native_bfloat16`): there Triton's own conversion is one instruction rounding to
        nearest even (cvt.rn), against about ten integer ops per value for the formulas, which
        the bfloat16 kernels of a training step paid on every element; only a NaN's bits
        differ (0x7FFF, still a NaN). An integer's conversion keeps the formulas
        (`integer_to_bfloat16`). float16 keeps CAST to and from float32, which Triton
        converts natively and the C++ renderer with its exact helpers (renderer/cpp.py
        LOW_PRECISION_PRELUDE).
    Guards are only added where the operands' bounds (vmin/vmax) allow the bad case: `x // 4` and
    index math stay one op.
"""

from __future__ import annotations

from collections.abc import Callable

from ember.uop.dtypes import LOW_PRECISION, DType, dtypes
from ember.uop.ops import Ops, UOp
from ember.uop.pattern import PatternMatcher, UPat, graph_rewrite, rewrite_each_once

F32 = dtypes.float32


def primitive_ops(sink: UOp, native_bfloat16: bool = False) -> UOp:
    """The late step (Note: semantics written once): casts and bool arithmetic first, as the bfloat16
    formulas shift. `native_bfloat16`: float32 <-> bfloat16 stay CASTs (a GPU's conversion)."""
    return guard_integer_ops(graph_rewrite(sink, pm_primitives_native_bf16 if native_bfloat16 else pm_primitives))


# ---- casts -----------------------------------------------------------------------------------


def through_float32(x: UOp, u: UOp) -> UOp | None:
    """A conversion to or from float16/bfloat16 that is not from or to float32 goes through it."""
    low_in, low_out = x.dtype in LOW_PRECISION, u.dtype in LOW_PRECISION
    if not (low_in or low_out) or F32 in (x.dtype, u.dtype) or x.dtype is u.dtype:
        return None
    return x.cast(F32).cast(u.dtype)


def fold_constant(c: UOp, u: UOp) -> UOp | None:
    """A constant converted exactly, or rounded once (float32 to 16 bits, as `normalize_const`)."""
    if u.dtype.is_bool:
        return UOp.const(u.dtype, bool(c.arg))
    exact_source = c.dtype.is_bool or c.dtype is F32 or c.dtype in LOW_PRECISION
    return UOp.const(u.dtype, float(c.arg)) if u.dtype.is_float and exact_source else None


def bfloat16_to_float32(x: UOp) -> UOp:
    """The bfloat16's bits are the top half of the float32's."""
    bits = UOp(Ops.BITCAST, dtypes.uint16, (x,)).cast(dtypes.uint32)
    return UOp(Ops.BITCAST, F32, (bits.alu(Ops.SHL, bits.const_like(16)),))


def float32_to_bfloat16(x: UOp) -> UOp:
    """The top half of the float32, rounded to nearest even on the dropped bits; NaN -> 0x7FC0."""
    u = UOp(Ops.BITCAST, dtypes.uint32, (x,))
    tie = u.alu(Ops.SHR, u.const_like(16)).alu(Ops.AND, u.const_like(1))
    rounded = ((u + 0x7FFF) + tie).alu(Ops.SHR, u.const_like(16))
    nan = u.const_like(0x7F800000).alu(Ops.CMPLT, u.alu(Ops.AND, u.const_like(0x7FFFFFFF)))
    bits = nan.where(u.const_like(0x7FC0), rounded).cast(dtypes.uint16)
    return UOp(Ops.BITCAST, dtypes.bfloat16, (bits,))


def integer_to_bfloat16(x: UOp) -> UOp | None:
    """With native conversions: an integer rounded to float32 and then to bfloat16 still goes
    through the bits. Compiled for a GPU, the two conversions become one (measured on an H100),
    which rounds once where eager rounds twice (2^24 + 2^16 + 1 gave 2^24 + 2^17, not 2^24)."""
    return float32_to_bfloat16(x) if x.op is Ops.CAST and not x.src[0].dtype.is_float else None


def to_bool(x: UOp) -> UOp | None:
    return None if x.dtype.is_bool else x.alu(Ops.CMPNE, x.const_like(0))


def bool_to_float(x: UOp, u: UOp) -> UOp | None:
    if not x.dtype.is_bool or u.dtype not in (F32, dtypes.float64):
        return None
    return x.where(u.const_like(1.0), u.const_like(0.0))


def sign_bit(x: UOp) -> UOp:
    """The float's top bit: its bits read as a signed integer of its width are negative."""
    bits = dtypes.int64 if x.dtype.itemsize == 8 else dtypes.int32
    as_int = UOp(Ops.BITCAST, bits, (x,))
    return as_int.alu(Ops.CMPLT, as_int.const_like(0))


def bool_logic(u: UOp) -> UOp:
    return u.src[0].alu(Ops.OR if u.op is Ops.ADD else Ops.AND, u.src[1])


_FOLD_AND_WIDEN: list[tuple[UPat, Callable[..., UOp | None]]] = [
    # CAST(CONST c, T) -> CONST T c, for the conversions below (a constant rounds when made)
    (UPat(Ops.CAST, src=(UPat.cvar("c"),), name="u"), fold_constant),
    # CAST(x: T, bf16) -> CAST(CAST(x, f32), bf16), and from bf16 likewise
    (UPat(Ops.CAST, src=(UPat.var("x"),), name="u"), through_float32),
]
_BFLOAT16_THROUGH_BITS: list[tuple[UPat, Callable[..., UOp | None]]] = [
    # CAST(x bf16, f32) -> BITCAST(SHL(bits of x, 16), f32)
    (UPat(Ops.CAST, dtype=F32, src=(UPat.var("x", dtype=dtypes.bfloat16),)), bfloat16_to_float32),
    # CAST(x f32, bf16) -> BITCAST(rounded top half of x's bits, bf16)
    (UPat(Ops.CAST, dtype=dtypes.bfloat16, src=(UPat.var("x", dtype=F32),)), float32_to_bfloat16),
]
_BITS_AND_BOOLS: list[tuple[UPat, Callable[..., UOp | None]]] = [
    # BITCAST(BITCAST(x)) of x's own type -> x
    (
        UPat(Ops.BITCAST, src=(UPat(Ops.BITCAST, src=(UPat.var("x"),)),), name="u"),
        lambda x, u: x if x.dtype is u.dtype else None,
    ),
    # CAST(x, bool) -> x != 0
    (UPat(Ops.CAST, dtype=dtypes.bool, src=(UPat.var("x"),)), to_bool),
    # CAST(b bool, float) -> WHERE(b, 1.0, 0.0)
    (UPat(Ops.CAST, src=(UPat.var("x", dtype=dtypes.bool),), name="u"), bool_to_float),
    # SIGNBIT(x) -> BITCAST(x, int of its width) < 0 (true for -0.0 and negative NaNs)
    (UPat(Ops.SIGNBIT, src=(UPat.var("x"),)), sign_bit),
    # a + b, a * b of bools -> a | b, a & b (torch's bool arithmetic is logic; Triton's i1 wraps)
    (UPat((Ops.ADD, Ops.MUL), dtype=dtypes.bool, name="u"), bool_logic),
]
pm_primitives = PatternMatcher(_FOLD_AND_WIDEN + _BFLOAT16_THROUGH_BITS + _BITS_AND_BOOLS)
# a GPU converts float32 <-> bfloat16 itself (`native_bfloat16`)
_INTEGERS_TO_BFLOAT16: list[tuple[UPat, Callable[..., UOp | None]]] = [
    # CAST(CAST(i int, f32), bf16) -> BITCAST(rounded top half of the float32's bits, bf16)
    (UPat(Ops.CAST, dtype=dtypes.bfloat16, src=(UPat.var("x", dtype=F32),)), integer_to_bfloat16),
]
pm_primitives_native_bf16 = PatternMatcher(_FOLD_AND_WIDEN + _INTEGERS_TO_BFLOAT16 + _BITS_AND_BOOLS)


# ---- integer division and shifts ------------------------------------------------------------------


def guard_integer_ops(sink: UOp) -> UOp:
    """Every integer IDIV/MOD/SHL/SHR whose operands may hit a case the languages leave undefined
    (or define otherwise than eager) -> its guarded form, once each (a guarded op keeps its
    op: a rule table would guard it again)."""
    return rewrite_each_once(sink, lambda u: GUARDS[u.op](u) if u.op in GUARDS and _is_data_int(u.dtype) else u)


def _is_data_int(dtype: DType) -> bool:
    return dtype.is_int and dtype is not dtypes.index


def _may_be(x: UOp, value: int) -> bool:
    return x.vmin <= value <= x.vmax


def guard_division(u: UOp) -> UOp:
    """a // b: 0 for b == 0, the wrapped -a for b == -1; a % b: 0 for both (Note: semantics
    written once). Unsigned divisors are never -1."""
    a, b = u.src
    signed = b.dtype.kind == "int"
    if not (_may_be(b, 0) or (signed and _may_be(b, -1))):
        return u
    zero = b.alu(Ops.CMPEQ, b.const_like(0))
    minus_one = b.alu(Ops.CMPEQ, b.const_like(-1)) if signed else None
    bad = zero if minus_one is None else zero.alu(Ops.OR, minus_one)
    divided = a.alu(u.op, bad.where(b.const_like(1), b))
    if u.op is Ops.MOD or minus_one is None:
        return bad.where(u.const_like(0), divided)
    return zero.where(u.const_like(0), minus_one.where(a.alu(Ops.NEG), divided))


def guard_shift(u: UOp) -> UOp:
    """a << b and a >> b for b outside [0, bits): 0, and for >> the sign of a."""
    a, b = u.src
    bits = 8 * a.dtype.itemsize
    if b.vmin >= 0 and b.vmax < bits:
        return u
    outside = b.alu(Ops.CMPLT, b.const_like(0)).alu(Ops.OR, b.const_like(bits - 1).alu(Ops.CMPLT, b))
    shifted = a.alu(u.op, outside.where(b.const_like(0), b))
    past = a.const_like(0)
    if u.op is Ops.SHR and a.dtype.kind == "int":
        past = a.alu(Ops.CMPLT, a.const_like(0)).where(a.const_like(-1), past)
    return outside.where(past, shifted)


GUARDS = {Ops.IDIV: guard_division, Ops.MOD: guard_division, Ops.SHL: guard_shift, Ops.SHR: guard_shift}
