"""Lowerings of indexing and data movement: cat, split, pads, flip, repeat, gather,
index_select, advanced indexing (`aten.index.Tensor`), embedding, slice/select_scatter.

Every op here is a pure function of the output position, so each builds a `TensorValue`
body like a view does, by reindexing its inputs (Note: views are substitutions). The
difference is that a position may be computed from data: an index tensor's element is
loaded, cast to `dtypes.index`, and used in the input's reindex (an indirect LOAD).

Ops that write at computed positions (scatter, scatter_add, index_put, index_add,
masked_scatter) are in scatter.py (Note: stores at computed positions). Boolean masks in
`aten.index` (`x[mask]`) give a data-dependent shape and go to the fallback.

Note: reads must be in bounds
    A kernel may evaluate both sides of a WHERE: every UOp but a LOAD renders as its own
    statement, so a cast of a load, arithmetic on it, or a load shared with another use
    happens whichever side wins. cat, the pads and slice_scatter therefore clamp the position
    of every input they select from into that input's range.

Note: out-of-range indices
    Eager raises for an index outside [-size, size) (gather, index_select and embedding:
    outside [0, size)). Kernels cannot raise yet, so every index that comes from data is
    clamped into [0, size-1] (`data_index`): the read is always in bounds. What compile time can see goes to the aten
    fallback, which raises eager's error at run time: an index tensor that is a graph
    constant with a bad value, or a dim of size 0 indexed by a non-empty result.
    The clamped index is wrapped in a CHECK: the kernel sets its error flag where the index
    was out of range, and the wrapper raises IndexError after the call.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

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
    select,
    slice_dim,
)
from ember.lower.views import symbolic_slice_start
from ember.uop.dtypes import DType, dtypes, from_torch
from ember.uop.ops import CheckArg, Ops, UOp
from ember.uop.variables import index_size, known_zero

aten = torch.ops.aten


# ---- positions -----------------------------------------------------------------------------


def clamped(i: UOp, low: int, high: int | UOp) -> UOp:
    """`i` clamped into [low, high]; codegen drops a side that the loop bounds make redundant."""
    return i.alu(Ops.MAX, const_index(low)).alu(Ops.MIN, high if isinstance(high, UOp) else const_index(high))


def data_index(value: UOp, size: int, wrap_negative: bool, op: str = "indexing", kind: str = "IndexError") -> UOp:
    """An index loaded from data, as a safe position in a dim of `size` (Note: out-of-range
    indices); with `wrap_negative`, -size..-1 count from the end, as in Python. `kind`: the
    exception eager raises for this op."""
    given = i = value.cast(dtypes.index)
    if wrap_negative:
        i = i.lt(0).where(i + size, i)
    in_range = const_index(-1).alu(Ops.CMPLT, i).alu(Ops.AND, i.lt(size))
    error = CheckArg(kind, f"{op}: index {{value}} is out of bounds for a dimension of size {size}")
    return UOp(Ops.CHECK, dtypes.index, (clamped(i, 0, size - 1), in_range, given), error)


def identity_axes(ndim: int) -> list[UOp]:
    return [axis(i) for i in range(ndim)]


def normalized_dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def result(node: torch.fx.Node) -> tuple[tuple[int, ...], DType]:
    meta = out_meta(node)
    return tuple(meta.shape), from_torch(meta.dtype)


def refuse_unreadable(x: TensorValue, dims: list[int], out_numel: int, op: str) -> None:
    """A non-empty result read from a dim of size 0 must fail as in eager: the fallback raises."""
    if out_numel > 0 and any(x.shape[d] == 0 for d in dims):
        raise Unsupported(f"{op} of a dim of size 0: every index is out of range, as aten will report")


def refuse_bad_constant(ctx: LoweringContext, index: TensorValue, size: int, wrap_negative: bool, op: str) -> None:
    """An index tensor that is a graph constant is checked now; a bad value goes to the
    fallback, which raises eager's error (Note: out-of-range indices)."""
    read = as_strided_read(index)
    if read is None or ctx.buffers[read[0]].kind != "constant" or index.numel == 0:
        return
    name, layout = read
    stored = ctx.graph.constants[name]
    with unset_fake_temporarily():  # lowering runs under the tracer's fake mode; this tensor is real
        values = torch.as_strided(stored, layout.size, layout.stride, stored.storage_offset() + layout.offset)
        low, high = values.min().item(), values.max().item()
    if low < (-size if wrap_negative else 0) or high >= size:
        raise Unsupported(f"{op}: a constant index is out of range for a dim of size {size}, as aten will report")


def integer_index(index: TensorValue, op: str) -> None:
    """int64 and int32 index tensors are lowered; bool and uint8 ones are masks (data-dependent
    shapes), and aten reports any other dtype."""
    if index.dtype not in (dtypes.int64, dtypes.int32):
        raise Unsupported(f"{op} with {index.dtype} indices")


# ---- gathers: a position read from an index tensor -----------------------------------------


