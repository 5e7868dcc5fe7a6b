"""Lazy tensors during lowering, and the index algebra of views.

A `TensorValue` is a tensor that has not been realized: its element at position
(AXIS 0, …, AXIS n-1) is the UOp `body`. A view builds a new body by substituting the old
axes with index expressions of the new ones (Note: views are substitutions), so views
never copy and reading through any chain of them is one LOAD with a composed index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.ir import Buffer, Layout, same_sizes
from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import Ops, RangeKind, UOp, substitute
from ember.uop.variables import known_zero


def axis(i: int) -> UOp:
    return UOp(Ops.AXIS, dtypes.index, (), i)


def bounded_axis(i: int, size: int) -> UOp:
    """AXIS `i` as a loop variable with its size as bound, for simplifying: the div/mod of a
    reshape folds away only with bounds ((a*4 + b)//4 -> a needs 0 <= b < 4)."""
    return UOp.range(max(size, 1), i, RangeKind.BOUNDED)


def const_index(value: int) -> UOp:
    return UOp.const(dtypes.index, value)


@dataclass(frozen=True)
class TensorValue:
    shape: tuple[int, ...]
    dtype: DType
    body: UOp

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def reindex(self, shape: tuple[int, ...], old_axes: list[UOp]) -> TensorValue:
        """A view of shape `shape` whose old axis i is `old_axes[i]` (over the new axes)."""
        mapping = {axis(i): expr for i, expr in enumerate(old_axes) if expr is not axis(i)}
        body = substitute(self.body, mapping) if mapping else self.body
        return TensorValue(tuple(shape), self.dtype, keep_unread_checks(self.body, body, mapping))

    def with_body(self, body: UOp, dtype: DType | None = None) -> TensorValue:
        return TensorValue(self.shape, dtype or body.dtype, body)


def keep_unread_checks(old_body: UOp, body: UOp, mapping: dict[UOp, UOp]) -> UOp:
    """A checked position (Note: out-of-range indices, lower/indexing.py) for an axis the body
    does not read (a dim of size 1, or of stride 0: every position reads the same element)
    still reports an index out of range, as eager does: its CHECK wraps the value instead."""
    checks = [expr for expr in mapping.values() if expr.op is Ops.CHECK]
    if not checks:
        return body
    read = old_body.toposort
    for old_axis, expr in mapping.items():
        if expr.op is Ops.CHECK and old_axis not in read:
            body = UOp(Ops.CHECK, body.dtype, (body, *expr.src[1:]), expr.arg)
    return body


def load(buffer: Buffer, layout: Layout | None = None) -> TensorValue:
    """The value of `buffer` read through `layout` (its own layout by default)."""
    layout = layout or buffer.layout
    idx = layout.index([axis(i) for i in range(len(layout.size))])
    body = UOp(Ops.LOAD, buffer.dtype, (UOp(Ops.INDEX, buffer.dtype, (buffer.uop(), idx)),))
    return TensorValue(layout.size, buffer.dtype, body)


def constant(value: int | float | bool, dtype: DType, shape: tuple[int, ...] = ()) -> TensorValue:
    return TensorValue(tuple(shape), dtype, UOp.const(dtype, value))


# ---- views (Note: views are substitutions) ---------------------------------------------


def broadcast_to(x: TensorValue, shape: tuple[int, ...]) -> TensorValue:
    """Right-aligned broadcasting; size-1 dims are read at index 0."""
    lead = len(shape) - x.ndim
    if lead < 0:
        raise ValueError(f"cannot broadcast shape {x.shape} to {shape}")
    old_axes = []
    for i, size in enumerate(x.shape):
        if size == shape[lead + i]:
            old_axes.append(axis(lead + i))
        elif size == 1:
            old_axes.append(const_index(0))
        else:
            raise ValueError(f"cannot broadcast shape {x.shape} to {shape}")
    return x.reindex(shape, old_axes)


def permute(x: TensorValue, dims: list[int]) -> TensorValue:
    dims = [d % max(x.ndim, 1) for d in dims]
    old_axes = [const_index(0)] * x.ndim
    for new, old in enumerate(dims):
        old_axes[old] = axis(new)
    return x.reindex(tuple(x.shape[d] for d in dims), old_axes)


def slice_dim(x: TensorValue, dim: int, start: int, end: int, step: int) -> TensorValue:
    """x[..., start:end:step, ...] along `dim`, with Python's clamping of start and end."""
    size = x.shape[dim]
    start, end, _ = slice(start, end).indices(size)
    length = max(0, (end - start + step - 1) // step)
    old_axes = [axis(i) for i in range(x.ndim)]
    old_axes[dim] = axis(dim) * step + start
    return x.reindex(x.shape[:dim] + (length,) + x.shape[dim + 1 :], old_axes)


def select(x: TensorValue, dim: int, index: int) -> TensorValue:
    size = x.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"select(): index {index} out of range for dimension {dim} of size {size}")
    old_axes = [axis(i) for i in range(dim)] + [const_index(index % size)] + [axis(i) for i in range(dim, x.ndim - 1)]
    return x.reindex(x.shape[:dim] + x.shape[dim + 1 :], old_axes)


def unsqueeze(x: TensorValue, dim: int) -> TensorValue:
    old_axes = [axis(i) if i < dim else axis(i + 1) for i in range(x.ndim)]
    return x.reindex(x.shape[:dim] + (1,) + x.shape[dim:], old_axes)


def reshape(x: TensorValue, shape: tuple[int, ...]) -> TensorValue:
    """Row-major reshape: each old axis is recovered from the new position's flat index."""
    if same_sizes(tuple(shape), x.shape):
        return x
    if known_zero(x.numel):
        return TensorValue(tuple(shape), x.dtype, x.body)
    kept_new = [i for i, s in enumerate(shape) if s != 1]
    kept_old = [i for i, s in enumerate(x.shape) if s != 1]
    if same_sizes(tuple(shape[i] for i in kept_new), tuple(x.shape[i] for i in kept_old)):  # only size-1 dims move
        old_axes = [const_index(0)] * x.ndim
        for new, old in zip(kept_new, kept_old):
            old_axes[old] = axis(new)
        return x.reindex(tuple(shape), old_axes)
    flat = const_index(0)
    for i, stride in enumerate(_strides(shape)):
        if shape[i] != 1:
            flat = flat + axis(i) * stride
    old_axes = [(flat // stride) % size for size, stride in zip(x.shape, _strides(x.shape))]
    return x.reindex(tuple(shape), old_axes)


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, running = [], 1
    for s in reversed(shape):
        strides.append(running)
        running *= s
    return list(reversed(strides))


def as_strided_read(x: TensorValue) -> tuple[str, Layout] | None:
    """(buffer name, layout) when `x` is a plain strided read of one buffer, else None."""
    if x.body.op is not Ops.LOAD:
        return None
    index = x.body.src[0]
    coefficients = affine_coefficients(index.src[1], x.shape)
    if coefficients is None:
        return None
    offset, strides = coefficients
    return index.src[0].arg.name, Layout(x.shape, tuple(strides), offset)


def reads_transposed(x: TensorValue) -> bool:
    """Whether `x` reads memory down its second-to-last dim (stride 1 there) and across its
    last: every load's index, simplified, moves by 1 along dim -2 and by more along dim -1."""
    from ember.uop.symbolic import distributed_terms, simplify

    if x.ndim < 2 or x.shape[-1] == 1 or x.shape[-2] == 1:
        return False
    bounded = {axis(i): bounded_axis(i, size) for i, size in enumerate(x.shape)}
    rows, cols = bounded[axis(x.ndim - 2)], bounded[axis(x.ndim - 1)]
    loads = [u for u in x.body.toposort if u.op is Ops.LOAD]
    for load_uop in loads:
        form = distributed_terms(simplify(substitute(load_uop.src[0].src[1], bounded)), opaque=True)
        terms = form[0] if form is not None else {}
        stride = {term: k for term, k in terms.items() if term in (rows, cols)}
        if any(term not in (rows, cols) and {rows, cols} & term.ranges for term in terms):
            return False  # dim -2 or -1 inside a div/mod or a product: not a plain stride
        if stride.get(rows) != 1 or abs(stride.get(cols, 0)) <= 1:
            return False
    return bool(loads)


def symbolic_affine_coefficients(expr: UOp, dim_of: dict[UOp, int]) -> tuple[int, list] | None:
    """affine_coefficients where strides are expressions of size variables (Note: symbolic sizes):
    each addend is one dim's loop variable times a product of constants and size-only factors
    (a size variable, or an expression of them as `s % 8` in a padded row `s - s % 8 + 8`);
    a dim's addends sum to its stride. An addend of sizes alone must be a constant (the offset)."""
    from collections import Counter

    from ember.uop.symbolic_division import expanded_terms, factors, product

    strides: list = [0] * len(dim_of)
    offset = 0
    for term in expanded_terms(expr):
        constant, found = factors(term)
        loops = [u for u in found if u in dim_of]
        if not found:
            offset += constant
            continue
        if len(loops) != 1 or found[loops[0]] != 1 or not all(_size_only(u) for u in found if u not in dim_of):
            return None
        rest = found - Counter({loops[0]: 1})
        stride = product(constant, rest, term) if rest else term.const_like(constant)
        d = dim_of[loops[0]]
        strides[d] = stride if type(strides[d]) is int and strides[d] == 0 else strides[d] + stride
    return offset, [_folded(s) for s in strides]


SIZE_ARITHMETIC = {Ops.DEFINE_VAR, Ops.CONST, Ops.ADD, Ops.SUB, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.MIN, Ops.NEG}


def _size_only(u: UOp) -> bool:
    """Whether `u` is computed from size variables and constants alone (no loop variable)."""
    return all(v.op in SIZE_ARITHMETIC for v in u.toposort)


def _folded(stride: Any) -> Any:
    """A stride as a plain int when it is a constant, else its simplified expression."""
    from ember.uop.symbolic import simplify

    if not isinstance(stride, UOp):
        return stride
    stride = simplify(stride)
    return stride.arg if stride.op is Ops.CONST else stride


def affine_coefficients(expr: UOp, shape: tuple[int, ...]) -> tuple[int, list[int]] | None:
    """(offset, strides) when `expr` is offset + sum(AXIS i * stride i), else None."""
    from ember.uop.symbolic import distributed_terms, simplify

    bounded = {axis(i): bounded_axis(i, size) for i, size in enumerate(shape)}
    dim_of = {r: i for i, r in enumerate(bounded.values())}
    simplified = simplify(substitute(expr, bounded))
    form = distributed_terms(simplified)
    if form is None:
        return symbolic_affine_coefficients(simplified, dim_of)
    terms, offset = form
    strides = [0] * len(shape)
    for term, k in terms.items():
        if term not in dim_of:
            return None
        strides[dim_of[term]] += k
    return offset, strides
