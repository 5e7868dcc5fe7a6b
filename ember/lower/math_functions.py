"""Lowerings of the rest of the elementwise math surface: inverse hyperbolic functions, erfc,
lgamma, copysign, nextafter, hypot, fmax/fmin, signbit, round with decimals, angle; and the
special functions ember leaves to aten as extern kernels (Note: special functions).

Type promotion and broadcasting are pointwise.py's (`elementwise`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.fx
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Promotion

from ember.lower.context import LoweringContext
from ember.lower.pointwise import _register_elementwise, binary, elementwise, unary
from ember.lower.registry import Unsupported, register, register_extern
from ember.lower.values import TensorValue
from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, UOp

aten = torch.ops.aten

UNARY_MATH = {  # libm's unary functions of floats (integers promote to float)
    aten.acosh: Ops.ACOSH, aten.asinh: Ops.ASINH, aten.atanh: Ops.ATANH, aten.erfc: Ops.ERFC,
    aten.lgamma: Ops.LGAMMA,
}  # fmt: skip
for _packet, _op in UNARY_MATH.items():
    _register_elementwise([_packet], unary(_op), 1, Promotion.INT_TO_FLOAT)
_register_elementwise([aten.copysign], binary(Ops.COPYSIGN), 2, Promotion.INT_TO_FLOAT)

# Note: special functions
#     Special functions past libm's (the gamma family past lgamma, erfinv, the Bessel functions,
#     zeta, the incomplete gamma functions, orthogonal polynomials) have no lowering: on every
#     backend each call is an extern kernel that runs the aten op, declared here once. The
#     pointwise work around a call still fuses into ember's kernels; only the call itself
#     reads and writes memory. ember keeps no copy of anyone's implementation of these; one
#     worth fusing gets ember's own, written from the mathematics and tested against eager.
EXTERN_SPECIAL_FUNCTIONS = [
    aten.digamma, aten.polygamma, aten.erfinv, aten.igamma, aten.igammac, aten.frexp, aten.i0, aten.special_i0e,
    aten.special_i1, aten.special_i1e, aten.special_ndtri, aten.special_erfcx, aten.special_airy_ai,
    aten.special_bessel_j0, aten.special_bessel_j1, aten.special_bessel_y0, aten.special_bessel_y1,
    aten.special_modified_bessel_i0, aten.special_modified_bessel_i1, aten.special_modified_bessel_k0,
    aten.special_modified_bessel_k1, aten.special_scaled_modified_bessel_k0, aten.special_scaled_modified_bessel_k1,
    aten.special_spherical_bessel_j0, aten.special_zeta, aten.special_chebyshev_polynomial_t,
    aten.special_chebyshev_polynomial_u, aten.special_chebyshev_polynomial_v, aten.special_chebyshev_polynomial_w,
    aten.special_shifted_chebyshev_polynomial_t, aten.special_shifted_chebyshev_polynomial_u,
    aten.special_shifted_chebyshev_polynomial_v, aten.special_shifted_chebyshev_polynomial_w,
    aten.special_hermite_polynomial_h, aten.special_hermite_polynomial_he, aten.special_laguerre_polynomial_l,
    aten.special_legendre_polynomial_p,
]  # fmt: skip
register_extern(*EXTERN_SPECIAL_FUNCTIONS)


def float_only(op: Ops) -> Callable[[UOp, UOp], UOp]:
    """Ops eager defines for floats only (nextafter, hypot): integers go to aten, which raises."""

    def fn(a: UOp, b: UOp) -> UOp:
        if not a.dtype.is_float:
            raise Unsupported(f"{op.name.lower()} of {a.dtype.name}")
        return a.alu(op, b)

    return fn


_register_elementwise([aten.nextafter], float_only(Ops.NEXTAFTER), 2)
_register_elementwise([aten.hypot], float_only(Ops.HYPOT), 2)


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
