"""Lowerings of the rest of the elementwise math surface: inverse hyperbolic functions,
erfc/erfinv, the gamma family, Bessel functions and orthogonal polynomials, copysign,
nextafter, hypot, fmax/fmin, signbit, frexp and round with decimals.

Type promotion and broadcasting are pointwise.py's (`elementwise`). Special functions
lower to their own Ops, which the renderer computes with ATen's own CPU code (Note:
special functions, renderer/cpp.py), so results agree with eager.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.fx
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Promotion

from ember.lower.context import LoweringContext
from ember.lower.pointwise import _register_elementwise, binary, elementwise, out_meta, unary
from ember.lower.registry import Unsupported, register
from ember.lower.values import TensorValue, broadcast_to
from ember.uop.dtypes import dtypes, from_torch
from ember.uop.ops import Ops, UOp

aten = torch.ops.aten

UNARY_SPECIAL = {  # unary functions of floats (integers promote to float)
    aten.acosh: Ops.ACOSH, aten.asinh: Ops.ASINH, aten.atanh: Ops.ATANH, aten.erfc: Ops.ERFC,
    aten.lgamma: Ops.LGAMMA, aten.digamma: Ops.DIGAMMA, aten.erfinv: Ops.ERFINV, aten.i0: Ops.I0,
    aten.special_i0e: Ops.I0E, aten.special_i1: Ops.I1, aten.special_i1e: Ops.I1E, aten.special_ndtri: Ops.NDTRI,
    aten.special_erfcx: Ops.ERFCX, aten.special_airy_ai: Ops.AIRY_AI, aten.special_bessel_j0: Ops.BESSEL_J0,
    aten.special_bessel_j1: Ops.BESSEL_J1, aten.special_bessel_y0: Ops.BESSEL_Y0,
    aten.special_bessel_y1: Ops.BESSEL_Y1, aten.special_modified_bessel_i0: Ops.MODIFIED_BESSEL_I0,
    aten.special_modified_bessel_i1: Ops.MODIFIED_BESSEL_I1, aten.special_modified_bessel_k0: Ops.MODIFIED_BESSEL_K0,
    aten.special_modified_bessel_k1: Ops.MODIFIED_BESSEL_K1,
    aten.special_scaled_modified_bessel_k0: Ops.SCALED_MODIFIED_BESSEL_K0,
    aten.special_scaled_modified_bessel_k1: Ops.SCALED_MODIFIED_BESSEL_K1,
    aten.special_spherical_bessel_j0: Ops.SPHERICAL_BESSEL_J0,
}  # fmt: skip
BINARY_SPECIAL = {  # binary functions of floats (integers promote to float); polynomials are (x, n)
    aten.copysign: Ops.COPYSIGN, aten.special_zeta: Ops.ZETA,
    aten.special_chebyshev_polynomial_t: Ops.CHEBYSHEV_T, aten.special_chebyshev_polynomial_u: Ops.CHEBYSHEV_U,
    aten.special_chebyshev_polynomial_v: Ops.CHEBYSHEV_V, aten.special_chebyshev_polynomial_w: Ops.CHEBYSHEV_W,
    aten.special_shifted_chebyshev_polynomial_t: Ops.SHIFTED_CHEBYSHEV_T,
    aten.special_shifted_chebyshev_polynomial_u: Ops.SHIFTED_CHEBYSHEV_U,
    aten.special_shifted_chebyshev_polynomial_v: Ops.SHIFTED_CHEBYSHEV_V,
    aten.special_shifted_chebyshev_polynomial_w: Ops.SHIFTED_CHEBYSHEV_W,
    aten.special_hermite_polynomial_h: Ops.HERMITE_H, aten.special_hermite_polynomial_he: Ops.HERMITE_HE,
    aten.special_laguerre_polynomial_l: Ops.LAGUERRE_L, aten.special_legendre_polynomial_p: Ops.LEGENDRE_P,
}  # fmt: skip


def _register_special(packet, op: Ops, fn: Callable[..., UOp], arity: int, kind=Promotion.INT_TO_FLOAT) -> None:
    """`_register_elementwise` (a backend that cannot render `op` gets aten: lower/graph.py)."""

    @register(packet)
    def lowering(ctx: LoweringContext, node: torch.fx.Node, *args, **kwargs) -> TensorValue:
        if kwargs:
            raise Unsupported(f"keyword arguments {sorted(kwargs)}")
        return elementwise(node, fn, args[:arity], kind)


for _packet, _op in UNARY_SPECIAL.items():
    _register_special(_packet, _op, unary(_op), 1)
for _packet, _op in BINARY_SPECIAL.items():
    _register_special(_packet, _op, binary(_op), 2)


def float_only(op: Ops) -> Callable[[UOp, UOp], UOp]:
    """Ops eager defines for floats only (nextafter, hypot, igamma): integers go to aten, which raises."""

    def fn(a: UOp, b: UOp) -> UOp:
        if not a.dtype.is_float:
            raise Unsupported(f"{op.name.lower()} of {a.dtype.name}")
        return a.alu(op, b)

    return fn


_register_elementwise([aten.nextafter], float_only(Ops.NEXTAFTER), 2)
_register_elementwise([aten.hypot], float_only(Ops.HYPOT), 2)
for _packet, _op in ((aten.igamma, Ops.IGAMMA), (aten.igammac, Ops.IGAMMAC)):
    _register_special(_packet, _op, float_only(_op), 2, Promotion.DEFAULT)


def nan_ignoring(float_op: Ops, int_op: Ops) -> Callable[[UOp, UOp], UOp]:
    """fmax/fmin: C's fmax on floats (a NaN loses to a number), max on integers."""
    return lambda a, b: a.alu(float_op if a.dtype.is_float else int_op, b)


