"""Lowerings of random ops: rand, randn, randint, bernoulli, dropout, uniform and normal.

Note: counter-based random numbers
    A random element is a pure function of (seed, counter): the uint32 words of Philox4x32-10
    (Ops.PHILOX), the generator of Triton's tl.randint / tl.rand / tl.randn, with Triton's
    key and counter layout, so a C++ kernel and a Triton kernel give the same bits for the
    same seed. The seed is one int64 per call of a compiled graph, drawn from torch's default
    generator by the wrapper (wrapper/lines.py `DrawSeed`) into a one-element buffer the
    kernels read, so `torch.manual_seed` reproduces a run. An element's counter is its
    row-major position in its op's output plus the counters every earlier random op of the
    graph took: two ops never share one. Nothing depends on threads, loop splits or fusion;
    an element recomputed in two kernels is the same number. The counters earlier ops took
    (the op's offset) are not a constant of the kernel but a kernel argument, one more
    one-element int64 buffer per random op (kind "random_offset", its value in
    `LoweredGraph.random_offsets`, set by the wrapper), so the identical layers of a model,
    whose dropouts differ only in their offsets, share one kernel (Note: kernels generated
    once, compile_cpp.py). PHILOX adds the offset to the element's position in 64 bits.
    Uniform floats are tl.rand's exact integer-to-float conversion (bit for bit with
    Triton). Normals are tl.randn's Box-Muller, with log and cos built here from IEEE
    arithmetic rather than libm, whose scalar and vector versions round differently (values
    would then depend on how a loop is split); they agree with Triton's to a few ulp.
    `config.fallback_random` (EMBER_FALLBACK_RANDOM=1) sends random ops to aten instead:
    eager's generator and eager's values, unfused.
"""

from __future__ import annotations

import math
import struct

import torch
import torch.fx

from ember.ir import Buffer, Layout, contiguous_strides
from ember.lower.context import LoweringContext
from ember.lower.pointwise import out_meta
from ember.lower.registry import Unsupported, register
from ember.lower.values import TensorValue, axis, broadcast_to, const_index, load
from ember.uop.dtypes import DType, dtypes, from_torch
from ember.uop.ops import Ops, UOp

aten = torch.ops.aten

SEED_BUFFER = "ember_seed"
OFFSET_PREFIX = "ember_random_offset_"


def f32(value: float) -> float:
    """`value` rounded to float32, as Triton rounds a Python float constant in fp32 math."""
    return struct.unpack("f", struct.pack("f", value))[0]


# ---- random streams --------------------------------------------------------------------


def random_stream(ctx: LoweringContext, shape: tuple[int, ...]) -> tuple[UOp, UOp, UOp]:
    """(seed, offset, position) of each element of a new random op's output of `shape`: its
    counter is offset + position (Note: counter-based random numbers)."""
    if SEED_BUFFER not in ctx.buffers:
        ctx.add_buffer(Buffer(SEED_BUFFER, dtypes.int64, Layout((1,), (1,)), "seed"))
    seed = load(ctx.buffers[SEED_BUFFER]).body
    name = f"{OFFSET_PREFIX}{len(ctx.graph.random_offsets)}"
    ctx.graph.random_offsets[name] = ctx.random_counters
    offset = load(ctx.add_buffer(Buffer(name, dtypes.int64, Layout((1,), (1,)), "random_offset"))).body
    position = const_index(0)
    for i, (size, stride) in enumerate(zip(shape, contiguous_strides(shape))):
        if size != 1:
            position = position + axis(i) * stride
    ctx.random_counters += math.prod(shape)
    return seed, offset, position


def is_scalar_argument(buffer: str) -> bool:
    """The seed and the random ops' offsets: one-element int64 buffers a Triton kernel takes
    by value."""
    return buffer == SEED_BUFFER or buffer.startswith(OFFSET_PREFIX)


def philox(stream: tuple[UOp, UOp, UOp], word: int) -> UOp:
    return UOp(Ops.PHILOX, dtypes.uint32, stream, word)


def bitcast(x: UOp, dtype: DType) -> UOp:
    return UOp(Ops.BITCAST, dtype, (x,))


# ---- bits -> numbers (Triton's formulas) ------------------------------------------------

