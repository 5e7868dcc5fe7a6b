"""Lowerings of stores at computed positions: scatter, scatter_add, scatter_reduce,
index_put (index_add, index_copy, index_fill and embedding's gradient arrive as index_put),
index_reduce, put, masked_scatter, and the static-position scatters diagonal_scatter and
as_strided_scatter.

Note: stores at computed positions
    out = a copy of self (a computed buffer, which fuses with whatever produces self), then
    one `IndexedStore` (ir.py) per pass: a kernel whose loop nest is the source's shape and
    which, for every source element, does out[computed index] (combine)= value. It mutates
    the copy in place: the scheduler runs it after the copy and before every reader of the
    result, and never fuses it with anything (schedule/nodes.py `runs_alone`; a reader fused
    into the copy would see the buffer before the stores, and the cycle check refuses that).
    Race freedom, two ways. Most scatters have an *owner dim*: a source dim that is the
    position along a dim of out as it is (scatter: every dim but `dim`; index_put: the dims
    not indexed, like embedding's feature dim). Iterations that differ there never write one
    element, so codegen makes that loop the outermost, parallel one (in chunks of 16, the
    lane loop innermost) and the stores plain read-combine-writes: each element is
    accumulated by one thread, in source order, as in eager. Without an owner dim (put,
    a 1-d scatter, as_strided_scatter) the C++ renderer makes the store atomic: integer sums
    with fetch_add, the other combines with a compare-and-swap loop, plain stores with a
    relaxed atomic store; float sums then add in a run-dependent order, as on a GPU. Either
    way the loop nest never runs as SIMD lanes (two lanes could hit one element), and plain
    stores with duplicate positions leave one of the values (eager's result is unspecified
    then too). A position read from data is clamped into its dim, so
    nothing is ever written out of bounds, and a CHECK raises eager's exception type after
    the kernel (Note: kernel errors, renderer/cpp.py).
"""

from __future__ import annotations

import math

import torch
import torch.fx

from ember.ir import Buffer, IndexedStore, Layout
from ember.lower.context import LoweringContext
from ember.lower.indexing import clamped, identity_axes, normalized_dim, result
from ember.lower.pointwise import floordiv, out_meta
from ember.lower.registry import Unsupported, register
from ember.lower.scans import running_count
from ember.lower.values import TensorValue, axis, broadcast_to, const_index, load, reshape
from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import CheckArg, Ops, UOp
from ember.uop.variables import known_zero

aten = torch.ops.aten

COMBINES = {"sum": Ops.ADD, "prod": Ops.MUL, "amax": Ops.MAX, "amin": Ops.MIN, "mean": Ops.ADD}


# ---- the building blocks --------------------------------------------------------------------


def checked_position(value: UOp, size: int, wrap_negative: bool, error: str, message: str) -> UOp:
    """A position read from data, clamped into [0, size-1], that reports `error` when it was
    outside the dim (with `wrap_negative`, -size..-1 count from the end)."""
    given = i = value.cast(dtypes.index)
    if wrap_negative:
        i = i.lt(0).where(i + size, i)
    in_range = const_index(-1).alu(Ops.CMPLT, i).alu(Ops.AND, i.lt(size))
    checked = (clamped(i, 0, max(size - 1, 0)), in_range, given)
    return UOp(Ops.CHECK, dtypes.index, checked, CheckArg(error, message))


def fresh_copy(ctx: LoweringContext, node: torch.fx.Node, x: TensorValue, dtype: DType, layout: Layout | None = None
               ) -> Buffer:  # fmt: skip
    """A new buffer holding `x` (cast to `dtype`): the buffer the stores then mutate."""
    ref = ctx.realize(x.with_body(x.body.cast(dtype)), node.name, layout=layout, fresh=True)
    return ctx.buffers[ref.name]


def linear_index(layout: Layout, positions: list[UOp]) -> UOp:
    """layout.index, but keeping a data position into a dim of size 1 (its CHECK must run)."""
    index = const_index(layout.offset)
    for position, stride in zip(positions, layout.stride):
        if not (position.op is Ops.CONST and position.arg == 0):
            index = index + position * stride
    return index


