"""Scheduler nodes and their dependencies, read from the lowered program.

A node is one computed buffer (a UOp body) or one extern call. Its reads are
`MemoryDep(buffer, index)` for each LOAD in a body (index in the node's own axes),
`StarDep(buffer)` for whole-buffer reads (extern arguments), and `WeakDep(buffer)` for
ordering only (a later mutation of a buffer must wait for its earlier readers).
An `IndexedStore` mutates a buffer an earlier step created: it also reads that buffer
(`StarDep`), so it runs after the step that created it and before every later reader.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from torch.utils._pytree import tree_flatten

from ember.ir import BufferRef, Communication, ComputedBuffer, ExternCall, IndexedStore, LoweredGraph
from ember.uop.ops import Ops, UOp


@dataclass(frozen=True)
class MemoryDep:
    buffer: str
    index: UOp


@dataclass(frozen=True)
class StarDep:
    buffer: str


@dataclass(frozen=True)
class WeakDep:
    buffer: str


Dep = MemoryDep | StarDep | WeakDep


@dataclass(eq=False)
class SchedulerNode:
    step: ComputedBuffer | IndexedStore | ExternCall
    position: int  # in the lowered program's order
    reads: list[Dep] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)
    depends_on: set[SchedulerNode] = field(default_factory=set)  # direct predecessors

    @property
    def name(self) -> str:
        return self.step.name

    @property
    def is_extern(self) -> bool:
        return isinstance(self.step, ExternCall)

    @functools.cached_property
    def runs_alone(self) -> bool:
        """Never fused: externs, stores at computed positions and scans (whose scanned dim is
        a sequential loop no other member could share)."""
        step = self.step
        if isinstance(step, ComputedBuffer):
            return any(u.op is Ops.SCAN for u in step.body.toposort)
        return True

    @functools.cached_property
    def read_buffers(self) -> frozenset[str]:
        # WeakDeps, the only reads added after a node is made, are not reads of data
        return frozenset(d.buffer for d in self.reads if not isinstance(d, WeakDep))

    def __repr__(self) -> str:
        return f"SchedulerNode({self.name})"


def build_nodes(graph: LoweredGraph) -> list[SchedulerNode]:
    nodes = [_node(step, i) for i, step in enumerate(graph.steps)]
    _waits_finish_mutations(nodes)
    _add_mutation_order(nodes)
    writers: dict[str, list[SchedulerNode]] = {}
    for n in nodes:
        for b in n.writes:
            writers.setdefault(b, []).append(n)
    for n in nodes:  # each read depends on the latest earlier write of its buffer
        for d in n.reads:
            earlier = [w for w in writers.get(d.buffer, []) if w.position < n.position]
            if earlier:
                n.depends_on.add(earlier[-1])
    return nodes


def _node(step: ComputedBuffer | IndexedStore | ExternCall, position: int) -> SchedulerNode:
    if isinstance(step, (ComputedBuffer, IndexedStore)):
        reads: list[Dep] = [
            MemoryDep(u.src[0].arg.name, u.src[1])
            for u in step.body.toposort
            if u.op is Ops.INDEX and u.src[0].op is Ops.BUFFER
        ]
        if isinstance(step, IndexedStore):
            reads.append(StarDep(step.name))
        return SchedulerNode(step, position, list(dict.fromkeys(reads)), [step.name])
    refs, _ = tree_flatten((step.args, step.kwargs))
    reads = list(dict.fromkeys(StarDep(r.name) for r in refs if isinstance(r, BufferRef)))
    return SchedulerNode(step, position, reads, [b.name for b in step.outputs] + mutated_buffers(step))


def mutated_buffers(step: ExternCall) -> list[str]:
    """Buffers an extern writes in place (aten schema: an argument with alias_info.is_write)."""
    schema = getattr(step.op, "_schema", None)
    if schema is None:
        return []
    mutated = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = step.args[i] if i < len(step.args) else step.kwargs.get(argument.name)
        if isinstance(value, BufferRef):
            mutated.append(value.name)
    return mutated


def writes_input(step: ComputedBuffer | IndexedStore | ExternCall) -> bool:
    """A computed buffer stored into a graph input (Note: inputs written in place, lower/mutation.py)."""
    return isinstance(step, ComputedBuffer) and step.buffer.kind == "input"


def _waits_finish_mutations(nodes: list[SchedulerNode]) -> None:
    """A collective that mutates a buffer (`all_reduce_`) is done with it only at its wait, so the
    wait counts as a write of it too: its readers depend on the wait (Note: collectives in the
    graph, schedule/collectives.py)."""
    mutated_by_result: dict[str, list[str]] = {}
    for node in nodes:
        step = node.step
        if not isinstance(step, ExternCall) or step.communication is None:
            continue
        if step.communication is Communication.START:
            for b in step.outputs:
                mutated_by_result[b.name] = mutated_buffers(step)
        else:
            refs, _ = tree_flatten((step.args, step.kwargs))
            for ref in refs:
                if isinstance(ref, BufferRef):
                    node.writes += [b for b in mutated_by_result.get(ref.name, []) if b not in node.writes]


def _add_mutation_order(nodes: list[SchedulerNode]) -> None:
    """A node that mutates a buffer must run after every earlier reader of it (WeakDep)."""
    readers: dict[str, list[SchedulerNode]] = {}  # buffer -> its readers so far, in order
    for node in nodes:
        if isinstance(node.step, IndexedStore) or writes_input(node.step):
            mutated = [node.step.name]
        elif isinstance(node.step, ExternCall):
            mutated = mutated_buffers(node.step)
        else:
            mutated = []
        for buffer in mutated:
            node.reads.extend(WeakDep(earlier.name) for earlier in readers.get(buffer, ()))
        for buffer in node.read_buffers:
            readers.setdefault(buffer, []).append(node)
