"""Stage `schedule`: the lowered program -> kernels and extern calls, in order.

    build_nodes     one node per computed buffer / extern call, dependencies from UOp bodies
    eliminate_dead  drop computations nothing reads
    fuse            the fusion loop (fusion.py), with a reason for every refusal
    horizontal      independent small elementwise kernels launched as one (horizontal.py)
    order           topological order of the groups; what each kernel must store
    collectives     each collective issued early, its wait late (collectives.py)

A buffer written and fully consumed inside one kernel is never stored nor allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch.utils._pytree import tree_flatten

from ember.ir import Buffer, BufferRef, ComputedBuffer, ExternCall, IndexedStore, LoweredGraph
from ember.schedule.collectives import Overlap, collective_overlaps, place_collectives
from ember.schedule.fusion import FusionState, Group, WhyNoFuse, fuse
from ember.schedule.horizontal import HorizontalPlan, group_horizontally
from ember.schedule.memory import last_use_positions
from ember.schedule.nodes import SchedulerNode, build_nodes, mutated_buffers
from ember.schedule.order import ScheduleWork
from ember.uop.ops import Ops, UOp
from ember.uop.variables import size_hint


@dataclass
class KernelStep:
    group: list[ComputedBuffer | IndexedStore]  # an IndexedStore is always alone
    stored: set[str]  # members written to memory; the rest are kernel-local
    # what the fusion check computed for a fused group, so codegen does not compute it again
    alignment: tuple | None = None
    bodies: dict[str, UOp] | None = None
    # a horizontal kernel (Note: horizontal fusion, horizontal.py): its independent parts, each a kernel
    # of its own loops, launched as one; `group` and `stored` are then the parts' together
    parts: tuple[KernelStep, ...] = ()

    @property
    def writes(self) -> list[str]:
        return [c.name for c in self.group if c.name in self.stored]

    @property
    def reads(self) -> list[str]:
        members = {c.name for c in self.group}
        names = [u.arg.name for c in self.group for u in c.body.toposort if u.op is Ops.BUFFER]
        return [n for n in dict.fromkeys(names) if n not in members]


Step = KernelStep | ExternCall


@dataclass
class Schedule:
    steps: list[Step]
    refusals: list[WhyNoFuse] = field(default_factory=list)
    fusions: int = 0
    work: ScheduleWork = field(default_factory=ScheduleWork)
    overlaps: list[Overlap] = field(default_factory=list)  # per collective (Note: collectives in the graph)
    horizontal_groups: int = 0  # horizontal kernels (Note: horizontal fusion)
    horizontal_parts: int = 0  # the kernels they launch together


def schedule(graph: LoweredGraph, fusion: bool = True, blocks: bool = False, horizontal: bool = True,
             overlap: bool = True, in_flight: int = 0) -> Schedule:  # fmt: skip
    """`blocks`: the kernels run as blocks of GPU programs (Note: fusions that starve the GPU);
    `horizontal`: independent small elementwise kernels launch as one (Note: horizontal fusion);
    `overlap`: collectives issued early and waited for late, at most `in_flight` at a time (0: no
    bound; Note: collectives in the graph)."""
    nodes = eliminate_dead(build_nodes(graph), graph)
    # an input stored in place is written like an output, and allocates nothing
    outputs = {o.ref.name for o in graph.outputs if o.ref is not None} | set(graph.mutated_inputs)
    # bytes at the example's sizes where they are symbolic: scores and peaks are estimates (Note: symbolic sizes)
    nbytes = {c.name: size_hint(c.buffer.layout.storage_size) * c.buffer.dtype.itemsize if c.buffer.kind != "input"
              else 0 for c in _computed(nodes)}  # fmt: skip
    state = FusionState([Group([n]) for n in nodes], outputs, nbytes, blocks)  # the program order is topological
    if fusion:
        state = fuse(state)
    plan = group_horizontally(state) if fusion and horizontal else HorizontalPlan([[g] for g in state.groups], [])
    steps: list[Step] = []
    for unit in plan.units:
        if unit[0].is_extern:
            steps.append(unit[0].nodes[0].step)  # type: ignore[arg-type]
            continue
        parts = [KernelStep(g.computed, state.stored(g), g.alignment, g.bodies) for g in unit]
        if len(parts) == 1:
            steps.append(parts[0])
        else:
            stored = set().union(*(p.stored for p in parts))
            steps.append(KernelStep([c for p in parts for c in p.group], stored, parts=tuple(parts)))
    steps = place_collectives(steps, reads_of, _writes_and_mutations, overlap, in_flight)
    horizontal_units = plan.horizontal
    return Schedule(steps, state.refusals + plan.refusals, state.fusions, state.work, collective_overlaps(steps),
                    len(horizontal_units), sum(len(u) for u in horizontal_units))  # fmt: skip


def _computed(nodes: list[SchedulerNode]) -> list[ComputedBuffer]:
    return [n.step for n in nodes if isinstance(n.step, ComputedBuffer)]


def eliminate_dead(nodes: list[SchedulerNode], graph: LoweredGraph) -> list[SchedulerNode]:
    """Computed buffers that no output (nor store into an input) needs; externs stay (they may
    have side effects)."""
    needed = {o.ref.name for o in graph.outputs if o.ref is not None} | set(graph.mutated_inputs)
    alive: list[SchedulerNode] = []
    for node in reversed(nodes):
        if node.is_extern or any(b in needed for b in node.writes):
            alive.append(node)
            needed |= node.read_buffers
    return list(reversed(alive))


def reads_of(step: Step) -> list[str]:
    """The buffers a step reads; a wait also the inputs of its collective, which it keeps alive."""
    if isinstance(step, KernelStep):
        return step.reads
    refs, _ = tree_flatten((step.args, step.kwargs))
    return list(dict.fromkeys([*(r.name for r in refs if isinstance(r, BufferRef)), *step.keeps_alive]))


def writes_of(step: Step) -> list[str]:
    return step.writes if isinstance(step, KernelStep) else [b.name for b in step.outputs]


def _writes_and_mutations(step: Step) -> list[str]:
    return writes_of(step) if isinstance(step, KernelStep) else [*writes_of(step), *mutated_buffers(step)]


def graph_last_uses(graph: LoweredGraph, steps: list[Step]) -> list[list[str]]:
    """`last_uses` of the wrapper's buffers: inputs, constants and outputs are never freed.

    Note: a view's base lives as long as the view
        An aten op that returns a view (`as_strided` run as an extern: Longformer's sliding
        windows) gives a result sharing its argument's storage. The wrapper freeing the argument
        at its own last read is harmless (the view holds the storage), but the planner would hand
        that storage to a later buffer (a Reuse) while the view is still read: its values
        overwritten, silently. So a read of a view counts as a read of what it views (through
        views of views), and what a returned view views is never freed."""
    outputs = {o.ref.name for o in graph.outputs if o.ref is not None}
    bases = view_bases(graph, steps)
    returned = {base for name in outputs for base in bases.get(name, ())}
    keep = outputs | returned | {b.name for b in graph.inputs} | set(graph.constants)
    return last_uses(steps, keep, reads_through_views(bases))


def view_bases(graph: LoweredGraph, steps: list[Step]) -> dict[str, set[str]]:
    """For each result of an aten op that may return a view (LoweredGraph.aliasing_outputs), the
    buffers whose storage it may share: those its call read, and what those view in turn."""
    bases: dict[str, set[str]] = {}
    for step in steps:
        if not isinstance(step, ExternCall):
            continue
        views = [b.name for b in step.outputs if b.name in graph.aliasing_outputs]
        if views:
            read = {base for name in reads_of(step) for base in (name, *bases.get(name, ()))}
            bases |= {name: read for name in views}
    return bases


def reads_through_views(bases: dict[str, set[str]]) -> Callable[[Step], list[str]]:
    """`reads_of`, with each view read counting as a read of its bases (Note: a view's base lives
    as long as the view)."""

    def reads(step: Step) -> list[str]:
        names = reads_of(step)
        return [*names, *(base for name in names for base in bases.get(name, ()))]

    return reads


def dying_buffers(graph: LoweredGraph, steps: list[Step]) -> list[dict[str, Buffer]]:
    """For each step, the buffers that die with it and that a kernel of it may write over (Note:
    in-place kernels, codegen/kernel.py): the wrapper's buffers at their last use, and donated
    inputs at theirs (Note: donated inputs, donation.py). Never one that an aten view op's result
    may share storage with: an aliasing result, or a buffer such an op reads (its view lives on)."""
    outputs = {o.ref.name for o in graph.outputs if o.ref is not None}
    viewed = {name for step in steps if isinstance(step, ExternCall)
              and any(b.name in graph.aliasing_outputs for b in step.outputs) for name in reads_of(step)}  # fmt: skip
    mutated = {name for step in steps if isinstance(step, ExternCall) for name in mutated_buffers(step)}
    owned = graph.donated_inputs - outputs - viewed - mutated - set(graph.mutated_inputs)
    kept = outputs | {b.name for b in graph.inputs if b.name not in owned} | set(graph.constants)
    never = graph.aliasing_outputs | viewed
    return [{n: graph.buffers[n] for n in names if n not in never} for names in last_uses(steps, keep=kept)]


def last_uses(steps: list[Step], keep: set[str], reads: Callable[[Step], list[str]] = reads_of) -> list[list[str]]:
    """For each step, the buffers whose last reader (or writer) it is, except those in `keep`."""
    freed: list[list[str]] = [[] for _ in steps]
    for name, i in last_use_positions(steps, reads, writes_of, keep).items():
        freed[i].append(name)
    return freed