def store_at(ctx: LoweringContext, node: torch.fx.Node, target: Buffer, shape: tuple[int, ...], index: UOp,
             value: UOp, combine: Ops | None, owner_dims: tuple[int, ...] = ()) -> None:  # fmt: skip
    """For every position p of `shape`: target[index(p)] (combine)= value(p). `owner_dims`: dims
    of `shape` that are the position along a dim of target (ir.py IndexedStore)."""
    if known_zero(math.prod(shape)):
        return
    if target.layout.numel == 0:
        raise Unsupported("a store into an empty tensor: every index is out of range, as aten will report")
    store = IndexedStore(target, tuple(shape), index, value.cast(target.dtype), combine, (node.name,), owner_dims)
    ctx.graph.steps.append(store)


def identity(combine: Ops, dtype: DType) -> int | float | bool:
    """What include_self=False starts each written element from."""
    if combine is Ops.MAX:
        return dtype.min
    if combine is Ops.MIN:
        return dtype.max
    return 1 if combine is Ops.MUL else 0


def reduce_into(ctx, node, x: TensorValue, shape, index: UOp, value: UOp, reduce: str, include_self: bool,
                owners: tuple[int, ...] = ()) -> TensorValue:  # fmt: skip
    """scatter_reduce / index_reduce: a copy of x, every written element reset to the
    combine's identity unless `include_self`, then the combining stores; "mean" also counts
    the stores per element and divides (floor division for integers, as aten)."""
    _, dtype = result(node)
    combine = COMBINES[reduce]
    out = fresh_copy(ctx, node, x, dtype)
    if not include_self:
        store_at(ctx, node, out, shape, index, UOp.const(dtype, identity(combine, dtype)), None, owners)
    store_at(ctx, node, out, shape, index, value, combine, owners)
    total = load(out)
    if reduce != "mean":
        return total
    counts = fresh_copy(ctx, node, TensorValue(x.shape, dtype, UOp.const(dtype, int(include_self))), dtype)
    store_at(ctx, node, counts, shape, index, UOp.const(dtype, 1), Ops.ADD, owners)
    count = load(counts).body
    count = count.alu(Ops.CMPEQ, count.const_like(0)).where(count.const_like(1), count)
    mean = total.body.alu(Ops.FDIV, count) if dtype.is_float else floordiv(total.body, count)
    return total.with_body(mean)


# ---- scatter: positions from an index tensor of the source's shape --------------------------


def scatter_positions(x: TensorValue, dim: int, index: TensorValue, op: str) -> tuple[tuple[int, ...], UOp, tuple]:
    """(iteration shape, linear index into a contiguous copy of x, owner dims) for scatter along
    `dim`: every dim but `dim` is a position in x as it is."""
    if index.dtype not in (dtypes.int64, dtypes.int32):
        raise Unsupported(f"{op} with {index.dtype} indices")
    layout = Layout.contiguous(x.shape)
    if x.ndim == 0:
        message = f"{op}: index {{value}} is out of bounds for dimension 0 with size 1"
        return index.shape, checked_position(index.body, 1, False, "RuntimeError", message), ()  # always 0
    dim = normalized_dim(dim, x.ndim)
    positions = identity_axes(x.ndim)
    message = f"{op}: index {{value}} is out of bounds for dimension {dim} with size {x.shape[dim]}"
    positions[dim] = checked_position(index.body, x.shape[dim], False, "RuntimeError", message)
    return index.shape, linear_index(layout, positions), tuple(d for d in range(x.ndim) if d != dim)


def source_value(src: TensorValue | float | int | bool, shape: tuple[int, ...], dtype: DType) -> UOp:
    """src read at the iteration position (src may be larger than index in every dim)."""
    if not isinstance(src, TensorValue):
        return UOp.const(dtype, src)
    if src.ndim == 0:
        return src.body.cast(dtype)
    return src.reindex(shape, identity_axes(len(shape))).body.cast(dtype)


@register(aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce, low_precision=False)
def lower_scatter(ctx, node, x: TensorValue, dim: int, index: TensorValue, src, reduce=None) -> TensorValue:
    """scatter, and its deprecated reduce="add" / "multiply" forms (which include self)."""
    _, dtype = result(node)
    combine = {None: None, "add": Ops.ADD, "multiply": Ops.MUL}.get(reduce, Ops.SINK)
    if combine is Ops.SINK:
        raise Unsupported(f"scatter with reduce={reduce!r}; aten reports it")
    if combine is None and (chosen := scatter_as_select(x, dim, index, src, dtype)) is not None:
        return chosen
    shape, linear, owners = scatter_positions(x, dim, index, "scatter")
    out = fresh_copy(ctx, node, x, dtype)
    store_at(ctx, node, out, shape, linear, source_value(src, shape, dtype), combine, owners)
    return load(out)