_register_elementwise([aten.fmax], nan_ignoring(Ops.FMAX, Ops.MAX), 2)
_register_elementwise([aten.fmin], nan_ignoring(Ops.FMIN, Ops.MIN), 2)


def signbit(x: UOp) -> UOp:
    if x.dtype.is_bool:
        return UOp.const(dtypes.bool, False)
    if x.dtype in (dtypes.float16, dtypes.bfloat16):
        x = x.cast(dtypes.float32)  # exact; SIGNBIT reads a C float, not the 16-bit storage
    return x.alu(Ops.SIGNBIT) if x.dtype.is_float else x.lt(x.const_like(0))


_register_elementwise([aten.signbit], signbit, 1, Promotion.ALWAYS_BOOL)


@register(aten.polygamma.default)
def lower_polygamma(ctx: LoweringContext, node: torch.fx.Node, n: int, x) -> TensorValue:
    """As ATen's kernel: n = 0 is digamma, n = 1 trigamma, larger n the zeta-based series."""
    if not isinstance(n, int) or n < 0:
        raise Unsupported("polygamma of a negative or non-constant order")
    meta = out_meta(node)
    shape, result = tuple(meta.shape), from_torch(meta.dtype)
    value = broadcast_to(x, shape).body.cast(result)
    if n <= 1:
        return TensorValue(shape, result, value.alu(Ops.DIGAMMA if n == 0 else Ops.TRIGAMMA))
    return TensorValue(shape, result, value.alu(Ops.POLYGAMMA, value.const_like(n)))


@register(aten.frexp.Tensor)
def lower_frexp(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue) -> tuple[TensorValue, TensorValue]:
    if not x.dtype.is_float:
        raise Unsupported("frexp of integers raises in eager")
    mantissa = x.body.alu(Ops.FREXP_MANTISSA)
    exponent = UOp(Ops.FREXP_EXPONENT, dtypes.int32, (x.body,))
    return TensorValue(x.shape, x.dtype, mantissa), TensorValue(x.shape, dtypes.int32, exponent)


@register(aten.round.decimals)
def lower_round_decimals(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, decimals: int = 0):
    """As ATen: x * 10^d rounded half to even, then / 10^d (for d < 0: / then *), in the
    element type."""
    if not isinstance(decimals, int) or isinstance(decimals, bool) or not x.dtype.is_float:
        raise Unsupported("round with decimals of integers (eager raises) or non-integer decimals")
    scale = float(10 ** abs(decimals))

    def fn(v: UOp) -> UOp:
        ten_pow = v.const_like(scale)
        if decimals < 0:
            return v.alu(Ops.FDIV, ten_pow).alu(Ops.ROUND) * ten_pow
        return (v * ten_pow).alu(Ops.ROUND).alu(Ops.FDIV, ten_pow)

    return elementwise(node, fn, (x,))


def angle(x: UOp) -> UOp:
    """The argument of a real number, as ATen: pi below zero, 0 otherwise, NaN kept."""
    below = x.lt(x.const_like(0)).where(x.const_like(math.pi), x.const_like(0))
    return x.alu(Ops.ISNAN).where(x, below)


_register_elementwise([aten.angle], angle, 1, Promotion.INT_TO_FLOAT)


@register(aten.hardshrink_backward.default, aten.softshrink_backward.default)
def lower_shrink_backward(ctx: LoweringContext, node: torch.fx.Node, grad, x, lambd=0.5) -> TensorValue:
    """As ATen: zero where -lambd <= x <= lambd, the incoming gradient elsewhere (NaN passes it)."""

    def fn(g: UOp, v: UOp) -> UOp:
        inside = v.const_like(-lambd).alu(Ops.CMPLE, v).alu(Ops.AND, v.alu(Ops.CMPLE, v.const_like(lambd)))
        return inside.where(g.const_like(0), g)

    return elementwise(node, fn, (grad, x))