UNIFORM_SCALE = f32(4.6566127342e-10)  # the largest s with (2**31 - 1) * s < 1 in float32


def uniform_float(bits: UOp) -> UOp:
    """A float32 in [0, 1) from 32 random bits, as tl.rand: fold the sign bit away, scale."""
    signed = bitcast(bits, dtypes.int32)
    folded = signed.lt(0).where(signed.alu(Ops.NOT), signed)  # ~x == -x - 1
    return folded.cast(dtypes.float32) * UNIFORM_SCALE


def normal_float(bits0: UOp, bits1: UOp) -> UOp:
    """A standard normal float32 from two words, Box-Muller as tl.randn."""
    # max(u1, 1e-7) on the bits (non-negative floats order as their bits): a float max is
    # a branch to gcc, which then specializes the log for the constant and stops vectorizing
    min_bits = UOp.const(dtypes.int32, struct.unpack("i", struct.pack("f", 1.0e-7))[0])
    u1_bits = bitcast(uniform_float(bits0), dtypes.int32).alu(Ops.MAX, min_bits)
    theta = uniform_float(bits1) * f32(2 * math.pi)
    radius = (log_of_bits(u1_bits) * -2.0).alu(Ops.SQRT)
    return radius * cos_float(theta)


LN2_HI, LN2_LO = f32(6.9313812256e-01), f32(9.0580006145e-06)  # fdlibm's split: e * LN2_HI is exact


def log_of_bits(bits: UOp) -> UOp:
    """log(x) of a positive normal float32 x given as its bits, to about 1 ulp: x = 2**e * m
    with m in [sqrt(1/2), sqrt(2)), log(m) = 2 atanh(s) with s = (m - 1) / (m + 1), |s| < 0.172."""
    exponent = (bits - 0x3F3504F3).alu(Ops.SHR, UOp.const(dtypes.int32, 23))  # 0x3F3504F3: sqrt(1/2)
    mantissa = bitcast(bits - exponent.alu(Ops.SHL, UOp.const(dtypes.int32, 23)), dtypes.float32)
    f = mantissa - 1.0
    s = f.alu(Ops.FDIV, f + 2.0)
    z = s * s
    series = z * (f32(2 / 3) + z * (f32(2 / 5) + z * (f32(2 / 7) + z * f32(2 / 9))))
    e = exponent.cast(dtypes.float32)
    return e * LN2_HI + ((s * 2.0 + s * series) + e * LN2_LO)


# pi/2 in three parts (Cody-Waite reduction; the constants Cephes publishes, doubled): k * part
# is exact for small k.
PIO2_1, PIO2_2, PIO2_3 = 1.5703125, 4.837512969970703125e-4, f32(7.54978995489188216e-8)


def cos_float(x: UOp) -> UOp:
    """cos(x) of a float32 in [0, 2 pi] to about 1 ulp: reduce by the nearest multiple k of
    pi/2, then minimax sin/cos polynomials on [-pi/4, pi/4] (Cephes' published coefficients),
    chosen by k mod 4."""
    quadrant = (x * f32(2 / math.pi) + 0.5).cast(dtypes.int32)  # truncation is floor here: x >= 0
    k = quadrant.cast(dtypes.float32)
    r = ((x - k * PIO2_1) - k * PIO2_2) - k * PIO2_3
    z = r * r
    cos_r = ((z * f32(2.443315711809948e-05) - f32(1.388731625493765e-03)) * z + f32(4.166664568298827e-02)) * z * z
    cos_r = (cos_r - z * 0.5) + 1.0
    sin_r = r + r * z * ((z * f32(-1.9515295891e-4) + f32(8.3321608736e-3)) * z - f32(1.6666654611e-1))
    quadrant = quadrant.alu(Ops.AND, UOp.const(dtypes.int32, 3))
    pick = lambda q: quadrant.alu(Ops.CMPEQ, UOp.const(dtypes.int32, q))  # noqa: E731
    return pick(0).where(cos_r, pick(1).where(-sin_r, pick(2).where(-cos_r, sin_r)))


def random_int63(stream: tuple[UOp, UOp, UOp]) -> UOp:
    """A uniform int64 in [0, 2**63) from two words."""
    high = philox(stream, 0).cast(dtypes.int64).alu(Ops.MOD, UOp.const(dtypes.int64, 2**31))
    return high * 2**32 + philox(stream, 1).cast(dtypes.int64)


