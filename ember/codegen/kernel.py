"""Stage `codegen`, step 1: a group of computed buffers -> one kernel AST.

The AST is `SINK(STORE(INDEX(out, idx), value), …)` over RANGEs, with every buffer renamed
to a positional parameter (p0, p1, …) so that identical computations in different graphs
have identical ASTs, identical source and one cache entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.ir import ComputedBuffer
from ember.uop.dtypes import dtypes
from ember.uop.ops import BufferArg, Ops, UOp, substitute


@dataclass(frozen=True)
class KernelAST:
    sink: UOp
    params: tuple[str, ...]  # wrapper buffer name of parameter i
    outputs: frozenset[str]  # the params the kernel writes


def build_kernel_ast(group: list[ComputedBuffer]) -> KernelAST:
    stores = []
    axis_base = 0
    for computed in group:
        stores.append(_store(computed, axis_base))
        axis_base += len(computed.buffer.layout.size)
    sink = UOp(Ops.SINK, dtypes.void, tuple(stores))
    return _rename_buffers(sink, frozenset(c.name for c in group))


def _store(computed: ComputedBuffer, axis_base: int) -> UOp:
    """STORE of `computed`'s body over fresh ranges; size-1 dims need no loop."""
    layout = computed.buffer.layout
    loop_vars = [
        UOp.range(size, axis_base + i) if size != 1 else UOp.const(dtypes.index, 0)
        for i, size in enumerate(layout.size)
    ]
    mapping = {UOp(Ops.AXIS, dtypes.index, (), i): v for i, v in enumerate(loop_vars)}
    value = substitute(computed.body, mapping)
    out = computed.buffer.uop()
    return UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, out.dtype, (out, layout.index(loop_vars))), value))


def _rename_buffers(sink: UOp, outputs: frozenset[str]) -> KernelAST:
    buffers = [u for u in sink.toposort if u.op is Ops.BUFFER]
    # outputs first, then inputs in order of first use
    ordered = sorted(buffers, key=lambda b: (b.arg.name not in outputs, buffers.index(b)))
    names: list[str] = []
    mapping = {}
    for b in ordered:
        if b.arg.name in names:  # the same buffer viewed with two sizes: keep the larger
            continue
        names.append(b.arg.name)
    sizes = {n: max(b.arg.size for b in buffers if b.arg.name == n) for n in names}
    for b in buffers:
        i = names.index(b.arg.name)
        mapping[b] = UOp(Ops.BUFFER, b.dtype, (), BufferArg(f"p{i}", sizes[b.arg.name]))
    return KernelAST(substitute(sink, mapping), tuple(names), frozenset(f"p{names.index(n)}" for n in outputs))