@register(aten.gather.default)
def lower_gather(ctx, node, x: TensorValue, dim: int, index: TensorValue, sparse_grad=False) -> TensorValue:
    """out[p] = x[p with p[dim] replaced by index[p]]; index may be smaller than x in every dim."""
    integer_index(index, "gather")
    if x.ndim == 0:
        return x.reindex(index.shape, [])
    dim = normalized_dim(dim, x.ndim)
    refuse_unreadable(x, [dim], index.numel, "gather")
    refuse_bad_constant(ctx, index, x.shape[dim], False, "gather")
    positions = identity_axes(x.ndim)
    positions[dim] = data_index(index.body, x.shape[dim], wrap_negative=False, op="gather", kind="RuntimeError")
    return x.reindex(index.shape, positions)


@register(aten.index_select.default)
def lower_index_select(ctx, node, x: TensorValue, dim: int, index: TensorValue) -> TensorValue:
    integer_index(index, "index_select")
    shape, _ = result(node)
    if x.ndim == 0:
        return x.reindex(shape, [])
    dim = normalized_dim(dim, x.ndim)
    refuse_unreadable(x, [dim], math.prod(shape), "index_select")
    refuse_bad_constant(ctx, index, x.shape[dim], False, "index_select")
    chosen = index.reindex(shape, [axis(dim)] if index.ndim == 1 else [])
    positions = identity_axes(x.ndim)
    positions[dim] = data_index(chosen.body, x.shape[dim], wrap_negative=False, op="index_select")
    return x.reindex(shape, positions)


@register(aten.embedding.default)
def lower_embedding(ctx, node, weight: TensorValue, indices: TensorValue, padding_idx=-1, scale_grad_by_freq=False,
                    sparse=False) -> TensorValue:  # fmt: skip
    """out[p..., j] = weight[indices[p...], j]; padding_idx only matters for the gradient."""
    integer_index(indices, "embedding")
    if weight.ndim != 2:
        raise Unsupported("embedding of a weight that is not 2-d")
    shape, _ = result(node)
    refuse_unreadable(weight, [0], math.prod(shape), "embedding")
    refuse_bad_constant(ctx, indices, weight.shape[0], False, "embedding")
    rows = indices.reindex(shape, identity_axes(indices.ndim))
    return weight.reindex(shape, [data_index(rows.body, weight.shape[0], False, "embedding"), axis(indices.ndim)])


@register(aten.index.Tensor)
def lower_index(ctx, node, x: TensorValue, indices) -> TensorValue:
    """x[i0, :, i2, ...] with integer index tensors (None: the whole dim). The index tensors
    broadcast together; their dims replace the indexed dims in place when those are
    adjacent, else they come first (numpy's rule)."""
    indexed = [d for d, i in enumerate(indices) if i is not None]
    for d in indexed:
        integer_index(indices[d], "index")
    shape, _ = result(node)
    if not indexed:
        return x
    refuse_unreadable(x, indexed, math.prod(shape), "index")
    for d in indexed:
        refuse_bad_constant(ctx, indices[d], x.shape[d], True, "index")
    broadcast = tuple(torch.broadcast_shapes(*(indices[d].shape for d in indexed)))
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    first = indexed[0] if adjacent else 0
    index_axes = [axis(first + k) for k in range(len(broadcast))]
    rest = [d for d in range(x.ndim) if d not in indexed]
    rest_axes = [k if adjacent and d < first else k + len(broadcast) for k, d in enumerate(rest)]
    positions = [const_index(0)] * x.ndim
    for d, out_axis in zip(rest, rest_axes):
        positions[d] = axis(out_axis)
    for d in indexed:
        chosen = broadcast_to(indices[d], broadcast).reindex(shape, index_axes)
        positions[d] = data_index(chosen.body, x.shape[d], wrap_negative=True, op="index")
    return x.reindex(shape, positions)


# ---- data movement: positions computed from the output position -----------------------------


@register(aten.cat.default)
def lower_cat(ctx, node, tensors, dim: int = 0) -> TensorValue:
    """Nested WHEREs over the input each position falls in (Note: reads must be in bounds)."""
    shape, dtype = result(node)
    if known_zero(math.prod(shape)):
        return constant(0, dtype, shape)
    dim = normalized_dim(dim, len(shape))
    values, ends, start = [], [], 0
    for t in (t for t in tensors if t.numel > 0):  # empty inputs (legacy 1-d (0,) too) add nothing
        positions = identity_axes(len(shape))
        positions[dim] = clamped(axis(dim) - start, 0, t.shape[dim] - 1)
        values.append(t.reindex(shape, positions).body.cast(dtype))
        start += t.shape[dim]
        ends.append(start)
    body = values[-1]
    for value, end in zip(reversed(values[:-1]), reversed(ends[:-1])):
        body = axis(dim).lt(end).where(value, body)
    return TensorValue(shape, dtype, body)


