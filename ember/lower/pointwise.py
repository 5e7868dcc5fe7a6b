"""Lowerings of elementwise aten ops: arithmetic, comparisons, logic, math functions, casts.

Type promotion follows eager exactly: operand dtypes come from the FX node's example
values and go through torch's own `elementwise_dtypes`; operands are broadcast to the
node's output shape, cast to the computation dtype, combined, and cast to the result dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Number

import torch
import torch.fx
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Promotion
from torch._prims_common import elementwise_dtypes

from ember.ir import Layout
from ember.lower.context import LoweringContext
from ember.lower.registry import Unsupported, register, register_by_name
from ember.lower.values import TensorValue, broadcast_to, load
from ember.uop.dtypes import DType, dtypes, from_torch, is_low_precision
from ember.uop.ops import Ops, UOp

aten = torch.ops.aten


def out_meta(node: torch.fx.Node) -> torch.Tensor:
    meta = node.meta.get("val")
    if not isinstance(meta, torch.Tensor):
        raise Unsupported(f"{node.name} has no tensor example value")
    return meta


def _meta_of(arg: object) -> object:
    return arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg


def promoted(node: torch.fx.Node, operands: int, kind: Promotion = Promotion.DEFAULT) -> tuple[DType, DType]:
    """(computation dtype, result dtype) of the node's first `operands` positional args."""
    metas = [_meta_of(a) for a in node.args[:operands]]
    metas = [m for m in metas if isinstance(m, (torch.Tensor, Number))]
    compute, result = elementwise_dtypes(*metas, type_promotion_kind=kind)
    return from_torch(compute), from_torch(result)


def operand(x: TensorValue | Number, shape: tuple[int, ...], dtype: DType) -> UOp:
    """`x` broadcast to `shape` and cast to `dtype`, as the UOp of one element."""
    if isinstance(x, TensorValue):
        return broadcast_to(x, shape).body.cast(dtype)
    return UOp.const(dtype, x)


def elementwise(node: torch.fx.Node, fn: Callable[..., UOp], args: tuple, kind: Promotion = Promotion.DEFAULT,
                compute: DType | None = None) -> TensorValue:  # fmt: skip
    """The common path: promote, broadcast, apply `fn` to the element UOps, cast to result."""
    meta = out_meta(node)
    shape, result = tuple(meta.shape), from_torch(meta.dtype)
    kind = Promotion.DEFAULT if kind is Promotion.ALWAYS_BOOL else kind
    if compute is None:
        compute = promoted(node, len(args), kind)[0]
    operands = low_precision_operands(node, args, shape, compute, kind)
    body = fn(*(operands or [operand(a, shape, compute) for a in args]))
    return TensorValue(shape, result, body.cast(result))


# aten ops whose CPU kernels read a scalar second operand (a Python number or a 0-d tensor)
# in float32 rather than rounded to float16/bfloat16 (`original_scalar_value<opmath_t>`)
OPMATH_SCALAR_OPS = {aten.mul, aten.div, aten.floor_divide}


def low_precision_operands(node: torch.fx.Node, args: tuple, shape: tuple[int, ...], compute: DType,
                           kind: Promotion) -> list[UOp] | None:  # fmt: skip
    """Eager rounds every operand to the common dtype before computing (TensorIterator casts
    its inputs), which matters when that is float16/bfloat16 and an operand is a scalar, a 0-d
    float32 tensor or an integer: `x_bf16 + 0.3` adds bfloat16(0.3). Only mul and div keep a
    scalar second operand in float32. None when the common dtype is not low-precision."""
    common = promoted(node, len(args), kind)[1]
    if not is_low_precision(common) or compute is common:
        return None
    opmath = getattr(node.target, "overloadpacket", None) in OPMATH_SCALAR_OPS
    keeps_float32 = [opmath and i == 1 and (not isinstance(a, TensorValue) or a.ndim == 0) for i, a in enumerate(args)]
    return [operand(a, shape, compute) if keep else operand(a, shape, common).cast(compute)
            for a, keep in zip(args, keeps_float32)]  # fmt: skip


