"""Lowerings of reductions: sum, mean, prod, amax/amin, max/min with indices, argmax/argmin,
var/std (any correction), any/all, vector norms.

A reduction's body is `REDUCE(value, *ranges)` where the ranges are fresh reduce loop
variables substituted for the reduced axes of the input. Results are realized (see
graph.py) so consumers read them from memory; the scheduler may later fuse them back.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.fx

from ember.lower.context import LoweringContext
from ember.lower.graph import NOT_ARITHMETIC, TRANSCENDENTAL_OPS
from ember.lower.one_hot_sums import pm_one_hot_sums
from ember.lower.pointwise import out_meta
from ember.lower.registry import Unsupported, register
from ember.lower.values import TensorValue, axis, const_index
from ember.uop.dtypes import DType, dtypes, from_torch
from ember.uop.ops import Ops, UOp, substitute

aten = torch.ops.aten


def reduced_dims(x: TensorValue, dims) -> list[int]:
    """`dims` normalized; None or [] mean every dim, as in aten. A 0-d tensor has no dim to
    reduce: dim 0 (or -1) of a scalar is the scalar itself."""
    if x.ndim == 0:
        return []
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(x.ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % max(x.ndim, 1) for d in dims})


def reduce(ctx: LoweringContext, x: TensorValue, dims: list[int], keepdim: bool, combine: Ops, acc: DType,
           value=None) -> TensorValue:  # fmt: skip
    """REDUCE of `value(element)` (default: the element cast to `acc`) over `dims` of `x`.
    `value` also receives, for every dim of `x`, its index in the reduction (a reduce range
    for a reduced dim, an output axis otherwise), to read values aligned with the element."""
    ranges, old_axes, out_shape, out_axis = [], [], [], 0
    for d, size in enumerate(x.shape):
        if d in dims:
            if size == 1:
                old_axes.append(const_index(0))
            else:
                ranges.append(ctx.reduce_range(size))
                old_axes.append(ranges[-1])
            if keepdim:
                out_shape.append(1)
                out_axis += 1
        else:
            old_axes.append(axis(out_axis))
            out_shape.append(size)
            out_axis += 1
    element = x.reindex(tuple(out_shape), old_axes).body
    body = value(element, old_axes) if value is not None else element.cast(acc)
    if ranges:
        reduced = UOp(Ops.REDUCE, body.dtype, (body, *ranges), combine)
        if (select := pm_one_hot_sums.rewrite(reduced)) is not None:  # Note: a one-hot sum is a select
            body = select
        elif (unrolled := unrolled_sum(body, ranges, combine)) is not None:
            body = unrolled
        elif _splits_into_parts(ctx, body, ranges, combine, out_shape):
            body = split_sum(ctx, body, ranges)
        else:
            body = reduced
    return TensorValue(tuple(out_shape), body.dtype, body)


# Note: a short sum unrolled
# A sum over a few static positions (GQA's backward adds the gradients of the 2 to 8 query heads
# that share a key head: a (4, 8, 2, 1024, 64) tensor summed over its 2) is a pointwise sum of
# those few values. As a REDUCE it is a reduction kernel of its own: on an H100 it moved 24 MB in
# 21 us (1.1 TB/s, a third of copy speed), and the permute that reads it is a second kernel. As
# a pointwise sum it is fused into its reader. The sum keeps the REDUCE's dtype (float sums in
# double) and adds in order, as the reduction loop did. Only cheap values are written out: a
# reader may compute the sum again for each of its elements (a softmax's exponential sum over 8
# would be 8 exponentials per element: no transcendental is written out), and a value holding a
# reduction stays in the loop that the scheduler's patterns know (Note: a row's exponential sum in
# one pass).
UNROLLED_SUM_MAX = 8  # positions: up to this many loads are cheaper than a loop's set-up
UNROLLED_SUM_OPS = 4  # arithmetic ops of the summed value, at most
_NOT_ARITHMETIC = NOT_ARITHMETIC | {Ops.AXIS, Ops.CAST}
_KEPT_IN_LOOPS = {Ops.REDUCE, Ops.SCAN} | TRANSCENDENTAL_OPS


def unrolled_sum(body: UOp, ranges: list[UOp], combine: Ops) -> UOp | None:
    """The sum of `body` over `ranges` written out when their static extents hold at most
    UNROLLED_SUM_MAX positions and `body` is cheap (Note: a short sum unrolled); None otherwise."""
    extents = _static_extents(ranges)
    if combine is not Ops.ADD or extents is None or math.prod(extents) > UNROLLED_SUM_MAX:
        return None
    nodes = body.toposort
    arithmetic = sum(1 for u in nodes if u.op not in _NOT_ARITHMETIC and u.dtype.kind != "index")
    if arithmetic > UNROLLED_SUM_OPS or any(u.op in _KEPT_IN_LOOPS for u in nodes):
        return None
    total = None
    for position in itertools.product(*(range(n) for n in extents)):
        value = substitute(body, {r: const_index(i) for r, i in zip(ranges, position)})
        total = value if total is None else total + value
    return total


# Note: a long sum in parts
# A float sum of a whole tensor into one value is one chain of additions: C++ kernels vectorize
# it (`omp simd reduction`, one accumulator per vector lane) but every vector add waits for the
# previous one (4 cycles on AVX-512), and with the conversion to double each element costs more
# than reading it: x.sum() of 16M floats took 6.8 ms of one core's time where eager's took 3.0
# (a busy 2-core machine). Summed as SUM_PARTS reductions over consecutive parts of the outermost
# reduced dim, added at the end, the parts' accumulators share one loop (Note: shared reduce
# loops, codegen/shared_loops.py) and their chains run side by side: 4.0 ms. The parts are still
# summed in double, each in order, so the result moves by rounding of double partial sums only.
# C++ kernels only (`ordered_reductions`): Triton splits such sums over programs (Note: split
# reductions, lower/split_reductions.py).
SUM_PARTS = 4
SUM_PARTS_MIN = 1 << 15  # shorter sums: the chain's latency is a few microseconds at most


def _splits_into_parts(ctx: LoweringContext, body: UOp, ranges: list[UOp], combine: Ops, out_shape: list) -> bool:
    """Whether a REDUCE of `body` over `ranges` to `out_shape` is summed in parts (Note: a long sum in parts)."""
    if not ctx.ordered_reductions or combine is not Ops.ADD or not body.dtype.is_float:
        return False
    extents = _static_extents(ranges)
    if extents is None or any(not isinstance(n, int) or n != 1 for n in out_shape):
        return False
    return math.prod(extents) >= SUM_PARTS_MIN and extents[0] % SUM_PARTS == 0


def _static_extents(ranges: list[UOp]) -> list[int] | None:
    extents = [r.src[0].static_size for r in ranges]
    return None if any(n is None for n in extents) else [n for n in extents if n is not None]


def split_sum(ctx: LoweringContext, body: UOp, ranges: list[UOp]) -> UOp:
    """The sum of `body` over `ranges` (static extents) as SUM_PARTS sums over consecutive parts of
    ranges[0], added."""
    extents = _static_extents(ranges)
    assert extents is not None, "split_sum needs static extents (_splits_into_parts checks)"
    part = extents[0] // SUM_PARTS
    parts = []
    for k in range(SUM_PARTS):
        fresh = [ctx.reduce_range(part)] + [ctx.reduce_range(n) for n in extents[1:]]
        mapping = {ranges[0]: fresh[0] + k * part, **dict(zip(ranges[1:], fresh[1:]))}
        parts.append(UOp(Ops.REDUCE, body.dtype, (substitute(body, mapping), *fresh), Ops.ADD))
    while len(parts) > 1:  # added pairwise
        parts = [a + b for a, b in zip(parts[0::2], parts[1::2])] + parts[len(parts) - len(parts) % 2 :]
    return parts[0]


def refuse_empty_reduction(x: TensorValue, dims: list[int], op: str) -> None:
    """A max-like reduction over a dim of size 0 has no identity and raises in eager: the
    fallback reports it. Reducing an empty tensor over non-empty dims gives an empty result."""
    if any(x.shape[d] == 0 for d in dims):
        raise Unsupported(f"{op} over a dim of size 0 raises in eager")


def count(x: TensorValue, dims: list[int]) -> int:
    return math.prod(x.shape[d] for d in dims)


def accumulator(dtype: DType) -> DType:
    """Float sums accumulate in double: an exact-enough sequential sum; integers in int64."""
    if dtype.is_float:
        return dtypes.float64
    return dtypes.int64


def result_dtype(node: torch.fx.Node) -> DType:
    return from_torch(out_meta(node).dtype)


@register(aten.sum.dim_IntList, aten.sum.default)
def lower_sum(ctx, node, x: TensorValue, dims=None, keepdim=False, *, dtype=None) -> TensorValue:
    out = result_dtype(node)
    total = reduce(ctx, x, reduced_dims(x, dims), keepdim, Ops.ADD, accumulator(out))
    return total.with_body(total.body.cast(out))


@register(aten.mean.dim, aten.mean.default)
def lower_mean(ctx, node, x: TensorValue, dims=None, keepdim=False, *, dtype=None) -> TensorValue:
    out = result_dtype(node)
    dims = reduced_dims(x, dims)
    total = reduce(ctx, x, dims, keepdim, Ops.ADD, accumulator(out))
    mean = total.body.alu(Ops.FDIV, UOp.const(total.dtype, count(x, dims)))
    return total.with_body(mean.cast(out))


@register(aten.prod.dim_int, aten.prod.default)
def lower_prod(ctx, node, x: TensorValue, dim=None, keepdim=False, *, dtype=None) -> TensorValue:
    out = result_dtype(node)
    total = reduce(ctx, x, reduced_dims(x, dim), keepdim, Ops.MUL, out if out.is_float else dtypes.int64)
    return total.with_body(total.body.cast(out))


@register(aten.amax.default, aten.amin.default)
def lower_amax_amin(ctx, node, x: TensorValue, dims=(), keepdim=False) -> TensorValue:
    dims = reduced_dims(x, dims)
    refuse_empty_reduction(x, dims, "amax/amin")
    combine = Ops.MAX if node.target is aten.amax.default else Ops.MIN
    return reduce(ctx, x, dims, keepdim, combine, x.dtype)


@register(aten.any.dim, aten.any.dims, aten.any.default, aten.all.dim, aten.all.dims, aten.all.default)
def lower_any_all(ctx, node, x: TensorValue, dims=None, keepdim=False) -> TensorValue:
    combine = Ops.MAX if node.target.overloadpacket is aten.any else Ops.MIN
    out = result_dtype(node)
    found = reduce(ctx, x, reduced_dims(x, dims), keepdim, combine, dtypes.bool)
    return found.with_body(found.body.cast(out))


def arg_extreme(ctx, x: TensorValue, dim: int, keepdim: bool, combine: Ops) -> TensorValue:
    """The first index of the max (min) along `dim`; the first NaN wins, as in eager."""
    if x.ndim == 0:  # the scalar is its own extreme
        return TensorValue((), dtypes.int64, UOp.const(dtypes.int64, 0))
    extreme = reduce(ctx, x, [dim], True, combine, x.dtype)
    size = x.shape[dim]

    def first_hit(element: UOp, index: list[UOp]) -> UOp:
        hit = element.alu(Ops.CMPEQ, read_keepdim(extreme, index, [dim]))
        if element.dtype.is_float:
            hit = hit.alu(Ops.OR, element.alu(Ops.ISNAN))
        return hit.where(index[dim].cast(dtypes.int64), UOp.const(dtypes.int64, size))

    return reduce(ctx, x, [dim], keepdim, Ops.MIN, dtypes.int64, value=first_hit)


def read_keepdim(reduced: TensorValue, index: list[UOp], dims: list[int]) -> UOp:
    """A keepdim=True reduction result read at `index` (an index per input dim)."""
    return reduced.reindex(reduced.shape, [const_index(0) if d in dims else i for d, i in enumerate(index)]).body


@register(aten.argmax.default, aten.argmin.default)
def lower_argmax(ctx, node, x: TensorValue, dim=None, keepdim=False) -> TensorValue:
    refuse_empty_reduction(x, reduced_dims(x, dim), "argmax/argmin")
    combine = Ops.MAX if node.target is aten.argmax.default else Ops.MIN
    if dim is None:
        flat = x.reindex((x.numel,), _flat_axes(x)) if x.ndim != 1 else x
        result = arg_extreme(ctx, flat, 0, False, combine)
        return result if not keepdim else result.reindex((1,) * x.ndim, [])
    return arg_extreme(ctx, x, dim % max(x.ndim, 1), keepdim, combine)


def _flat_axes(x: TensorValue) -> list[UOp]:
    strides, running = [], 1
    for s in reversed(x.shape):
        strides.append(running)
        running *= s
    return [(axis(0) // st) % sz for sz, st in zip(x.shape, reversed(strides))]


@register(aten.max.dim, aten.min.dim)
def lower_max_dim(ctx, node, x: TensorValue, dim: int, keepdim=False) -> tuple[TensorValue, TensorValue]:
    refuse_empty_reduction(x, reduced_dims(x, dim), "max/min")
    combine = Ops.MAX if node.target is aten.max.dim else Ops.MIN
    dim = dim % max(x.ndim, 1)
    values = reduce(ctx, x, [dim], keepdim, combine, x.dtype)
    return values, arg_extreme(ctx, x, dim, keepdim, combine)


@register(aten.max.default, aten.min.default)
def lower_max_all(ctx, node, x: TensorValue) -> TensorValue:
    refuse_empty_reduction(x, reduced_dims(x, None), "max/min")
    combine = Ops.MAX if node.target is aten.max.default else Ops.MIN
    return reduce(ctx, x, reduced_dims(x, None), False, combine, x.dtype)


def variance(ctx, x: TensorValue, dims: list[int], correction: float, keepdim: bool) -> tuple[UOp, TensorValue]:
    """Two passes (mean, then squared deviations) in double: as accurate as eager's Welford.
    The mean's pass shares its loop with other statistics of the rows, the deviations' pass
    with those that read them (Note: shared reduce loops, codegen/shared_loops.py)."""
    n = count(x, dims)
    mean = reduce(ctx, x, dims, True, Ops.ADD, dtypes.float64)
    mean_body = mean.body.alu(Ops.FDIV, UOp.const(dtypes.float64, n))
    mean_value = mean.with_body(mean_body)

    def squared_deviation(element: UOp, index: list[UOp]) -> UOp:
        centered = element.cast(dtypes.float64) - read_keepdim(mean_value, index, dims)
        return centered * centered

    total = reduce(ctx, x, dims, keepdim, Ops.ADD, dtypes.float64, value=squared_deviation)
    var = total.body.alu(Ops.FDIV, UOp.const(dtypes.float64, max(n - correction, 0)))
    mean_value = welford_mean_of_infinities(ctx, x, dims, mean_value)
    mean_out = mean_value if keepdim else mean_value.reindex(total.shape, _squeeze_axes(mean_value.shape, dims))
    return var, TensorValue(total.shape, dtypes.float64, mean_out.body)


def welford_mean_of_infinities(ctx, x: TensorValue, dims: list[int], mean: TensorValue) -> TensorValue:
    """The mean var_mean reports, as eager's Welford walk gives it: an infinity anywhere but at
    the last reduced position (in logical order) meets a later element as `x - inf` and makes the
    mean NaN; a lone infinity at the last position leaves it infinite (the sum's mean otherwise).
    Counting the infinities is one more accumulator in the mean's loop (Note: shared reduce loops).
    Only for a backend whose reductions fold in eager's order (C++ loops): block reductions (and
    the split variance, lower/split_reductions.py) keep the sum's mean."""
    if not ctx.ordered_reductions or any(x.shape[d] == 0 for d in dims):
        return mean  # (no element: the mean is 0/0 already)
    is_infinite = lambda e, _: e.alu(Ops.ISINF).cast(dtypes.float64)  # noqa: E731
    infinities = reduce(ctx, x, dims, True, Ops.ADD, dtypes.float64, value=is_infinite)
    last_axes = [const_index(x.shape[d] - 1) if d in dims else axis(d) for d in range(x.ndim)]
    last_is_infinite = x.reindex(mean.shape, last_axes).body.alu(Ops.ISINF)
    one = UOp.const(dtypes.float64, 1.0)
    lone_and_last = infinities.body.alu(Ops.CMPEQ, one).alu(Ops.AND, last_is_infinite)
    walked_past = infinities.body.alu(Ops.CMPLT, one).alu(Ops.OR, lone_and_last).alu(Ops.NOT)
    return mean.with_body(walked_past.where(UOp.const(dtypes.float64, math.nan), mean.body))


