"""Stage `lower`: writes into graph inputs -> computed buffers stored into the input's own memory.

AOTAutograd (with keep_inference_input_mutations, frontend.py) ends an inference graph that
mutates its inputs with `copy_(input, new value)`: an optimizer step's parameters and states,
BatchNorm's running statistics. Each becomes a `ComputedBuffer` whose buffer *is* the input
(kind "input"), listed in `LoweredGraph.mutated_inputs`, so the kernel that computes the new
value stores it in place: no fresh output, no copy back by AOTAutograd's runtime wrapper.

Note: inputs written in place
    In the functional graph every read of an input is a read of its old contents. Stores into
    inputs are therefore emitted after every other step (outputs included), each after the
    stores whose values read the input it overwrites: the scheduler orders a write after the
    reads lowered before it (nodes.py WeakDep) and a read after the writes lowered before it, so
    lowering's order decides which contents a read sees. Two stores reading each other's old
    contents (a swap) cannot both go first: one value is computed into a fresh buffer before
    either store. A store whose value reads its own input at another element (a flip) or
    through a reduction also goes through a fresh buffer: one kernel would overwrite elements
    other iterations still read. The scheduler fuses a store into an input with the input's
    other readers only when each of them reads it at the stored element (fusion.py
    `unsafe_in_place_read`), so each element is read before the same iteration overwrites it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx

from ember.ir import Buffer, ComputedBuffer
from ember.lower.context import LoweringContext
from ember.lower.pointwise import operand
from ember.lower.registry import Unsupported, register
from ember.lower.values import TensorValue, axis
from ember.uop.ops import Ops
from ember.uop.symbolic import element_form

aten = torch.ops.aten


@dataclass
class InputMutation:
    buffer: Buffer  # the graph input written in place
    value: TensorValue  # its new contents, in the input's shape and dtype
    origin: str  # the copy_ node


@register(aten.copy_.default)
def lower_copy_into_input(ctx: LoweringContext, node: torch.fx.Node, dst, src, non_blocking=False) -> TensorValue:
    target = node.args[0]
    if not (isinstance(target, torch.fx.Node) and target.op == "placeholder" and isinstance(dst, TensorValue)):
        raise Unsupported("copy_ into a value that is not a graph input")
    buffer = ctx.buffers[target.name]
    if any(m.buffer is buffer for m in ctx.mutations):
        raise Unsupported(f"a second copy_ into input {buffer.name}")
    value = TensorValue(dst.shape, dst.dtype, operand(src, dst.shape, dst.dtype))
    if any(u.op in (Ops.REDUCE, Ops.SCAN) for u in value.body.toposort):
        value = ctx.realized(value, node.name)  # (Note: inputs written in place)
    ctx.mutations.append(InputMutation(buffer, value, node.name))
    return value


def emit_input_mutations(ctx: LoweringContext) -> None:
    """The stores into inputs, after every other step, in an order where no store's value reads an
    input stored before it (Note: inputs written in place). In rounds: each round stores every
    pending input that no other pending value reads. Each value's reads are collected once and
    counted per input, so a round costs one look-up per pending store, not a walk of every other
    value's body (an optimizer step stores hundreds of inputs)."""
    pending = [_apart_from_own_reads(ctx, m) for m in ctx.mutations]
    reads = [_inputs_read(m) for m in pending]
    readers = Counter(name for names in reads for name in names)  # input -> pending values reading it
    while pending:
        ready = [i for i, m in enumerate(pending) if readers[m.buffer.name] == (m.buffer.name in reads[i])]
        if not ready:  # each remaining input is read by another remaining value: compute one aside
            first = pending[0]
            readers.subtract(reads[0])
            pending[0] = InputMutation(first.buffer, ctx.realized(first.value, first.origin), first.origin)
            reads[0] = _inputs_read(pending[0])
            readers.update(reads[0])
            continue
        for i in ready:
            ctx.graph.steps.append(ComputedBuffer(pending[i].buffer, pending[i].value.body, (pending[i].origin,)))
            ctx.graph.mutated_inputs.append(pending[i].buffer.name)
            readers.subtract(reads[i])
        done = set(ready)
        pending = [m for i, m in enumerate(pending) if i not in done]
        reads = [r for i, r in enumerate(reads) if i not in done]


def _inputs_read(m: InputMutation) -> set[str]:
    return {u.arg.name for u in m.value.body.toposort if u.op is Ops.BUFFER}


def _apart_from_own_reads(ctx: LoweringContext, m: InputMutation) -> InputMutation:
    """`m`, its value computed into a fresh buffer first when it reads its own input at another
    element than the one it stores."""
    stored = element_form(m.buffer.layout.index([axis(i) for i in range(len(m.buffer.layout.size))]))
    reads = [u.src[1] for u in m.value.body.toposort if u.op is Ops.INDEX and u.src[0].op is Ops.BUFFER
             and u.src[0].arg.name == m.buffer.name]  # fmt: skip
    if all(element_form(index) == stored for index in reads):
        return m
    return InputMutation(m.buffer, ctx.realized(m.value, m.origin), m.origin)