def _register_elementwise(op_packets: list, fn: Callable[..., UOp], arity: int, kind=Promotion.DEFAULT) -> None:
    def lowering(ctx: LoweringContext, node: torch.fx.Node, *args, **kwargs) -> TensorValue:
        if kwargs:
            raise Unsupported(f"keyword arguments {sorted(kwargs)}")
        return elementwise(node, fn, args[:arity], kind)

    register(*op_packets)(lowering)


# ---- math in UOps: helpers that expand one aten op into ember ops ----------------------


def truediv(a: UOp, b: UOp) -> UOp:
    return a.alu(Ops.FDIV, b)


def floordiv(a: UOp, b: UOp) -> UOp:
    """Python floor division, as eager: the floor of the exact quotient a / b, not of its
    rounding (1 // 0.1 is 9: 1 / 0.1 rounds to 10). For floats (Note: float floor division)."""
    if a.dtype.is_int:
        q, r = a.alu(Ops.IDIV, b), a.alu(Ops.MOD, b)
        needs_fix = r.alu(Ops.CMPNE, r.const_like(0)).alu(Ops.AND, r.lt(0).alu(Ops.CMPNE, b.lt(0)))
        return needs_fix.where(q - 1, q)
    return float_floordiv(a, b)


def float_floordiv(a: UOp, b: UOp) -> UOp:
    """Note: float floor division
    fmod is exact: a = n * b + r with n the quotient truncated toward zero, r its remainder.
    So (a - r) / b is n up to the roundings of the subtraction and the division, which snapping
    to the nearest integer removes; where the float spacing is 1/2 those roundings can land
    halfway, and eager snaps halves down, so this does too. The floor is n, or n - 1 when the
    remainder is nonzero with the sign opposite to b's (the exact quotient is negative and not
    whole). A zero quotient carries the sign of a / b. b = 0 gives a / b (inf or NaN), a NaN or
    an infinite a gives NaN through fmod, and an infinite b gives 0 or -1, as Python does."""
    remainder = a.alu(Ops.FMOD, b)
    near_n = (a - remainder).alu(Ops.FDIV, b)
    down = near_n.alu(Ops.FLOOR)
    truncated = near_n.const_like(0.5).alu(Ops.CMPLT, near_n - down).where(down + 1, down)
    below = remainder.alu(Ops.CMPNE, remainder.const_like(0)).alu(Ops.AND, remainder.lt(0).alu(Ops.CMPNE, b.lt(0)))
    floored = below.where(truncated - 1, truncated)
    quotient = a.alu(Ops.FDIV, b)
    signed_zero = a.const_like(0.0).alu(Ops.COPYSIGN, quotient)
    nonzero = floored.alu(Ops.CMPNE, floored.const_like(0)).where(floored, signed_zero)
    return b.alu(Ops.CMPEQ, b.const_like(0)).where(quotient, nonzero)


def truncdiv(a: UOp, b: UOp) -> UOp:
    return a.alu(Ops.IDIV, b) if a.dtype.is_int else a.alu(Ops.FDIV, b).alu(Ops.TRUNC)


def remainder(a: UOp, b: UOp) -> UOp:
    """Python remainder: the sign of the divisor."""
    mod = a.alu(Ops.MOD if a.dtype.is_int else Ops.FMOD, b)
    wrong_sign = mod.alu(Ops.CMPNE, mod.const_like(0)).alu(Ops.AND, mod.lt(0).alu(Ops.CMPNE, b.lt(0)))
    return wrong_sign.where(mod + b, mod)


def fmod(a: UOp, b: UOp) -> UOp:
    return a.alu(Ops.MOD if a.dtype.is_int else Ops.FMOD, b)