# ---- lowerings ---------------------------------------------------------------------------


def _check_supported(ctx: LoweringContext, kwargs: dict) -> None:
    """Our stream or aten's: aten for fallback_random, an explicit generator, other devices."""
    if ctx.fallback_random:
        raise Unsupported("config.fallback_random: random ops call aten")
    if kwargs.get("generator") is not None:
        raise Unsupported("an explicit torch.Generator draws from its own state")
    device = kwargs.get("device")
    if device is not None and torch.device(device).type not in ("cpu", "cuda"):
        raise Unsupported(f"random numbers on {device}")


def _uniform(ctx: LoweringContext, shape: tuple[int, ...]) -> UOp:
    return uniform_float(philox(random_stream(ctx, shape), 0))


def _normal(ctx: LoweringContext, shape: tuple[int, ...]) -> UOp:
    stream = random_stream(ctx, shape)
    return normal_float(philox(stream, 0), philox(stream, 1))


def _float_output(node: torch.fx.Node) -> tuple[tuple[int, ...], DType]:
    meta = out_meta(node)
    dtype = from_torch(meta.dtype)
    if not dtype.is_float:
        raise Unsupported(f"random floats of dtype {meta.dtype}")
    return tuple(meta.shape), dtype


@register(aten.rand.default, aten.rand_like.default)
def rand(ctx: LoweringContext, node: torch.fx.Node, *args, **kwargs) -> TensorValue:
    _check_supported(ctx, kwargs)
    shape, dtype = _float_output(node)
    return TensorValue(shape, dtype, _uniform(ctx, shape).cast(dtype))


@register(aten.randn.default, aten.randn_like.default)
def randn(ctx: LoweringContext, node: torch.fx.Node, *args, **kwargs) -> TensorValue:
    _check_supported(ctx, kwargs)
    shape, dtype = _float_output(node)
    return TensorValue(shape, dtype, _normal(ctx, shape).cast(dtype))


def _randint(ctx: LoweringContext, node: torch.fx.Node, low: int, high: int, kwargs: dict) -> TensorValue:
    _check_supported(ctx, kwargs)
    if not (isinstance(low, int) and isinstance(high, int)) or not 0 < high - low <= 2**63:
        raise Unsupported(f"randint bounds [{low}, {high})")  # aten raises eager's error, or draws a wider range
    meta = out_meta(node)
    shape, dtype = tuple(meta.shape), from_torch(meta.dtype)
    value = random_int63(random_stream(ctx, shape))
    if high - low < 2**63:
        value = value.alu(Ops.MOD, UOp.const(dtypes.int64, high - low))
    value = value + low
    return TensorValue(shape, dtype, value.cast(dtype))


@register(aten.randint.low)
def randint_low(ctx: LoweringContext, node: torch.fx.Node, low, high, size, **kwargs) -> TensorValue:
    return _randint(ctx, node, low, high, kwargs)


@register(aten.randint.default)
def randint_high(ctx: LoweringContext, node: torch.fx.Node, high, size, **kwargs) -> TensorValue:
    return _randint(ctx, node, 0, high, kwargs)


@register(aten.randint_like.default)
def randint_like_high(ctx: LoweringContext, node: torch.fx.Node, x, high, **kwargs) -> TensorValue:
    return _randint(ctx, node, 0, high, kwargs)


@register(aten.randint_like.low_dtype)
def randint_like_low(ctx: LoweringContext, node: torch.fx.Node, x, low, high, **kwargs) -> TensorValue:
    return _randint(ctx, node, low, high, kwargs)


@register(aten.bernoulli.p)
def bernoulli_p(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, p: float = 0.5, **kwargs) -> TensorValue:
    """1 with probability p: a uniform below p (as the decomposition of bernoulli)."""
    _check_supported(ctx, kwargs)
    drawn = _uniform(ctx, x.shape).lt(UOp.const(dtypes.float32, p))
    return TensorValue(x.shape, x.dtype, _bool_as(drawn, x.dtype))