@register(aten.split_with_sizes.default, aten.split.Tensor)
def lower_split(ctx, node, x: TensorValue, sizes, dim: int = 0) -> tuple[TensorValue, ...]:
    """Views: one slice per piece. split.Tensor gives every piece `sizes` elements but the last."""
    dim = normalized_dim(dim, x.ndim)
    if isinstance(sizes, int):
        size = x.shape[dim]
        sizes = [min(sizes, size - start) for start in range(0, size, sizes)] if sizes > 0 and size else [size]
    pieces, start = [], 0
    for size in sizes:
        pieces.append(slice_dim(x, dim, start, start + size, 1))
        start += size
    return tuple(pieces)


@register(aten.unbind.int)
def lower_unbind(ctx, node, x: TensorValue, dim: int = 0) -> tuple[TensorValue, ...]:
    dim = normalized_dim(dim, x.ndim)
    return tuple(select(x, dim, i) for i in range(x.shape[dim]))


@register(aten.constant_pad_nd.default)
def lower_constant_pad(ctx, node, x: TensorValue, pad, value=0) -> TensorValue:
    """pad holds (before, after) pairs from the last dim backwards; negative pads crop."""
    shape, dtype = result(node)
    if known_zero(x.numel) or known_zero(math.prod(shape)):
        return constant(value, dtype, shape)
    positions, checks = identity_axes(x.ndim), []
    for k in range(len(pad) // 2):
        d, before, after = x.ndim - 1 - k, pad[2 * k], pad[2 * k + 1]
        position = axis(d) - before if before else axis(d)
        if before > 0:
            checks.append(const_index(0).alu(Ops.CMPLE, position))
        if after > 0:
            checks.append(position.lt(x.shape[d]))
        positions[d] = clamped(position, 0, x.shape[d] - 1) if before > 0 or after > 0 else position
    body = x.reindex(shape, positions).body.cast(dtype)
    if not checks:
        return TensorValue(shape, dtype, body)
    inside = functools.reduce(lambda a, b: a.alu(Ops.AND, b), checks)
    return TensorValue(shape, dtype, inside.where(body, UOp.const(dtype, value)))


@register(aten.flip.default)
def lower_flip(ctx, node, x: TensorValue, dims) -> TensorValue:
    if x.ndim == 0:
        return x
    positions = identity_axes(x.ndim)
    for d in {normalized_dim(d, x.ndim) for d in dims}:
        positions[d] = const_index(x.shape[d] - 1) - axis(d)
    return x.reindex(x.shape, positions)


@register(aten.repeat.default)
def lower_repeat(ctx, node, x: TensorValue, repeats) -> TensorValue:
    """Tiles: trailing dims line up; each output position reads x at position % size."""
    shape, _ = result(node)
    if known_zero(math.prod(shape)):
        return constant(0, x.dtype, shape)
    lead = len(repeats) - x.ndim
    positions = [axis(lead + d) % size if repeats[lead + d] != 1 else axis(lead + d) for d, size in enumerate(x.shape)]
    return x.reindex(shape, positions)


# ---- scatters into a copy whose written positions are known at compile time ----------------


@register(aten.slice_scatter.default)
def lower_slice_scatter(ctx, node, base: TensorValue, src: TensorValue, dim: int = 0, start=None, end=None,
                        step: int = 1) -> TensorValue:  # fmt: skip
    """base with base[..., start:end:step, ...] = src: src where the position is in the slice."""
    shape, dtype = result(node)
    dim = normalized_dim(dim, base.ndim)
    if any(isinstance(v, torch.SymInt) for v in (start, end, base.shape[dim])):  # Note: symbolic sizes
        # the slice's length is src's (eager's clamping is in the meta); its start as a slice reads it
        begin, length = symbolic_slice_start(base.shape[dim], start), index_size(src.shape[dim])
        if (length if isinstance(length, int) else length.vmin) < 1:
            raise Unsupported("slice_scatter of a symbolic slice that may be empty: aten's")
    else:
        begin, stop, step = slice(start, end, step).indices(base.shape[dim])
        length = len(range(begin, stop, step))
        if length == 0:
            return base
    if known_zero(math.prod(shape)):
        return base
    offset = axis(dim) - begin
    kept = clamped(offset, 0, (length - 1) * step)
    in_slice = offset.alu(Ops.CMPEQ, kept)
    if step != 1:
        in_slice = in_slice.alu(Ops.AND, (kept % step).alu(Ops.CMPEQ, const_index(0)))
    positions = identity_axes(base.ndim)
    positions[dim] = kept // step if step != 1 else kept
    value = src.reindex(shape, positions).body.cast(dtype)
    return TensorValue(shape, dtype, in_slice.where(value, base.body.cast(dtype)))


@register(aten.select_scatter.default)
def lower_select_scatter(ctx, node, base: TensorValue, src: TensorValue, dim: int, index: int) -> TensorValue:
    shape, dtype = result(node)
    dim = normalized_dim(dim, base.ndim)
    index = index % base.shape[dim] if base.shape[dim] else index
    positions = [axis(d) if d < dim else axis(d + 1) for d in range(src.ndim)]
    value = src.reindex(shape, positions).body.cast(dtype)
    chosen = axis(dim).alu(Ops.CMPEQ, const_index(index))
    return TensorValue(shape, dtype, chosen.where(value, base.body.cast(dtype)))