def sign(x: UOp) -> UOp:
    if x.dtype.is_bool:
        return x
    zero = x.const_like(0)
    return zero.lt(x).cast(x.dtype) - x.lt(zero).cast(x.dtype)


def sigmoid(x: UOp) -> UOp:
    return x.const_like(1).alu(Ops.FDIV, x.const_like(1) + x.alu(Ops.NEG).alu(Ops.EXP))


def gelu(x: UOp, approximate: str = "none") -> UOp:
    half = x * 0.5
    if approximate == "tanh":
        inner = (x + x * x * x * 0.044715) * math.sqrt(2 / math.pi)
        return half * (inner.alu(Ops.TANH) + 1)
    return half * ((x * (1 / math.sqrt(2))).alu(Ops.ERF) + 1)


def relu(x: UOp) -> UOp:
    """x < 0 ? 0 : x, as eager: relu(-0.0) is -0.0 and NaN stays NaN."""
    return x.lt(x.const_like(0)).where(x.const_like(0), x)


def logical(op: Ops) -> Callable[..., UOp]:
    return lambda *xs: xs[0].cast(dtypes.bool).alu(op, *(x.cast(dtypes.bool) for x in xs[1:]))


def bitwise_not(x: UOp) -> UOp:
    return x.alu(Ops.NOT)


def unary(op: Ops) -> Callable[[UOp], UOp]:
    return lambda x: x.alu(op)


def binary(op: Ops) -> Callable[[UOp, UOp], UOp]:
    return lambda a, b: a.alu(op, b)


def integer_identity(op: Ops) -> Callable[[UOp], UOp]:
    """floor/ceil/round/trunc are the identity on integers, as in eager."""
    return lambda x: x if not x.dtype.is_float else x.alu(op)


def rsqrt(x: UOp) -> UOp:
    return x.const_like(1).alu(Ops.FDIV, x.alu(Ops.SQRT))


def reciprocal(x: UOp) -> UOp:
    return x.const_like(1).alu(Ops.FDIV, x)


def isinf(x: UOp) -> UOp:
    return x.alu(Ops.ISINF) if x.dtype.is_float else UOp.const(dtypes.bool, False)


def isnan(x: UOp) -> UOp:
    return x.alu(Ops.ISNAN) if x.dtype.is_float else UOp.const(dtypes.bool, False)


def _swap(fn: Callable[[UOp, UOp], UOp]) -> Callable[[UOp, UOp], UOp]:
    return lambda a, b: fn(b, a)


UNARY_FLOAT = {  # ops that compute in floating point (integers promote)
    aten.exp: Ops.EXP, aten.exp2: Ops.EXP2, aten.expm1: Ops.EXPM1, aten.log: Ops.LOG, aten.log2: Ops.LOG2,
    aten.log10: Ops.LOG10, aten.log1p: Ops.LOG1P, aten.sqrt: Ops.SQRT, aten.sin: Ops.SIN, aten.cos: Ops.COS,
    aten.tan: Ops.TAN, aten.asin: Ops.ASIN, aten.acos: Ops.ACOS, aten.atan: Ops.ATAN, aten.sinh: Ops.SINH,
    aten.cosh: Ops.COSH, aten.tanh: Ops.TANH, aten.erf: Ops.ERF,
}  # fmt: skip
for _packet, _op in UNARY_FLOAT.items():
    _register_elementwise([_packet], unary(_op), 1, Promotion.INT_TO_FLOAT)