@register(aten.bernoulli.Tensor)
def bernoulli_tensor(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, p: TensorValue,
                     **kwargs) -> TensorValue:  # fmt: skip
    _check_supported(ctx, kwargs)
    compare = dtypes.float64 if dtypes.float64 in (x.dtype, p.dtype) else dtypes.float32
    probability = broadcast_to(p, x.shape).body.cast(compare)
    drawn = _uniform(ctx, x.shape).cast(compare).lt(probability)
    return TensorValue(x.shape, x.dtype, _bool_as(drawn, x.dtype))


def _bool_as(x: UOp, dtype: DType) -> UOp:
    """A bool as 0/1 of `dtype` through a select: gcc does not vectorize bool-to-float casts."""
    return x if dtype.is_bool else x.where(UOp.const(dtype, 1), UOp.const(dtype, 0))


@register(aten.native_dropout.default)
def native_dropout(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, p: float, train: bool | None,
                   **kwargs) -> tuple[TensorValue, TensorValue]:  # fmt: skip
    """(x * mask * 1/(1-p), mask), mask true with probability 1-p, as eager's native_dropout;
    the backward (native_dropout_backward, decomposed) reads the saved mask."""
    _check_supported(ctx, kwargs)
    if not x.dtype.is_float:
        raise Unsupported("dropout of a non-float tensor (aten raises eager's error)")
    if not train or p == 0:
        return x, TensorValue(x.shape, dtypes.bool, UOp.const(dtypes.bool, True))
    if p == 1:
        return TensorValue(x.shape, x.dtype, UOp.const(x.dtype, 0)), TensorValue(
            x.shape, dtypes.bool, UOp.const(dtypes.bool, False)
        )
    keep = UOp.const(dtypes.float32, p).lt(_uniform(ctx, x.shape))
    dropped = x.body * UOp.const(x.dtype, 0.0)  # eager multiplies by the mask: NaN stays NaN, -x gives -0.0
    scaled = keep.where(x.body, dropped) * UOp.const(x.dtype, 1.0 / (1.0 - p))
    return TensorValue(x.shape, x.dtype, scaled), TensorValue(x.shape, dtypes.bool, keep)


@register(aten.uniform.default)
def uniform(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, low: float = 0.0, high: float = 1.0,
            **kwargs) -> TensorValue:  # fmt: skip
    """x.uniform_(low, high) made functional: u * (high - low) + low, as eager's kernel."""
    _check_supported(ctx, kwargs)
    shape, dtype = _float_output(node)
    value = _uniform(ctx, shape).cast(dtype) * UOp.const(dtype, high - low) + UOp.const(dtype, low)
    return TensorValue(shape, dtype, value)


@register(aten.normal_functional.default)
def normal_functional(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, mean: float = 0.0,
                      std: float = 1.0, **kwargs) -> TensorValue:  # fmt: skip
    _check_supported(ctx, kwargs)
    shape, dtype = _float_output(node)
    return TensorValue(shape, dtype, _normal(ctx, shape).cast(dtype) * UOp.const(dtype, std) + UOp.const(dtype, mean))


@register(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor, aten.normal.float_float)
def normal(ctx: LoweringContext, node: torch.fx.Node, mean, std, *size, **kwargs) -> TensorValue:
    """torch.normal(mean, std[, size]): mean + std * n, broadcasting tensor arguments."""
    _check_supported(ctx, kwargs)
    shape, dtype = _float_output(node)

    def operand(v) -> UOp:
        return broadcast_to(v, shape).body.cast(dtype) if isinstance(v, TensorValue) else UOp.const(dtype, v)

    return TensorValue(shape, dtype, _normal(ctx, shape).cast(dtype) * operand(std) + operand(mean))


@register(aten.exponential.default)
def exponential(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, rate: float = 1.0,
                **kwargs) -> TensorValue:  # fmt: skip
    """x.exponential_(rate) made functional: -log(1 - u) / rate, with 1 - u in (0, 1]."""
    _check_supported(ctx, kwargs)
    shape, dtype = _float_output(node)
    complement = UOp.const(dtypes.float32, 1.0) - _uniform(ctx, shape)
    value = log_of_bits(bitcast(complement, dtypes.int32)).alu(Ops.NEG).cast(dtype)
    return TensorValue(shape, dtype, value.alu(Ops.FDIV, UOp.const(dtype, rate)))
