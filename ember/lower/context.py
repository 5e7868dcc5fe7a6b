"""The state of lowering one FX graph: named buffers, realized values, fallback calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ember.ir import Buffer, BufferRef, ComputedBuffer, ExternCall, Layout, LoweredGraph, contiguous_strides, same_sizes
from ember.lower.collectives import communication_of
from ember.lower.values import TensorValue, as_strided_read, load, reads_transposed
from ember.uop.dtypes import from_torch
from ember.uop.ops import Ops, RangeKind, UOp
from ember.uop.variables import known_one, known_zero, size_hint

# aten matmuls that read any strided operand, a transposed one as fast as a plain one (BLAS)
MATMUL_OPS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


def matmul_operand_layout(x: TensorValue) -> Layout | None:
    """Note: transposed matmul operands
    A matmul operand that must be copied (k.transpose(-2, -1) reshaped for bmm) and that reads
    its source down dim -2 is stored with its last two dims column-major: the copy then walks
    both source and result contiguously, where a row-major result would read the source with
    a stride (a stride of 4 KiB thrashes the cache: 30x slower); BLAS takes either layout.
    None (row-major) otherwise."""
    if as_strided_read(x) is not None or not reads_transposed(x):
        return None
    strides = list(contiguous_strides(x.shape))
    strides[-2], strides[-1] = 1, x.shape[-2]
    return Layout(x.shape, tuple(strides))


def dense_layout(meta: Any, shape: tuple[int, ...]) -> Layout | None:
    """`meta`'s layout when it is a tensor of `shape` whose elements fill its storage once
    (a permutation of a contiguous layout), else None."""
    if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != tuple(shape):
        return None
    expected = 1
    for size, stride in sorted(zip(meta.shape, meta.stride()), key=lambda p: size_hint(p[1])):  # Note: symbolic sizes
        if size != 1:
            if not same_sizes((stride,), (expected,)):
                return None
            expected *= size
    return Layout(tuple(shape), tuple(meta.stride()))


def gapped_layout(meta: Any, shape: tuple[int, ...]) -> Layout | None:
    """`meta`'s layout when it stores each element once with gaps between rows (a slice of a
    padded tensor: strides (s * 16, 16, 1) for rows of s <= 16), else None. A symbolic stride
    counts only where it provably clears the dims inside it (no guard is asked)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != tuple(shape):
        return None
    span = 1
    for size, stride in sorted(zip(meta.shape, meta.stride()), key=lambda p: size_hint(p[1])):
        if type(size) is int and size == 1:
            continue
        if not statically_known_true(stride >= span) or statically_known_true(stride == 0):
            return None
        span = stride * size
    return Layout(tuple(shape), tuple(meta.stride()))


def same_strides(a: Layout, b: Layout) -> bool:
    """Equal strides wherever a dim has more than one element (a symbolic stride: the same expression)."""
    return all(
        same_sizes((x,), (y,)) or (type(size) is int and size == 1) for x, y, size in zip(a.stride, b.stride, a.size)
    )