_register_elementwise([aten.sigmoid], sigmoid, 1, Promotion.INT_TO_FLOAT)
_register_elementwise([aten.rsqrt], rsqrt, 1, Promotion.INT_TO_FLOAT)
_register_elementwise([aten.reciprocal], reciprocal, 1, Promotion.INT_TO_FLOAT)
_register_elementwise([aten.atan2], binary(Ops.ATAN2), 2, Promotion.INT_TO_FLOAT)
_register_elementwise([aten.neg], unary(Ops.NEG), 1)
_register_elementwise([aten.abs], lambda x: x if x.dtype.is_bool else x.alu(Ops.ABS), 1)
_register_elementwise([aten.sign], sign, 1)
_register_elementwise([aten.relu], relu, 1)
_register_elementwise([aten.floor], integer_identity(Ops.FLOOR), 1)
_register_elementwise([aten.ceil], integer_identity(Ops.CEIL), 1)
_register_elementwise([aten.trunc], integer_identity(Ops.TRUNC), 1)
_register_elementwise([aten.isnan], isnan, 1, Promotion.ALWAYS_BOOL)
_register_elementwise([aten.isinf], isinf, 1, Promotion.ALWAYS_BOOL)
_register_elementwise([aten.mul], binary(Ops.MUL), 2)
_register_elementwise([aten.maximum], binary(Ops.MAX), 2)
_register_elementwise([aten.minimum], binary(Ops.MIN), 2)
_register_elementwise([aten.remainder], remainder, 2)
_register_elementwise([aten.fmod], fmod, 2)
_register_elementwise([aten.floor_divide], floordiv, 2)
for _packet, _op in {aten.eq: Ops.CMPEQ, aten.ne: Ops.CMPNE, aten.lt: Ops.CMPLT, aten.le: Ops.CMPLE}.items():
    _register_elementwise([_packet], binary(_op), 2, Promotion.ALWAYS_BOOL)
_register_elementwise([aten.gt], _swap(binary(Ops.CMPLT)), 2, Promotion.ALWAYS_BOOL)
_register_elementwise([aten.ge], _swap(binary(Ops.CMPLE)), 2, Promotion.ALWAYS_BOOL)
for _packet, _op in {aten.logical_and: Ops.AND, aten.logical_or: Ops.OR, aten.logical_xor: Ops.CMPNE}.items():
    _register_elementwise([_packet], logical(_op), 2, Promotion.ALWAYS_BOOL)
_register_elementwise([aten.logical_not], logical(Ops.NOT), 1, Promotion.ALWAYS_BOOL)
for _packet, _op in {aten.bitwise_and: Ops.AND, aten.bitwise_or: Ops.OR, aten.bitwise_xor: Ops.XOR}.items():
    _register_elementwise([_packet], binary(_op), 2)
_register_elementwise([aten.bitwise_not], bitwise_not, 1)


@register(aten.round.default)
def lower_round(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue) -> TensorValue:
    return elementwise(node, integer_identity(Ops.ROUND), (x,))


@register(aten.bitwise_left_shift, aten.bitwise_right_shift, aten.__lshift__, aten.__rshift__)
def lower_shift(ctx: LoweringContext, node: torch.fx.Node, a, b) -> TensorValue:
    """`x << n` on a tensor is aten.__lshift__, which AOT graphs keep as it is."""
    op = Ops.SHL if node.target.overloadpacket in (aten.bitwise_left_shift, aten.__lshift__) else Ops.SHR
    return elementwise(node, binary(op), (a, b))


@register(aten.add, aten.sub)
def lower_add_sub(ctx: LoweringContext, node: torch.fx.Node, a, b, alpha=1) -> TensorValue:
    op = Ops.ADD if node.target.overloadpacket is aten.add else Ops.SUB
    if alpha == 1:
        return elementwise(node, binary(op), (a, b))
    common = promoted(node, 2)[1]
    if is_low_precision(common):  # eager's kernel rounds alpha to float16/bfloat16 first
        alpha = UOp.const(common, alpha).arg
    return elementwise(node, lambda x, y: x.alu(op, y * UOp.const(y.dtype, alpha)), (a, b))


