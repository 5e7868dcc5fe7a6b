"""Lowerings of scans: cumsum, cumprod, cummax/cummin (values and indices), logcumsumexp.

Note: scans
    A scan's body is SCAN(value, AXIS d, *the other AXIS, combine): at position p, the
    combination of value(p with dim d := j) over j <= p[d]. It is always realized, and its kernel runs
    alone (schedule/nodes.py `runs_alone`): codegen makes dim d a sequential (reduce) loop
    inside the others (codegen/kernel.py) and lowers SCAN to an accumulator declared
    outside that loop, updated in it and read right after each update (ACC_RUNNING,
    codegen/phases.py), which the store writes at every step. The other dims run in
    parallel (OpenMP); the scan loop itself gets no pragma (renderer/cpp.py). SCANs over
    one dim share its loop: cummax's index is a running max of the positions where the
    element equals the running max or is NaN, which is eager's rule (the last position of
    the maximum; once a NaN is seen, the last NaN). Float sums and products accumulate in
    double and integer ones in int64, as aten does on the CPU.
"""

from __future__ import annotations

import torch

from ember.lower.context import LoweringContext
from ember.lower.indexing import normalized_dim, result
from ember.lower.registry import Unsupported, register
from ember.lower.values import TensorValue, axis
from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import Ops, UOp

aten = torch.ops.aten


def accumulator(dtype: DType) -> DType:
    return dtypes.float64 if dtype.is_float else dtypes.int64


def trivial(x: TensorValue, dim: int) -> bool:
    """Nothing to scan: no elements, a 0-d tensor, or a scanned dim of size 1."""
    return x.numel == 0 or x.ndim == 0 or x.shape[normalized_dim(dim, x.ndim)] == 1


def scan(value: UOp, dim: int, combine: Ops, ndim: int) -> UOp:
    """SCAN(value, scanned axis, *the other axes): the accumulator restarts for every position
    of the other axes, even those the value does not vary with (a broadcast gradient)."""
    others = [axis(d) for d in range(ndim) if d != dim]
    return UOp(Ops.SCAN, value.dtype, (value, axis(dim), *others), combine)


def scanned(ctx: LoweringContext, origin: str, x: TensorValue, dim: int, combine: Ops, out: DType,
            value: UOp | None = None) -> TensorValue:  # fmt: skip
    """The realized running `combine` of `value` (default: x's element in the accumulator type)."""
    value = x.body.cast(out).cast(accumulator(out)) if value is None else value
    if trivial(x, dim):
        return TensorValue(x.shape, out, value.cast(out))
    body = scan(value, normalized_dim(dim, x.ndim), combine, x.ndim).cast(out)
    return ctx.realized(TensorValue(x.shape, out, body), origin)


def running_count(ctx: LoweringContext, flags: TensorValue, origin: str) -> TensorValue:
    """For a 1-d bool tensor: at each position, how many elements up to it are true (int64)."""
    return scanned(ctx, origin, flags, 0, Ops.ADD, dtypes.int64)


@register(aten.cumsum.default, low_precision=False)
def lower_cumsum(ctx, node, x: TensorValue, dim: int, dtype=None) -> TensorValue:
    _, out = result(node)
    return scanned(ctx, node.name, x, dim, Ops.ADD, out)


@register(aten.cumprod.default, low_precision=False)
def lower_cumprod(ctx, node, x: TensorValue, dim: int, dtype=None) -> TensorValue:
    _, out = result(node)
    return scanned(ctx, node.name, x, dim, Ops.MUL, out)


@register(aten.logcumsumexp.default, low_precision=False)
def lower_logcumsumexp(ctx, node, x: TensorValue, dim: int) -> TensorValue:
    _, out = result(node)
    if not out.is_float:
        raise Unsupported("logcumsumexp of integers; aten reports it")
    return scanned(ctx, node.name, x, dim, Ops.LOGADDEXP, out)


@register(aten.cummax.default, aten.cummin.default, low_precision=False)
def lower_cummax(ctx, node, x: TensorValue, dim: int) -> tuple[TensorValue, TensorValue]:
    combine = Ops.MAX if node.target is aten.cummax.default else Ops.MIN
    if trivial(x, dim):
        return x, TensorValue(x.shape, dtypes.int64, UOp.const(dtypes.int64, 0))
    dim = normalized_dim(dim, x.ndim)
    element = x.body
    best = scan(element, dim, combine, x.ndim)
    is_best = element.alu(Ops.CMPEQ, best)
    if element.dtype.is_float:
        is_best = is_best.alu(Ops.OR, element.alu(Ops.ISNAN))
    position = is_best.where(axis(dim).cast(dtypes.int64), UOp.const(dtypes.int64, 0))
    values = ctx.realized(TensorValue(x.shape, x.dtype, best), node.name)
    indices = ctx.realized(TensorValue(x.shape, dtypes.int64, scan(position, dim, Ops.MAX, x.ndim)), node.name)
    return values, indices
