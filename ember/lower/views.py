"""Lowerings of view ops and constants. Views fold into index expressions (values.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ember.ir import Layout, same_sizes
from ember.lower.context import LoweringContext
from ember.lower.pointwise import out_meta
from ember.lower.registry import Unsupported, register
from ember.lower.values import (
    TensorValue,
    as_strided_read,
    axis,
    broadcast_to,
    const_index,
    constant,
    load,
    permute,
    reshape,
    select,
    slice_dim,
    unsqueeze,
)
from ember.uop.dtypes import dtypes, from_torch
from ember.uop.ops import Ops, UOp
from ember.uop.variables import index_size, known_zero

aten = torch.ops.aten


def _dim(d: int, ndim: int) -> int:
    return d % max(ndim, 1)


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def lower_view(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, shape) -> TensorValue:
    return symbolic_view(ctx, node, x) or reshape(x, tuple(out_meta(node).shape))


def symbolic_view(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue) -> TensorValue | None:
    """A view with symbolic sizes (Note: symbolic sizes) of a plain strided read of a buffer laid
    out as eager lays out the viewed tensor: a read of that buffer in eager's layout of the view.
    `reshape` recovers each old axis from the flat index by divisions by symbolic sizes, which
    the simplifier cannot fold back into strides; a matmul or attention extern reading the view
    (a (batch, heads, seq, dim) tensor as (batch * heads, seq, dim)) would copy it first."""
    out, base = out_meta(node), node.args[0].meta.get("val")
    if not isinstance(base, torch.Tensor) or all(type(s) is int for s in tuple(out.shape) + tuple(base.shape)):
        return None  # (static sizes: reshape's index math folds)
    read = as_strided_read(x)
    if read is None or (node.target is aten.reshape.default and not _dense_in_order(base)):
        return None
    name, layout = read
    if not strides_of_eager(layout.stride, base) or not same_sizes((out.storage_offset(),), (base.storage_offset(),)):
        return None
    return load(ctx.buffers[name], Layout(tuple(out.shape), tuple(out.stride()), layout.offset))


def _dense_in_order(meta: torch.Tensor) -> bool:
    """Whether `meta` is row-major (dims of size 0 or 1 aside), so that any reshape of it is a view.
    A reshape of another layout (a channels-last convolution's result, flattened) may copy it into
    a contiguous result, whose strides say nothing of the buffer it was read from. Compared as
    expressions, so no guard is added on a symbolic size."""
    expected: Any = 1
    for size, stride in reversed(list(zip(meta.shape, meta.stride()))):
        if type(size) is int and size <= 1:
            continue
        if not same_sizes((stride,), (expected,)):
            return False
        expected = expected * size
    return True


def strides_of_eager(strides: tuple, meta: torch.Tensor) -> bool:
    """Whether `strides` are eager's for `meta` where they matter: a dim of size 0 or 1 takes any
    stride (a symbolic size is neither: dynamo specializes 0 and 1)."""
    moving = [i for i, n in enumerate(meta.shape) if not (type(n) is int and n <= 1)]
    return same_sizes(tuple(strides[i] for i in moving), tuple(meta.stride()[i] for i in moving))


@register(aten.permute.default)
def lower_permute(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, dims) -> TensorValue:
    return permute(x, list(dims))


@register(aten.t.default, aten.transpose.int)
def lower_transpose(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, dim0=0, dim1=1) -> TensorValue:
    if x.ndim < 2:
        return x
    dims = list(range(x.ndim))
    d0, d1 = _dim(dim0, x.ndim), _dim(dim1, x.ndim)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return permute(x, dims)


@register(aten.expand.default)
def lower_expand(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, size, implicit=False) -> TensorValue:
    return broadcast_to(x, tuple(out_meta(node).shape))


@register(aten.slice.Tensor)
def lower_slice(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, dim=0, start=None, end=None, step=1):
    if x.ndim == 0:
        raise Unsupported("slice of a 0-d tensor")
    d = _dim(dim, x.ndim)
    if any(isinstance(v, torch.SymInt) for v in (start, end, x.shape[d])):  # Note: symbolic sizes
        return symbolic_slice(x, d, start, step, out_meta(node).shape[d])
    return slice_dim(x, d, start, end, step)


def symbolic_slice(x: TensorValue, dim: int, start, step: int, length) -> TensorValue:
    """x[..., start::step, ...] of `length` (the meta's, clamped as eager clamps) where a size or a
    bound is symbolic: a start known non-negative, or a negative constant -k counted from the end
    where the size is known to be at least k (x[:, -1:], the last row: size - k); otherwise Python's
    clamping would need the size's value, and aten's slice runs it."""
    start = symbolic_slice_start(x.shape[dim], start)
    old_axes = [axis(i) for i in range(x.ndim)]
    old_axes[dim] = axis(dim) * step + start
    return x.reindex(x.shape[:dim] + (length,) + x.shape[dim + 1 :], old_axes)


def symbolic_slice_start(size, start) -> int | UOp:
    """Where x[start:] begins along a dim of `size` when a size or the bound is symbolic (as
    `symbolic_slice` reads it): a start known non-negative, or -k counted from the end where the
    size is known to be at least k; else Unsupported."""
    start = index_size(0 if start is None else start)
    size = index_size(size)
    if isinstance(start, int) and start < 0 and (size if isinstance(size, int) else size.vmin) >= -start:
        start = size + start
    if (start if isinstance(start, int) else start.vmin) < 0:
        raise Unsupported("a negative slice start of a symbolic size")
    return start


@register(aten.select.int)
def lower_select(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, dim: int, index: int) -> TensorValue:
    return select(x, _dim(dim, x.ndim), index)


@register(aten.unsqueeze.default)
def lower_unsqueeze(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, dim: int) -> TensorValue:
    return unsqueeze(x, dim % (x.ndim + 1))


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def lower_squeeze(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, dims=None) -> TensorValue:
    return reshape(x, tuple(out_meta(node).shape))


@register(aten.as_strided.default)
def lower_as_strided(ctx: LoweringContext, node, x: TensorValue, size, stride, storage_offset=None) -> TensorValue:
    """as_strided indexes the input's storage: expressible when the input is a buffer (or is
    realized into one) whose storage layout eager would share."""
    base_meta = node.args[0].meta.get("val")
    if not isinstance(base_meta, torch.Tensor) or not base_meta.is_contiguous():
        raise Unsupported("as_strided of a non-contiguous input")
    ref = ctx.realize(x, node.name)
    if not strides_of_eager(ref.layout.stride, base_meta) or ref.layout.offset != 0:
        raise Unsupported("as_strided of a value whose storage differs from eager's")
    offset = (storage_offset if storage_offset is not None else base_meta.storage_offset()) - base_meta.storage_offset()
    return load(ctx.buffers[ref.name], Layout(tuple(size), tuple(stride), offset))


@register(aten.full.default)
def lower_full(ctx: LoweringContext, node: torch.fx.Node, size, value, **kwargs) -> TensorValue:
    meta = out_meta(node)
    return constant(value, from_torch(meta.dtype), tuple(meta.shape))


@register(aten.scalar_tensor.default)
def lower_scalar_tensor(ctx: LoweringContext, node: torch.fx.Node, value, **kwargs) -> TensorValue:
    return constant(value, from_torch(out_meta(node).dtype))


@register(aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.empty_strided.default)
def lower_zeros_ones(ctx: LoweringContext, node: torch.fx.Node, size, *args, **kwargs) -> TensorValue:
    # empty's contents are unspecified: zeros is a valid, deterministic choice
    meta = out_meta(node)
    value = 1 if node.target is aten.ones.default else 0
    return constant(value, from_torch(meta.dtype), tuple(meta.shape))


@register(aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default)
def lower_like(ctx: LoweringContext, node: torch.fx.Node, x, *args, **kwargs) -> TensorValue:
    meta = out_meta(node)
    value = {aten.ones_like.default: 1, aten.full_like.default: args[0] if args else None}.get(node.target, 0)
    return constant(value, from_torch(meta.dtype), tuple(meta.shape))


@register(aten.arange.start_step, aten.arange.default, aten.arange.start)
def lower_arange(ctx: LoweringContext, node: torch.fx.Node, *args, **kwargs) -> TensorValue:
    meta = out_meta(node)
    numbers = list(args) + [None] * (3 - len(args))
    if node.target is aten.arange.default:
        start, step = 0, 1
    else:
        start, step = numbers[0], numbers[2] if numbers[2] is not None else 1
    dtype = from_torch(meta.dtype)
    compute = dtypes.float64 if dtype.is_float else dtypes.int64
    i = axis(0).cast(compute)
    body = (i * UOp.const(compute, step) + UOp.const(compute, start)).cast(dtype)
    return TensorValue(tuple(meta.shape), dtype, body if meta.numel() else UOp.const(dtype, 0))


@register(aten.diagonal.default)
def lower_diagonal(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, offset=0, dim1=0, dim2=1):
    """The diagonal of dims (dim1, dim2) becomes the last dim: x[..., i, i + offset, ...]."""
    d1, d2 = _dim(dim1, x.ndim), _dim(dim2, x.ndim)
    if d1 == d2:
        raise Unsupported("diagonal of a dim with itself")
    out_shape = tuple(out_meta(node).shape)
    kept = [d for d in range(x.ndim) if d not in (d1, d2)]
    old_axes = [const_index(0)] * x.ndim
    for new, old in enumerate(kept):
        old_axes[old] = axis(new)
    i = axis(len(kept))
    old_axes[d1] = i + max(-offset, 0)
    old_axes[d2] = i + max(offset, 0)
    return x.reindex(out_shape, old_axes)


@register(aten.unfold.default)
def lower_unfold(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, dimension: int, size: int, step: int):
    """Windows of `size` every `step` along `dimension`; the position in a window is a new last dim."""
    out_shape = tuple(out_meta(node).shape)
    if x.ndim == 0:
        return x.reindex(out_shape, [])
    d = _dim(dimension, x.ndim)
    old_axes = [axis(i) for i in range(x.ndim)]
    old_axes[d] = axis(d) * step + axis(x.ndim)
    return x.reindex(out_shape, old_axes)


@register(aten.empty_permuted.default)
def lower_empty_permuted(ctx: LoweringContext, node: torch.fx.Node, size, physical_layout, **kwargs) -> TensorValue:
    # empty's contents are unspecified: zeros is a valid, deterministic choice
    meta = out_meta(node)
    return constant(0, from_torch(meta.dtype), tuple(meta.shape))


@register(aten.diagonal_scatter.default)
def lower_diagonal_scatter(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, src, offset=0, dim1=0, dim2=1):
    """x with its diagonal (as `diagonal` takes it) replaced by src: an elementwise select."""
    d1, d2 = _dim(dim1, x.ndim), _dim(dim2, x.ndim)
    if d1 == d2 or not isinstance(src, TensorValue):
        raise Unsupported("diagonal_scatter of a dim with itself")
    if known_zero(src.numel):  # an empty diagonal: nothing to replace
        return x
    kept = [d for d in range(x.ndim) if d not in (d1, d2)]
    i = axis(d1) - max(-offset, 0)  # the position along the diagonal
    src_axes = [axis(d) for d in kept] + [i]
    on_diagonal = (axis(d2) - axis(d1)).alu(Ops.CMPEQ, const_index(offset))
    on_diagonal = on_diagonal.alu(Ops.AND, const_index(-1).lt(i)).alu(Ops.AND, i.lt(const_index(src.shape[-1])))
    clamped = i.alu(Ops.MAX, const_index(0)).alu(Ops.MIN, const_index(src.shape[-1] - 1))
    src_value = src.reindex(x.shape, src_axes[:-1] + [clamped]).body.cast(x.dtype)
    return TensorValue(x.shape, x.dtype, on_diagonal.where(src_value, x.body))
