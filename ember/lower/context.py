"""The state of lowering one FX graph: named buffers, realized values, fallback calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ember.ir import Buffer, BufferRef, ComputedBuffer, ExternCall, Layout, LoweredGraph
from ember.lower.values import TensorValue, as_strided_read, load
from ember.uop.dtypes import from_torch
from ember.uop.ops import UOp

# Reduce loops nest inside every output loop; numbering them past any output axis keeps
# loop order well defined before codegen renumbers them.
REDUCE_AXIS_BASE = 1 << 20


@dataclass
class LoweringContext:
    graph: LoweredGraph
    buffers: dict[str, Buffer] = field(default_factory=dict)
    fallback_ops: list[str] = field(default_factory=list)
    fallback_random: bool = False  # random ops call aten (config.fallback_random)
    random_counters: int = 0  # Philox counters taken by earlier random ops (Note: counter-based random numbers)
    backend: str = "cpp"  # the renderer the graph's kernels go to: "cpp" | "triton"
    _counter: int = 0

    def new_name(self, prefix: str = "buf") -> str:
        self._counter += 1
        return f"{prefix}{self._counter - 1}"

    def reduce_range(self, size: int) -> UOp:
        """A fresh reduction loop variable; reductions never share one (codegen relies on it)."""
        self._counter += 1
        return UOp.range(size, REDUCE_AXIS_BASE + self._counter, reduce=True)

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

    def extern(self, op: Any, args: tuple, kwargs: dict, result_meta: Any, origin: str, fallback: bool) -> Any:
        """Call aten `op` on realized arguments; returns TensorValues shaped like its result."""
        to_ref = lambda a: self.realize(a, origin) if isinstance(a, TensorValue) else a  # noqa: E731
        args, kwargs = tree_map(to_ref, args), tree_map(to_ref, kwargs)
        metas, _ = tree_flatten(result_meta)
        outputs = [self._extern_output(m) for m in metas if isinstance(m, torch.Tensor)]
        structure = "single" if isinstance(result_meta, torch.Tensor) else len(metas)
        positions = tuple(i for i, m in enumerate(metas) if isinstance(m, torch.Tensor))
        self.graph.steps.append(ExternCall(op, args, kwargs, outputs, structure, positions, origin, fallback))
        if fallback:
            self.fallback_ops.append(str(op))
        values = [load(b) for b in outputs]
        if structure == "single":
            return values[0]
        it = iter(values)
        return tuple(next(it) if isinstance(m, torch.Tensor) else m for m in metas)

    def _extern_output(self, meta: torch.Tensor) -> Buffer:
        dtype = from_torch(meta.dtype)
        layout = Layout(tuple(meta.shape), tuple(meta.stride()), 0)
        return self.add_buffer(Buffer(self.new_name(), dtype, layout, "extern"))
