"""Lowerings of pooling as windowed reductions: avg_pool2d/3d and their backward,
max_pool2d/3d with indices, adaptive average pooling in 3-d (2-d comes from torch's
decomposition) and its backward in 2-d and 3-d, adaptive max pooling with indices.

Note: pooling windows
    A pooling output element reduces over a window of its input: one reduce range per
    pooled dim, of the window's largest size. Input position = window start + range (times
    the dilation). Where
    a window is smaller (padding, adaptive windows of uneven size) the position is masked
    (the identity of the reduction) and the read is clamped into the input, since a kernel
    reads every operand of a `where`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx

from ember.lower.context import LoweringContext
from ember.lower.pointwise import out_meta
from ember.lower.registry import Unsupported, register
from ember.lower.values import TensorValue, axis, const_index, constant
from ember.uop.dtypes import DType, dtypes, from_torch
from ember.uop.ops import Ops, UOp
from ember.uop.variables import known_zero

aten = torch.ops.aten


def _all(conditions: list[UOp]) -> UOp:
    result = UOp.const(dtypes.bool, True)
    for c in conditions:
        result = result.alu(Ops.AND, c)
    return result


def _clamp(i: UOp, size: int) -> UOp:
    return i.alu(Ops.MAX, const_index(0)).alu(Ops.MIN, const_index(size - 1))


def windowed(ctx: LoweringContext, x: TensorValue, out_shape: tuple[int, ...], spans: list[int],
             start: Callable[[int, UOp], UOp], end: Callable[[int, UOp], UOp] | None = None,
             dilation: list[int] | None = None):  # fmt: skip
    """For the last len(spans) dims of `x`: (element, valid, positions, ranges) of a window
    whose input position along pooled dim d is start(d, out axis) + range d * dilation d,
    valid below end(d, out axis) and inside the input (Note: pooling windows)."""
    lead = x.ndim - len(spans)
    ranges = [ctx.reduce_range(span) if span > 1 else const_index(0) for span in spans]
    positions, valid, old_axes = [], [], [axis(i) for i in range(lead)]
    for d, r in enumerate(ranges):
        size, o = x.shape[lead + d], axis(lead + d)
        position = start(d, o) + (r * dilation[d] if dilation else r)
        positions.append(position)
        valid += [const_index(-1).lt(position), position.lt(const_index(size))]
        if end is not None:
            valid.append(position.lt(end(d, o)))
        old_axes.append(_clamp(position, size))
    element = x.reindex(out_shape, old_axes).body
    return element, _all(valid), positions, [r for r in ranges if r.op is Ops.RANGE]


def reduce_window(body: UOp, ranges: list[UOp], combine: Ops) -> UOp:
    return UOp(Ops.REDUCE, body.dtype, (body, *ranges), combine) if ranges else body


def _tuple(value, n: int) -> list[int]:
    value = [value] if isinstance(value, int) else list(value)
    return value * n if len(value) == 1 else value


@dataclass(frozen=True)
class AvgPoolWindows:
    """avg_pool's windows along the last `n` dims of an input of `sizes` (ATen's geometry)."""

    sizes: tuple[int, ...]
    kernel: list[int]
    step: list[int]
    pad: list[int]
    count_include_pad: bool
    divisor_override: int | None

    @staticmethod
    def of(sizes, kernel_size, stride, padding, count_include_pad, divisor_override) -> AvgPoolWindows:
        n = len(sizes)
        kernel = _tuple(kernel_size, n)
        step = _tuple(stride, n) if stride else kernel
        return AvgPoolWindows(tuple(sizes), kernel, step, _tuple(padding, n), count_include_pad, divisor_override)

    def start(self, d: int, o: UOp) -> UOp:
        return o * self.step[d] - self.pad[d]

    def end(self, d: int, o: UOp) -> UOp:
        return (self.start(d, o) + self.kernel[d]).alu(Ops.MIN, const_index(self.sizes[d] + self.pad[d]))

    def divisor(self, out_axes: list[UOp], dtype: DType = dtypes.float64) -> UOp:
        """What the window at output position `out_axes` (one per pooled dim) divides by."""
        if self.divisor_override:
            return UOp.const(dtype, self.divisor_override)
        divisor = UOp.const(dtypes.index, 1)
        for d, o in enumerate(out_axes):
            low, high = self.start(d, o), self.end(d, o)
            if not self.count_include_pad:
                low, high = low.alu(Ops.MAX, const_index(0)), high.alu(Ops.MIN, const_index(self.sizes[d]))
            divisor = divisor * (high - low)
        return divisor.cast(dtype)


@register(aten.avg_pool2d.default, aten.avg_pool3d.default)
def lower_avg_pool(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, kernel_size, stride=(), padding=0,
                   ceil_mode=False, count_include_pad=True, divisor_override=None) -> TensorValue:  # fmt: skip
    n = 2 if node.target is aten.avg_pool2d.default else 3
    meta = out_meta(node)
    out_shape, out = tuple(meta.shape), from_torch(meta.dtype)
    if math.prod(out_shape) == 0:
        return constant(0, out, out_shape)
    pool = AvgPoolWindows.of(x.shape[-n:], kernel_size, stride, padding, count_include_pad, divisor_override)
    element, valid, _, ranges = windowed(ctx, x, out_shape, pool.kernel, pool.start, pool.end)
    acc = dtypes.float64 if out.is_float else dtypes.int64  # integers: ATen's int64 sum and C division
    total = reduce_window(valid.where(element.cast(acc), UOp.const(acc, 0)), ranges, Ops.ADD)
    divisor = pool.divisor([axis(x.ndim - n + d) for d in range(n)], acc)
    return TensorValue(out_shape, out, total.alu(Ops.FDIV if out.is_float else Ops.IDIV, divisor).cast(out))


@register(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)
def lower_avg_pool_backward(ctx: LoweringContext, node: torch.fx.Node, grad: TensorValue, x: TensorValue, kernel_size,
                            stride, padding, ceil_mode, count_include_pad, divisor_override=None):  # fmt: skip
    """grad_input at i sums grad / divisor over the windows covering i: outputs o from
    (i + pad) // step down, while o * step - pad + kernel > i (a reduction over them)."""
    n = 2 if node.target is aten.avg_pool2d_backward.default else 3
    meta = out_meta(node)
    in_shape, out = tuple(meta.shape), from_torch(meta.dtype)
    if not out.is_float:
        raise Unsupported("avg_pool backward of integers")
    if known_zero(math.prod(in_shape)) or known_zero(grad.numel):
        return constant(0, out, in_shape)
    pool = AvgPoolWindows.of(x.shape[-n:], kernel_size, stride, padding, count_include_pad, divisor_override)
    lead, out_sizes = x.ndim - n, grad.shape[-n:]
    old_axes, valid, out_axes, ranges = [axis(i) for i in range(lead)], [], [], []
    for d in range(n):
        i = axis(lead + d)
        span = -(-pool.kernel[d] // pool.step[d])
        r = ctx.reduce_range(span) if span > 1 else const_index(0)
        ranges += [r] if span > 1 else []
        o = (i + pool.pad[d]) // pool.step[d] - r
        valid += [const_index(-1).lt(o), o.lt(const_index(out_sizes[d])), i.lt(pool.start(d, o) + pool.kernel[d])]
        old_axes.append(_clamp(o, out_sizes[d]))
        out_axes.append(_clamp(o, out_sizes[d]))
    element = grad.reindex(in_shape, old_axes).body.cast(dtypes.float64)
    share = element.alu(Ops.FDIV, pool.divisor(out_axes))
    total = reduce_window(_all(valid).where(share, UOp.const(dtypes.float64, 0.0)), ranges, Ops.ADD)
    return TensorValue(in_shape, out, total.cast(out))


def adaptive_start(o: UOp, size: int, out_size: int) -> UOp:
    return (o * size) // out_size  # floor(o * size / out_size)


def adaptive_end(o: UOp, size: int, out_size: int) -> UOp:
    return ((o + 1) * size + (out_size - 1)) // out_size  # ceil((o + 1) * size / out_size)


def adaptive_window(ctx: LoweringContext, x: TensorValue, out_shape: tuple[int, ...], n: int):
    sizes, outs = x.shape[-n:], out_shape[-n:]
    spans = [min(s, -(-s // o) + 1) if o else 1 for s, o in zip(sizes, outs)]
    start = lambda d, o: adaptive_start(o, sizes[d], outs[d])  # noqa: E731
    end = lambda d, o: adaptive_end(o, sizes[d], outs[d])  # noqa: E731
    return windowed(ctx, x, out_shape, spans, start, end), start, end


@register(aten._adaptive_avg_pool3d.default)
def lower_adaptive_avg_pool(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, output_size) -> TensorValue:
    n = 3
    meta = out_meta(node)
    out_shape, out = tuple(meta.shape), from_torch(meta.dtype)
    if not out.is_float:
        raise Unsupported("adaptive_avg_pool of integers")
    if math.prod(out_shape) == 0:
        return constant(0, out, out_shape)
    (element, valid, _, ranges), start, end = adaptive_window(ctx, x, out_shape, n)
    acc = dtypes.float64
    total = reduce_window(valid.where(element.cast(acc), UOp.const(acc, 0.0)), ranges, Ops.ADD)
    lead, count = x.ndim - n, UOp.const(dtypes.index, 1)
    for d in range(n):
        count = count * (end(d, axis(lead + d)) - start(d, axis(lead + d)))
    return TensorValue(out_shape, out, total.alu(Ops.FDIV, count.cast(acc)).cast(out))


def max_with_indices(x: TensorValue, n: int, window: Callable[[], tuple]) -> tuple[UOp, UOp]:
    """The maximum of each window and its flat index into the pooled plane, as ATen's
    loops: the first maximum, or the last NaN when the window has one (`val > max ||
    isnan(val)`). Each reduction gets its own window (reduce ranges are never shared)."""
    sizes = x.shape[-n:]

    def flat_window() -> tuple[UOp, UOp, UOp, list[UOp]]:
        element, valid, positions, ranges = window()
        flat = const_index(0)
        for d, p in enumerate(positions):
            flat = flat * sizes[d] + p
        return element, valid, flat.cast(dtypes.int64), ranges

    element, valid, _, ranges = flat_window()
    lowest = -math.inf if x.dtype.is_float else x.dtype.min
    maximum = reduce_window(valid.where(element, element.const_like(lowest)), ranges, Ops.MAX)
    none = UOp.const(dtypes.int64, -1)
    last_nan = none
    if x.dtype.is_float:
        element, valid, flat, ranges = flat_window()
        last_nan = reduce_window((valid.alu(Ops.AND, element.alu(Ops.ISNAN))).where(flat, none), ranges, Ops.MAX)
    element, valid, flat, ranges = flat_window()
    big = UOp.const(dtypes.int64, 2**62)
    first_max = reduce_window((valid.alu(Ops.AND, element.alu(Ops.CMPEQ, maximum))).where(flat, big), ranges, Ops.MIN)
    indices = none.alu(Ops.CMPLT, last_nan).where(last_nan, first_max)
    return maximum, indices


def _max_pool_outputs(node: torch.fx.Node, x: TensorValue) -> tuple[tuple[int, ...], tuple | None]:
    """The output shape, or the (empty) results when there is nothing to compute."""
    out_shape = tuple(node.meta["val"][0].shape)
    if x.dtype.is_bool:
        raise Unsupported("max pooling of bools")
    if math.prod(out_shape) == 0:
        return out_shape, (constant(0, x.dtype, out_shape), constant(0, dtypes.int64, out_shape))
    return out_shape, None


@register(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def lower_adaptive_max_pool(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, output_size):
    n = 2 if node.target is aten.adaptive_max_pool2d.default else 3
    if not x.dtype.is_float:
        raise Unsupported("adaptive max pooling of integers (eager has no kernel for them)")
    out_shape, empty = _max_pool_outputs(node, x)
    if empty is not None:
        return empty
    values, indices = max_with_indices(x, n, lambda: adaptive_window(ctx, x, out_shape, n)[0])
    return TensorValue(out_shape, x.dtype, values), TensorValue(out_shape, dtypes.int64, indices)


@register(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
def lower_max_pool(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, kernel_size, stride=(), padding=0,
                   dilation=1, ceil_mode=False):  # fmt: skip
    n = 2 if node.target is aten.max_pool2d_with_indices.default else 3
    kernel, pad, dilate = _tuple(kernel_size, n), _tuple(padding, n), _tuple(dilation, n)
    step = _tuple(stride, n) if stride else kernel
    out_shape, empty = _max_pool_outputs(node, x)
    if empty is not None:
        return empty
    start = lambda d, o: o * step[d] - pad[d]  # noqa: E731
    values, indices = max_with_indices(x, n, lambda: windowed(ctx, x, out_shape, kernel, start, dilation=dilate))
    return TensorValue(out_shape, x.dtype, values), TensorValue(out_shape, dtypes.int64, indices)


@register(aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default)
def lower_adaptive_avg_pool_backward(ctx: LoweringContext, node: torch.fx.Node, grad: TensorValue, x: TensorValue):
    """grad_input at i sums grad / window size over the outputs o whose window covers i:
    from the last o starting at or before i, down while the window still ends after i."""
    n = 2 if node.target is aten._adaptive_avg_pool2d_backward.default else 3
    meta = out_meta(node)
    in_shape, out = tuple(meta.shape), from_torch(meta.dtype)
    if not out.is_float:
        raise Unsupported("adaptive_avg_pool backward of integers")
    if known_zero(math.prod(in_shape)) or known_zero(grad.numel):
        return constant(0, out, in_shape)
    lead, sizes, outs = x.ndim - n, x.shape[-n:], grad.shape[-n:]
    old_axes, valid, ranges = [axis(i) for i in range(lead)], [], []
    count = UOp.const(dtypes.index, 1)
    for d in range(n):
        i = axis(lead + d)
        span = min(outs[d], -(-outs[d] // sizes[d]) + 1)
        r = ctx.reduce_range(span) if span > 1 else const_index(0)
        ranges += [r] if span > 1 else []
        o = ((i + 1) * outs[d] - 1) // sizes[d] - r  # the last window starting at or before i, minus r
        valid += [const_index(-1).lt(o), i.lt(adaptive_end(o, sizes[d], outs[d]))]
        o = _clamp(o, outs[d])
        old_axes.append(o)
        count = count * (adaptive_end(o, sizes[d], outs[d]) - adaptive_start(o, sizes[d], outs[d]))
    element = grad.reindex(in_shape, old_axes).body.cast(dtypes.float64)
    share = element.alu(Ops.FDIV, count.cast(dtypes.float64))
    total = reduce_window(_all(valid).where(share, UOp.const(dtypes.float64, 0.0)), ranges, Ops.ADD)
    return TensorValue(in_shape, out, total.cast(out))