def multiply_add(a: UOp, b: UOp, c: UOp) -> UOp:
    """Note: prims.fma is one rounding
    prims.fma(a, b, c) (dynamo writes addcmul_/addcdiv_ with a value, and add_ with a tensor alpha,
    as a product or quotient and then fma: every Adam step) is documented as a * b + c without
    rounding the product, which a float FMA gives (its eager implementation rounds twice; the
    single rounding is the closer to float64). Integers multiply and add, wrapping."""
    if a.dtype.is_bool:
        raise Unsupported("fma of booleans")
    return a.alu(Ops.MULACC, b, c)


@register_by_name("prims::fma")
def lower_fma(ctx: LoweringContext, node: torch.fx.Node, a, b, c) -> TensorValue:
    return elementwise(node, multiply_add, (a, b, c))


def lerp(start: UOp, end: UOp, weight: UOp | float, near_start: UOp | bool) -> UOp:
    """start + weight * (end - start), computed from `end` back when |weight| >= 0.5, so that a
    weight of 1 gives `end` exactly and each side keeps its rounding error small (as eager's
    kernel does). `near_start`: |weight| < 0.5, a bool when the weight is a number."""
    difference = end - start
    from_start = start + difference * weight
    from_end = end - difference * (1 - weight if isinstance(weight, float | int) else weight.const_like(1) - weight)
    if isinstance(near_start, bool):
        return from_start if near_start else from_end
    return near_start.where(from_start, from_end)


@register(aten.lerp.Scalar, aten.lerp.Tensor)
def lower_lerp(ctx: LoweringContext, node: torch.fx.Node, start, end, weight) -> TensorValue:
    """Lowered whole rather than through torch's decomposition: a number weight picks its side of
    `lerp` here, where the decomposition traces both sides and a select per element (an
    optimizer step's moving averages, once per parameter)."""
    if isinstance(weight, Number):
        return elementwise(node, lambda s, e: lerp(s, e, weight, abs(weight) < 0.5), (start, end))
    return elementwise(node, lambda s, e, w: lerp(s, e, w, w.alu(Ops.ABS).lt(w.const_like(0.5))), (start, end, weight))


@register(aten.addcmul.default, aten.addcdiv.default)
def lower_add_product(ctx: LoweringContext, node: torch.fx.Node, x, tensor1, tensor2, value=1) -> TensorValue:
    """x + value * tensor1 * tensor2 (addcmul) or x + value * tensor1 / tensor2 (addcdiv), the
    product taken left to right as eager's kernel does; `value` stays in the computation dtype
    (float32 for float16/bfloat16 operands, as eager's)."""
    combine = truediv if node.target is aten.addcdiv.default else binary(Ops.MUL)
    if isinstance(value, TensorValue):
        raise Unsupported(f"{node.target} with a tensor value")

    def add_product(x: UOp, a: UOp, b: UOp) -> UOp:
        return x + combine(a if value == 1 else a * value, b)

    return elementwise(node, add_product, (x, tensor1, tensor2))


@register(aten.div, aten.true_divide)
def lower_div(ctx: LoweringContext, node: torch.fx.Node, a, b, rounding_mode: str | None = None) -> TensorValue:
    if rounding_mode is None:
        return elementwise(node, truediv, (a, b), Promotion.INT_TO_FLOAT)
    return elementwise(node, floordiv if rounding_mode == "floor" else truncdiv, (a, b))


@register(aten.pow)
def lower_pow(ctx: LoweringContext, node: torch.fx.Node, a, b) -> TensorValue:
    if isinstance(b, Number) and not isinstance(b, bool) and isinstance(a, TensorValue):
        special = {2: lambda x: x * x, 3: lambda x: x * x * x, 1: lambda x: x, 0.5: unary(Ops.SQRT)}
        if b in special and from_torch(out_meta(node).dtype).is_float:
            # computed in the promoted dtype of both operands: int_tensor ** 0.5 is a float sqrt
            return elementwise(node, special[b], (a,), compute=promoted(node, 2)[0])
    return elementwise(node, binary(Ops.POW), (a, b))


