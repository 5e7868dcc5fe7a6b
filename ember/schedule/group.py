"""A fused group of computed buffers: how their loops line up, and how a consumer's reads
of a buffer produced in the same group become that buffer's value (no memory round trip).

Note: vertical fusion is substitution
    A consumer reads producer buffer B at a linear index. When that index is B's own
    layout applied to per-axis expressions e_0..e_k (checked by rebuilding it), the read
    is replaced by B's body with AXIS i := e_i. The same producer element then is the same
    UOp wherever it is read, so it is computed once (hash-consing), and a producer read
    at an outer position only (a row max read by every element of the row) is hoisted out
    of the inner loop by the linearizer. A read that does not decompose refuses the fusion.
"""

from __future__ import annotations

from ember.ir import ComputedBuffer, Layout
from ember.lower.values import axis
from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, RangeKind, UOp, substitute
from ember.uop.symbolic import addends, element_form, linear_terms, simplify
from ember.uop.symbolic_division import below, exact_quotient, factors
from ember.uop.variables import index_size, known_zero


def align(sizes: list[tuple[int, ...]]) -> tuple[tuple[int, ...], list[list[int]]] | None:
    """The group's loop sizes and, per member, the group dim of each of its dims; None
    when the iteration spaces cannot share loops (a dim of one size against another). A
    symbolic size (Note: symbolic sizes) matches only the same expression, and is never 1."""
    sizes = [tuple(index_size(s) for s in size) for size in sizes]
    group = list(max(sizes, key=len))
    if any(known_zero(s) for size in sizes for s in size) and len(set(sizes)) > 1:
        return None  # an empty member has no iterations to share
    placements = []
    for size in sizes:
        for start in dict.fromkeys((0, len(group) - len(size))):  # left-aligned, then right-aligned
            if all(s in (1, group[start + i]) or group[start + i] == 1 for i, s in enumerate(size)):
                for i, s in enumerate(size):
                    group[start + i] = s if group[start + i] == 1 else group[start + i]
                placements.append([start + i for i in range(len(size))])
                break
        else:
            return None
    return tuple(group), placements


def recomputed_member(sizes: list[tuple[int, ...]], alignment: tuple) -> int | None:
    """The first member whose loops are not the group's outer loops: the linearizer would
    place it inside a loop it does not use and compute every element again per iteration."""
    group, placements = alignment
    loop_dims = [d for d, s in enumerate(group) if is_loop(s)]
    for member, (size, placement) in enumerate(zip(sizes, placements)):
        used = sorted(placement[i] for i, s in enumerate(size) if is_loop(index_size(s)))
        if used != loop_dims[: len(used)]:
            return member
    return None


def is_loop(size: int | UOp) -> bool:
    """More than one iteration, or symbolic (Note: symbolic sizes)."""
    return size > 1 if type(size) is int else True


def axis_exprs(index: UOp, layout: Layout) -> list[UOp] | None:
    """Per-axis expressions whose position in `layout` is `index`, or None (see the Note)."""
    if not all(type(x) is int for x in (*layout.size, *layout.stride, layout.offset)):
        return symbolic_axis_exprs(simplify(index), layout)
    index = simplify(index)
    terms, offset = linear_terms(index)
    exprs: list[UOp] = [UOp.const(dtypes.index, 0)] * len(layout.size)
    dims_by_stride = {st: d for d, (st, sz) in enumerate(zip(layout.stride, layout.size)) if sz != 1}
    for term, coefficient in terms:
        dim = dims_by_stride.get(coefficient)
        if dim is None:
            return None
        exprs[dim] = exprs[dim] + term
    rest = offset - layout.offset
    for d in sorted(dims_by_stride.values(), key=lambda d: -layout.stride[d]):
        quotient, rest = divmod(rest, layout.stride[d]) if layout.stride[d] else (0, rest)
        exprs[d] = exprs[d] + quotient
    if rest != 0:
        return None
    exprs = [simplify(e) for e in exprs]
    if any(e.vmin < 0 or e.vmax >= size for e, size in zip(exprs, layout.size)):
        return None
    if simplify(layout.index(exprs)) is not index:
        return None
    return exprs