# Note: a scatter of one element per row is a select
#     scatter(x, dim, index, src) where index has size 1 along `dim` and x's size along every other
#     dim writes exactly one element of each row along `dim`: the row's index. Each element of
#     the result is then src where its position along `dim` equals that index, else x: a
#     pointwise select, which fuses with x's producer and with every reader, where the stores
#     need a buffer of their own. cross_entropy's backward is this case (nll_loss's gradient is
#     -grad scattered into zeros at each row's target): a (tokens, vocabulary) buffer written,
#     then read back, which the select never makes. The position still goes through
#     `checked_position`, so an index outside the dim raises as eager does.


def scatter_as_select(x: TensorValue, dim: int, index: TensorValue, src, dtype: DType) -> TensorValue | None:
    """The select form of a scatter of one element per row along `dim`, or None for any other
    scatter (Note: a scatter of one element per row is a select)."""
    if x.ndim == 0 or index.ndim != x.ndim or index.dtype not in (dtypes.int64, dtypes.int32):
        return None
    dim = normalized_dim(dim, x.ndim)
    other_dims = [d for d in range(x.ndim) if d != dim]
    if x.shape[dim] == 0 or index.shape[dim] != 1 or any(index.shape[d] != x.shape[d] for d in other_dims):
        return None
    if isinstance(src, TensorValue) and (src.ndim != x.ndim or any(map(int.__lt__, src.shape, index.shape))):
        return None
    row = [axis(d) if d != dim else const_index(0) for d in range(x.ndim)]
    message = f"scatter: index {{value}} is out of bounds for dimension {dim} with size {x.shape[dim]}"
    position = checked_position(index.reindex(x.shape, row).body, x.shape[dim], False, "RuntimeError", message)
    value = src.reindex(x.shape, row).body.cast(dtype) if isinstance(src, TensorValue) else UOp.const(dtype, src)
    hit = axis(dim).alu(Ops.CMPEQ, position)
    return x.with_body(hit.where(value, x.body.cast(dtype)), dtype)


@register(aten.scatter_add.default, low_precision=False)
def lower_scatter_add(ctx, node, x: TensorValue, dim: int, index: TensorValue, src: TensorValue) -> TensorValue:
    _, dtype = result(node)
    shape, linear, owners = scatter_positions(x, dim, index, "scatter_add")
    out = fresh_copy(ctx, node, x, dtype)
    store_at(ctx, node, out, shape, linear, source_value(src, shape, dtype), Ops.ADD, owners)
    return load(out)


@register(aten.scatter_reduce.two, low_precision=False)
def lower_scatter_reduce(ctx, node, x: TensorValue, dim: int, index: TensorValue, src: TensorValue, reduce: str,
                         include_self: bool = True) -> TensorValue:  # fmt: skip
    _, dtype = result(node)
    shape, linear, owners = scatter_positions(x, dim, index, "scatter_reduce")
    value = source_value(src, shape, dtype)
    return reduce_into(ctx, node, x, shape, linear, value, reduce, include_self, owners)


@register(aten.index_reduce.default, low_precision=False)
def lower_index_reduce(ctx, node, x: TensorValue, dim: int, index: TensorValue, src: TensorValue, reduce: str,
                       include_self: bool = True) -> TensorValue:  # fmt: skip
    """x[..., index[i], ...] (reduce)= src[..., i, ...] along `dim`."""
    if index.dtype not in (dtypes.int64, dtypes.int32) or index.ndim > 1:
        raise Unsupported("index_reduce with a non-integer index")
    _, dtype = result(node)
    if x.ndim == 0:  # index holds one position, 0, and src is one element
        linear = checked_position(index.body, 1, False, "IndexError", "index {value} out of range in self")
        return reduce_into(ctx, node, x, index.shape, linear, src.body.cast(dtype), reduce, include_self)
    dim = normalized_dim(dim, x.ndim)
    positions = identity_axes(x.ndim)
    chosen = index.reindex(src.shape, [axis(dim)]).body
    positions[dim] = checked_position(chosen, x.shape[dim], False, "IndexError", "index {value} out of range in self")
    linear = linear_index(Layout.contiguous(x.shape), positions)
    owners = tuple(d for d in range(x.ndim) if d != dim)
    return reduce_into(ctx, node, x, src.shape, linear, src.body.cast(dtype), reduce, include_self, owners)


# ---- index_put: advanced indexing on the left of an assignment ------------------------------