@dataclass
class LoweringContext:
    graph: LoweredGraph
    buffers: dict[str, Buffer] = field(default_factory=dict)
    fallback_ops: list[str] = field(default_factory=list)
    fallback_random: bool = False  # random ops call aten (config.fallback_random)
    saved_outputs: frozenset[str] = frozenset()  # outputs the backward reads (lower/graph.py SAVED_OUTPUTS)
    random_counters: int = 0  # Philox counters taken by earlier random ops (Note: counter-based random numbers)
    mutations: list = field(default_factory=list)  # pending stores into inputs (lower/mutation.py)
    # what the backend the graph's kernels go to can do (Note: backends, backend.py): the ops it
    # cannot render, whether its reductions fold in eager's CPU order; never which backend it is
    unrenderable: frozenset[Ops] = frozenset()
    ordered_reductions: bool = True
    _counter: int = 0

    def new_name(self, prefix: str = "buf") -> str:
        self._counter += 1
        return f"{prefix}{self._counter - 1}"

    def reduce_range(self, size: int) -> UOp:
        """A fresh reduction loop variable; reductions never share one (codegen relies on it)."""
        self._counter += 1
        return UOp.range(size, self._counter, RangeKind.REDUCE)

    def add_buffer(self, buffer: Buffer) -> Buffer:
        self.buffers[buffer.name] = buffer
        return buffer

    def realize(self, x: TensorValue, origin: str, layout: Layout | None = None, fresh: bool = False) -> BufferRef:
        """A buffer holding `x`: the one it already reads when it is a plain strided read
        (unless `fresh`), else a new computed buffer with `layout` (contiguous by default)."""
        if not fresh and (read := as_strided_read(x)) is not None:
            name, read_layout = read
            if layout is None or read_layout == layout:
                return BufferRef(name, read_layout, x.dtype)
        layout = layout or Layout.contiguous(x.shape)
        buffer = self.add_buffer(Buffer(self.new_name(), x.dtype, layout, "computed"))
        self.graph.steps.append(ComputedBuffer(buffer, x.body, (origin,)))
        return BufferRef(buffer.name, layout, x.dtype)

    def realized(self, x: TensorValue, origin: str) -> TensorValue:
        ref = self.realize(x, origin)
        return load(self.buffers[ref.name], ref.layout)

    def extern(self, op: Any, args: tuple, kwargs: dict, result_meta: Any, origin: str, fallback: bool,
               argument_metas: tuple | None = None) -> Any:  # fmt: skip
        """Call aten `op` on realized arguments; returns TensorValues shaped like its result.
        `argument_metas`: the fake values eager's arguments had, as (args, kwargs) with a fake
        tensor for each TensorValue (Note: extern arguments in eager's strides)."""
        matmul = getattr(op, "overloadpacket", op) in MATMUL_OPS
        flat, spec = tree_flatten((args, kwargs))
        metas = tree_flatten(argument_metas)[0] if argument_metas is not None else []
        metas = metas if len(metas) == len(flat) else [None] * len(flat)
        refs = [self._argument_ref(a, meta, origin, matmul) for a, meta in zip(flat, metas)]
        args, kwargs = tree_unflatten(refs, spec)
        metas, _ = tree_flatten(result_meta)
        outputs = [self._extern_output(m) for m in metas if isinstance(m, torch.Tensor)]
        structure = "single" if isinstance(result_meta, torch.Tensor) else len(metas)
        positions = tuple(i for i, m in enumerate(metas) if isinstance(m, torch.Tensor))
        communication = communication_of(op)
        self.graph.steps.append(
            ExternCall(op, args, kwargs, outputs, structure, positions, origin, fallback, communication)
        )
        if fallback:
            self.fallback_ops.append(str(op))
        if _returns_alias(op):
            self.graph.aliasing_outputs |= {b.name for b in outputs}
        values = [load(b) for b in outputs]
        if structure == "single":
            return values[0]
        it = iter(values)
        return tuple(next(it) if isinstance(m, torch.Tensor) else m for m in metas)

    def _argument_ref(self, a: Any, meta: Any, origin: str, matmul: bool) -> Any:
        """Note: extern arguments in eager's strides
        Lowering folds a copy that only changes strides (`clone(x, memory_format=contiguous)`,
        which AOTAutograd puts before aten ops whose kernels assume contiguous inputs, as
        embedding_bag's indices) into a plain read of x, so the copy would vanish and the op
        would get x's strides. An argument that is a plain read is passed as is only when its
        strides are eager's (or eager's are not dense: eager passed a strided view too); otherwise
        it is copied into eager's dense layout. An argument eager passed as a slice of a padded
        tensor (sdpa's attention bias, rows padded to a multiple of 8, which CUDA's
        memory-efficient kernel requires) is stored with eager's gaps. Other arguments are
        realized contiguous (matmul operands: Note: transposed matmul operands)."""
        if not isinstance(a, TensorValue):
            return a
        if matmul:
            return self.realize(a, origin, matmul_operand_layout(a))
        if (eager := eager_argument_layout(a, meta)) is not None:
            return self.realize(a, origin, eager, fresh=True)
        return with_eager_unit_strides(self.realize(a, origin), meta)

    def _extern_output(self, meta: torch.Tensor) -> Buffer:
        """The buffer for an aten result, in the strides its fake tensor gives, unless those
        repeat elements (stride 0 along a longer dim): an aten op never writes a result that
        way, and a fake kernel that copies its input's strides (as_strided_scatter of an
        expanded input) would make the wrapper copy the real result into an overlapping
        layout (`ensure_layout`), which raises. Such a result is kept row-major."""
        dtype = from_torch(meta.dtype)
        shape, stride = tuple(meta.shape), tuple(meta.stride())
        repeats = any(st == 0 and size > 1 for size, st in zip(shape, stride))
        layout = Layout.contiguous(shape) if repeats else Layout(shape, stride, 0)
        return self.add_buffer(Buffer(self.new_name(), dtype, layout, "extern"))


def eager_argument_layout(a: TensorValue, meta: Any) -> Layout | None:
    """The layout an extern call's argument `a` is copied into, eager's (Note: extern arguments in
    eager's strides), or None where the call is given `a` as it is read."""
    read, eager = as_strided_read(a), dense_layout(meta, a.shape) or gapped_layout(meta, a.shape)
    if eager is not None and (read is None or not same_strides(read[1], eager)):
        return eager
    return None


def _returns_alias(op: Any) -> bool:
    """Whether an aten op may return a view of an argument (its schema says a result aliases one)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def with_eager_unit_strides(ref: BufferRef, meta: Any) -> BufferRef:
    """`ref` with torch's strides along its size-1 dims: eager's where it has one, else what a
    contiguous tensor has there (1 for the last dim). Such a stride never moves an address, so
    ember's views leave it 0, but some kernels check it: cuDNN's attention backward wants stride 1
    for the last dim of its (batch, heads, rows, 1) statistics."""
    size, old = ref.layout.size, ref.layout.stride
    same = isinstance(meta, torch.Tensor) and same_sizes(tuple(meta.shape), size)
    eager = tuple(meta.stride()) if same else (0,) * len(size)
    stride = list(old)
    for i in reversed(range(len(size))):  # asking no guard of symbolic sizes (Note: symbolic sizes)
        if known_one(size[i]):
            inner = stride[i + 1] * torch.sym_max(size[i + 1], 1) if i + 1 < len(size) else 1
            stride[i] = next(s for s in (eager[i], inner, 1) if not known_zero(s))
    if same_sizes(tuple(stride), old):
        return ref
    return BufferRef(ref.name, Layout(size, tuple(stride), ref.layout.offset), ref.dtype)