def _squeeze_axes(shape: tuple[int, ...], dims: list[int]) -> list[UOp]:
    old_axes, out_axis = [], 0
    for d in range(len(shape)):
        if d in dims:
            old_axes.append(const_index(0))
        else:
            old_axes.append(axis(out_axis))
            out_axis += 1
    return old_axes


@register(aten.var.correction, aten.var_mean.correction, aten.std.correction, aten.std_mean.correction)
def lower_var(ctx, node, x: TensorValue, dims=None, *, correction=None, keepdim=False):
    if not x.dtype.is_float:
        raise Unsupported("var/std of integers")
    dims = reduced_dims(x, dims)
    var, mean = variance(ctx, x, dims, 1 if correction is None else correction, keepdim)
    packet = node.target.overloadpacket
    if packet in (aten.std, aten.std_mean):
        var = var.alu(Ops.SQRT)
    out = from_torch(node.meta["val"][0].dtype if isinstance(node.meta["val"], tuple) else node.meta["val"].dtype)
    result = TensorValue(mean.shape, out, var.cast(out))
    if packet in (aten.var_mean, aten.std_mean):
        return result, TensorValue(mean.shape, out, mean.body.cast(out))
    return result


@register(aten.linalg_vector_norm.default)
def lower_vector_norm(ctx, node, x: TensorValue, ord=2, dims=None, keepdim=False, *, dtype=None) -> TensorValue:
    out = result_dtype(node)
    dims = reduced_dims(x, dims)
    acc = dtypes.float64
    if ord in (math.inf, -math.inf):
        refuse_empty_reduction(x, dims, "inf-norm")
        norm = reduce(ctx, x, dims, keepdim, Ops.MAX if ord > 0 else Ops.MIN, acc,
                      value=lambda e, _: e.cast(acc).alu(Ops.ABS))  # fmt: skip
        return norm.with_body(norm.body.cast(out))
    if ord == 0:
        norm = reduce(ctx, x, dims, keepdim, Ops.ADD, acc,
                      value=lambda e, _: e.alu(Ops.CMPNE, e.const_like(0)).cast(acc))  # fmt: skip
        return norm.with_body(norm.body.cast(out))
    p = float(ord)
    powered = lambda e, _: e.cast(acc).alu(Ops.ABS).alu(Ops.POW, UOp.const(acc, p))  # noqa: E731
    total = reduce(ctx, x, dims, keepdim, Ops.ADD, acc, value=powered)
    root = total.body.alu(Ops.SQRT) if p == 2 else total.body.alu(Ops.POW, UOp.const(acc, 1 / p))
    return total.with_body(root.cast(out))