def indexing_positions(x: TensorValue, indices: list) -> tuple[tuple[int, ...], list[UOp], tuple[int, ...]]:
    """(shape of x[indices], the position in x of each of its elements, the dims of the shape
    that are positions in x as they are: the not-indexed ones), by numpy's rule: the
    index tensors broadcast together; their dims replace the indexed dims in place when those
    are adjacent, else they come first (as aten.index, lower/indexing.py)."""
    indices = list(indices) + [None] * (x.ndim - len(indices))
    indexed = [d for d, i in enumerate(indices) if i is not None]
    broadcast = tuple(torch.broadcast_shapes(*(indices[d].shape for d in indexed)))
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    first = indexed[0] if adjacent else 0
    rest = [d for d in range(x.ndim) if d not in indexed]
    before = [d for d in rest if adjacent and d < first]
    shape = tuple(x.shape[d] for d in before) + broadcast + tuple(x.shape[d] for d in rest if d not in before)
    rest_axes = [k if d in before else k + len(broadcast) for k, d in enumerate(rest)]
    positions = [const_index(0)] * x.ndim
    for d, out_axis in zip(rest, rest_axes):
        positions[d] = axis(out_axis)
    index_axes = [axis(first + k) for k in range(len(broadcast))]
    for d in indexed:
        chosen = broadcast_to(indices[d], broadcast).reindex(shape, index_axes).body
        message = f"index_put: index {{value}} is out of bounds for dimension {d} with size {x.shape[d]}"
        positions[d] = checked_position(chosen, x.shape[d], True, "IndexError", message)
    return shape, positions, tuple(rest_axes)


@register(aten.index_put.default, low_precision=False)
def lower_index_put(ctx, node, x: TensorValue, indices, values: TensorValue, accumulate: bool = False
                    ) -> TensorValue:  # fmt: skip
    _, dtype = result(node)
    tensors = [i for i in indices if i is not None]
    if any(i.dtype in (dtypes.bool, dtypes.uint8) for i in tensors):
        return masked_put(node, x, list(indices), values, accumulate, dtype)
    if any(i.dtype not in (dtypes.int64, dtypes.int32) for i in tensors) or not tensors:
        raise Unsupported("index_put with these indices")
    shape, positions, owners = indexing_positions(x, indices)
    try:
        value = broadcast_to(values, shape).body
    except ValueError as e:
        raise Unsupported(f"index_put: {e}; aten reports the shape mismatch") from e
    out = fresh_copy(ctx, node, x, dtype)
    combine = Ops.ADD if accumulate else None
    store_at(ctx, node, out, shape, linear_index(out.layout, positions), value, combine, owners)
    return load(out)


def masked_put(node, x: TensorValue, indices: list, values: TensorValue, accumulate: bool, dtype: DType
               ) -> TensorValue:  # fmt: skip
    """x[mask] = values with one boolean mask (over dims d..d+k-1) and values that broadcast
    along the masked elements: a pointwise select, no store at computed positions. Values with
    one entry per masked element (a data-dependent count) go to the fallback."""
    masks = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(masks) != 1 or masks[0][1].dtype is not dtypes.bool:
        raise Unsupported("index_put with a mask and other indices")
    d, mask = masks[0]
    k = mask.ndim
    if tuple(x.shape[d : d + k]) != mask.shape:
        raise Unsupported("index_put: the mask's shape does not match the indexed dims; aten reports it")
    along = x.shape[:d] + (1,) + x.shape[d + k :]
    if tuple(torch.broadcast_shapes(values.shape, along)) != along:
        raise Unsupported("index_put: one value per masked element (a data-dependent count)")
    spread = broadcast_to(values, along)
    value = spread.reindex(x.shape, identity_axes(d) + [const_index(0)] + [axis(a) for a in range(d + k, x.ndim)])
    chosen = mask.reindex(x.shape, [axis(a) for a in range(d, d + k)]).body
    current = x.body.cast(dtype)
    if accumulate:
        return x.with_body(chosen.where(current + value.body.cast(dtype), current), dtype)
    return x.with_body(chosen.where(value.body.cast(dtype), current), dtype)