@register(aten.where.self)
def lower_where(ctx: LoweringContext, node: torch.fx.Node, cond, a, b) -> TensorValue:
    meta = out_meta(node)
    shape, result = tuple(meta.shape), from_torch(meta.dtype)
    condition = operand(cond, shape, dtypes.bool)
    return TensorValue(shape, result, condition.where(operand(a, shape, result), operand(b, shape, result)))


@register(aten.clamp.default, aten.clamp.Tensor, aten.clamp_min, aten.clamp_max)
def lower_clamp(ctx: LoweringContext, node: torch.fx.Node, x, low=None, high=None) -> TensorValue:
    if node.target in (aten.clamp_max.default, aten.clamp_max.Tensor):
        low, high = None, low
    meta = out_meta(node)
    shape, result = tuple(meta.shape), from_torch(meta.dtype)
    value = operand(x, shape, result)
    if low is not None:
        value = value.alu(Ops.MAX, operand(low, shape, result))
    if high is not None:
        value = value.alu(Ops.MIN, operand(high, shape, result))
    return TensorValue(shape, result, value)


@register(aten.gelu.default)
def lower_gelu(ctx: LoweringContext, node: torch.fx.Node, x, approximate: str = "none") -> TensorValue:
    return elementwise(node, lambda v: gelu(v, approximate), (x,), Promotion.INT_TO_FLOAT)


@register(aten.hardtanh.default)
def lower_hardtanh(ctx: LoweringContext, node: torch.fx.Node, x, low=-1.0, high=1.0) -> TensorValue:
    return elementwise(node, lambda v: v.alu(Ops.MAX, v.const_like(low)).alu(Ops.MIN, v.const_like(high)), (x,))


@register(aten._to_copy.default)
def lower_to_copy(ctx: LoweringContext, node: torch.fx.Node, x, **kwargs) -> TensorValue:
    meta = out_meta(node)
    source = node.args[0].meta["val"].device if isinstance(node.args[0], torch.fx.Node) else meta.device
    if meta.device != source:
        raise Unsupported("copies to another device go through aten")
    result = from_torch(meta.dtype)
    return TensorValue(x.shape, result, x.body.cast(result))


@register_by_name("prims::convert_element_type")
def lower_convert_element_type(ctx: LoweringContext, node: torch.fx.Node, x, dtype: torch.dtype) -> TensorValue:
    """AOTAutograd's cast of a float dynamo passes as a 0-d float64 tensor (`dynamic=True` leaves
    Python floats unspecialized: GPT-2's math.pi), else a call to aten per use."""
    if not isinstance(x, TensorValue):
        raise Unsupported("a cast of a Python number")
    result = from_torch(dtype)
    return TensorValue(x.shape, result, x.body.cast(result))


@register(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default, aten.detach.default)
def lower_identity(ctx: LoweringContext, node: torch.fx.Node, x, **kwargs) -> TensorValue:
    memory_format = kwargs.get("memory_format")
    returned = any(user.op == "output" for user in node.users)
    if memory_format in (None, torch.preserve_format) or not isinstance(x, TensorValue):
        return x
    if memory_format is torch.contiguous_format and not returned:
        # AOTAutograd writes one before every reshape of a permutation: left to the consumer,
        # so a matmul operand may be stored column-major (Note: transposed matmul operands)
        return x
    # a layout request (channels-last before a convolution, a result copied back to eager's
    # layout, ember/passes/layout.py): a buffer in the result's strides, into which the
    # producer's pointwise body is inlined
    meta = out_meta(node)
    ref = ctx.realize(x, node.name, Layout(tuple(meta.shape), tuple(meta.stride())))
    return load(ctx.buffers[ref.name], ref.layout)


@register(aten.copy.default)
def lower_copy(ctx: LoweringContext, node: torch.fx.Node, dst: TensorValue, src, non_blocking=False) -> TensorValue:
    return TensorValue(dst.shape, dst.dtype, operand(src, dst.shape, dst.dtype))