def symbolic_axis_exprs(index: UOp, layout: Layout) -> list[UOp] | None:
    """axis_exprs for a layout with symbolic sizes (Note: symbolic sizes): each addend of the index
    goes to the dim whose stride divides it, the largest strides first; the result is checked
    by rebuilding the index, as the static one is."""
    strides = [index_size(st) for st in layout.stride]
    sizes = [index_size(sz) for sz in layout.size]
    if index_size(layout.offset) != 0:
        return None
    dims = [d for d in range(len(sizes)) if not (type(sizes[d]) is int and sizes[d] == 1)]
    dims.sort(key=lambda d: _stride_rank(strides[d]), reverse=True)
    exprs: list[UOp] = [UOp.const(dtypes.index, 0)] * len(sizes)
    for term in addends(index):
        for d in dims:
            if (q := exact_quotient(term, _as_index(strides[d]))) is not None:
                exprs[d] = exprs[d] + q
                break
        else:
            return None
    exprs = [simplify(e) for e in exprs]
    if any(not below(e, _as_index(size)) for e, size in zip(exprs, sizes)):
        return None
    if simplify(layout.index(exprs)) is not index:
        return None
    return exprs


def _stride_rank(stride: int | UOp) -> tuple[int, int]:
    """Larger for a stride that more others divide: more size variables, then a larger constant."""
    constant, found = factors(_as_index(stride))
    return (sum(found.values()), constant)


def _as_index(x: int | UOp) -> UOp:
    return x if isinstance(x, UOp) else UOp.const(dtypes.index, x)


def resolve_bodies(group: list[ComputedBuffer]) -> dict[str, UOp] | str:
    """Each member's body with reads of earlier members replaced by their values (in the
    member's own axes), or the reason a read cannot be replaced."""
    resolved: dict[str, UOp] = {}
    layouts = {c.name: c.buffer.layout for c in group}
    for computed in group:
        # axes become bounded loop variables while decomposing, so bounds prove the index math
        bounded = {axis(i): UOp.range(s, i, RangeKind.BOUNDED) for i, s in enumerate(computed.buffer.layout.size)}
        unbound = {r: a for a, r in bounded.items()}
        mapping: dict[UOp, UOp] = {}
        for u in computed.body.toposort:
            if u.op is not Ops.LOAD or u.src[0].src[0].arg.name not in resolved:
                continue
            name = u.src[0].src[0].arg.name
            exprs = axis_exprs(substitute(u.src[0].src[1], bounded), layouts[name])
            if exprs is None:
                return f"{computed.name} reads {name} at positions that do not match its writes"
            exprs = [substitute(e, unbound) for e in exprs]
            mapping[u] = substitute(resolved[name], {axis(i): e for i, e in enumerate(exprs)})
        resolved[computed.name] = substitute(computed.body, mapping) if mapping else computed.body
    return resolved


def unsafe_in_place_read(group: list[ComputedBuffer], bodies: dict[str, UOp], alignment: tuple) -> str | None:
    """Note: inputs written in place (lower/mutation.py). A kernel that stores into an input
    overwrites element i in iteration i; another iteration reading element j != i of it, or a
    reduction's loops reading it again after the store, would see the new contents. So every
    read of such an input anywhere in the group is at the stored element (in the group's loops),
    and the group has no reductions. The reason it is unsafe, or None."""
    if not any(c.buffer.kind == "input" for c in group):  # (the common case: asked of every candidate)
        return None
    _, placements = alignment
    in_group = [{axis(i): axis(dim) for i, dim in enumerate(placement)} for placement in placements]
    stored = {c.name: element_form(substitute(_element_index(c), to_group))
              for c, to_group in zip(group, in_group) if c.buffer.kind == "input"}  # fmt: skip
    for c, to_group in zip(group, in_group):
        for u in bodies[c.name].toposort:
            if u.op in (Ops.REDUCE, Ops.SCAN):
                return f"{c.name} reduces in a kernel that stores into input {', '.join(stored)} in place"
            if u.op is Ops.INDEX and u.src[0].op is Ops.BUFFER and u.src[0].arg.name in stored:
                name = u.src[0].arg.name
                if element_form(substitute(u.src[1], to_group)) != stored[name]:
                    return f"{c.name} reads input {name} at other elements than the kernel stores in place"
    return None


def _element_index(c: ComputedBuffer) -> UOp:
    return c.buffer.layout.index([axis(i) for i in range(len(c.buffer.layout.size))])