@register(aten.put.default, low_precision=False)
def lower_put(ctx, node, x: TensorValue, index: TensorValue, source: TensorValue, accumulate: bool = False
              ) -> TensorValue:  # fmt: skip
    """x.flatten()[index] (+)= source.flatten(): positions in x's row-major order."""
    if index.dtype not in (dtypes.int64, dtypes.int32) or index.numel != source.numel:
        raise Unsupported("put with these index or source shapes")
    _, dtype = result(node)
    out = fresh_copy(ctx, node, x, dtype)
    message = f"put: index {{value}} is out of range for a tensor of {x.numel} elements"
    flat = checked_position(index.body, x.numel, True, "IndexError", message)
    value = reshape(source, index.shape).body
    store_at(ctx, node, out, index.shape, flat, value, Ops.ADD if accumulate else None)
    return load(out)


@register(aten.masked_scatter.default, low_precision=False)
def lower_masked_scatter(ctx, node, x: TensorValue, mask: TensorValue, source: TensorValue) -> TensorValue:
    """out[p] = mask[p] ? source.flatten()[number of true elements before p] : x[p]. The count
    is a running sum of the mask in row-major order (a scan, lower/scans.py); a pointwise
    select then reads the source at it, so no store at computed positions is needed."""
    shape, dtype = result(node)
    if mask.dtype is not dtypes.bool or source.numel == 0:
        raise Unsupported("masked_scatter with a non-bool mask or an empty source")
    chosen = broadcast_to(mask, shape)
    if known_zero(math.prod(shape)):
        return broadcast_to(x, shape).with_body(broadcast_to(x, shape).body.cast(dtype), dtype)
    counts = reshape(running_count(ctx, reshape(chosen, (math.prod(shape),)), node.name), shape)
    before = counts.body.cast(dtypes.index) - 1
    in_range = chosen.body.alu(Ops.NOT).alu(Ops.OR, before.lt(source.numel))
    error = CheckArg("RuntimeError", "masked_scatter: Number of elements of source < number of ones in mask")
    position = UOp(Ops.CHECK, dtypes.index, (clamped(before, 0, source.numel - 1), in_range, before), error)
    flat = reshape(source, (source.numel,)).reindex(shape, [position]).body.cast(dtype)
    return TensorValue(shape, dtype, chosen.body.where(flat, broadcast_to(x, shape).body.cast(dtype)))


# ---- static positions --------------------------------------------------------------------------


@register(aten.diagonal_scatter.default, low_precision=False)
def lower_diagonal_scatter(ctx, node, x: TensorValue, src: TensorValue, offset: int = 0, dim1: int = 0,
                           dim2: int = 1) -> TensorValue:  # fmt: skip
    """A pointwise select, like select_scatter: src where the position is on the diagonal."""
    shape, dtype = result(node)
    dim1, dim2 = normalized_dim(dim1, x.ndim), normalized_dim(dim2, x.ndim)
    length = src.shape[-1] if src.ndim else 0
    if length == 0 or known_zero(math.prod(shape)):
        return x.with_body(x.body.cast(dtype), dtype)
    on_diagonal = (axis(dim2) - axis(dim1)).alu(Ops.CMPEQ, const_index(offset))
    along = clamped(axis(dim1) - max(-offset, 0), 0, length - 1)  # Note: reads must be in bounds
    others = [axis(d) for d in range(x.ndim) if d not in (dim1, dim2)]
    value = src.reindex(shape, others + [along]).body.cast(dtype)
    return x.with_body(on_diagonal.where(value, x.body.cast(dtype)), dtype)


@register(aten.as_strided_scatter.default, low_precision=False)
def lower_as_strided_scatter(ctx, node, x: TensorValue, src: TensorValue, size, stride, storage_offset=None
                             ) -> TensorValue:  # fmt: skip
    """A copy of x in eager's layout, then src stored at the positions the strided view of
    that copy covers (positions that overlap get one of the values, as in eager)."""
    meta = out_meta(node)
    _, dtype = result(node)
    layout = Layout(tuple(meta.shape), tuple(meta.stride()), 0)
    if layout.storage_size != layout.numel:
        raise Unsupported("as_strided_scatter of a tensor whose clone is not dense")
    out = fresh_copy(ctx, node, x, dtype, layout)
    view = Layout(tuple(size), tuple(stride), storage_offset or 0)
    store_at(ctx, node, out, view.size, view.index(identity_axes(len(size))), src.body, None)
    return load(out)


@register(torch.ops.prims.copy_strided.default, low_precision=False)
def lower_copy_strided(ctx, node, x: TensorValue, stride) -> TensorValue:
    """index_fill's decomposition restores self's strides with it: the same values (a graph
    output gets eager's strides anyway, lower/graph.py)."""
    return x
