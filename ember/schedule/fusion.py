"""The fusion loop (seed 001): merge groups of computed buffers into kernels.

Each round lists candidate pairs (groups that share a buffer), best first by bytes of
memory traffic saved, then by closeness in program order, and merges every pair that
`why_no_fuse` accepts. Rounds repeat until nothing changes. Every refusal is recorded
with its reason (`WhyNoFuse`), for `EMBER_DEBUG` and `ember.explain`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.ir import ComputedBuffer
from ember.schedule.group import align, recomputed_member, resolve_bodies
from ember.schedule.memory import peak_bytes
from ember.schedule.nodes import SchedulerNode
from ember.uop.ops import Ops

MAX_ROUNDS = 10
MAX_FUSED_NODES = 64


@dataclass(eq=False)
class Group:
    """Scheduler nodes that become one kernel (or a single extern call)."""

    nodes: list[SchedulerNode]

    @property
    def position(self) -> int:
        return min(n.position for n in self.nodes)

    @property
    def is_extern(self) -> bool:
        return self.nodes[0].is_extern

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def computed(self) -> list[ComputedBuffer]:
        return [n.step for n in self.nodes]  # type: ignore[misc]

    def writes(self) -> set[str]:
        return {b for n in self.nodes for b in n.writes}

    def reads(self) -> set[str]:
        return {b for n in self.nodes for b in n.read_buffers}


@dataclass(frozen=True)
class WhyNoFuse:
    first: tuple[str, ...]
    second: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        return f"cannot fuse {'+'.join(self.first)} with {'+'.join(self.second)}: {self.reason}"


@dataclass
class FusionState:
    groups: list[Group]
    outputs: set[str]  # buffers that must be stored: graph outputs
    nbytes: dict[str, int]
    refusals: list[WhyNoFuse] = field(default_factory=list)
    fusions: int = 0
    partials: set[str] = field(init=False)  # split reductions' partials buffers (GPU graphs only)

    def __post_init__(self) -> None:
        self.partials = {n.name for g in self.groups for n in g.nodes
                         if isinstance(n.step, ComputedBuffer) and n.step.split_partials}  # fmt: skip

    def group_of(self) -> dict[SchedulerNode, Group]:
        return {n: g for g in self.groups for n in g.nodes}

    def stored(self, group: Group, groups: list[Group] | None = None) -> set[str]:
        """Buffers a group must write to memory: outputs, and what other groups read."""
        outside = {b for g in (groups or self.groups) if g is not group for b in g.reads()}
        return {b for b in group.writes() if b in self.outputs or b in outside or group.is_extern}


def fuse(state: FusionState) -> FusionState:
    for _ in range(MAX_ROUNDS):
        merged: set[Group] = set()
        for a, b in candidate_pairs(state):
            if a in merged or b in merged:
                continue
            reason = why_no_fuse(state, a, b)
            if reason is not None:
                state.refusals.append(WhyNoFuse(tuple(a.names), tuple(b.names), reason))
                continue
            fused = Group(sorted(a.nodes + b.nodes, key=lambda n: n.position))
            state.groups = [g for g in state.groups if g is not a and g is not b] + [fused]
            state.groups = topological_order(state.groups)
            merged |= {a, b, fused}
            state.fusions += 1
        if not merged:
            break
    return state


def candidate_pairs(state: FusionState) -> list[tuple[Group, Group]]:
    users: dict[str, list[Group]] = {}
    for g in state.groups:
        if any(n.runs_alone for n in g.nodes):  # externs, stores at computed positions, scans
            continue
        for b in g.reads() | g.writes():
            users.setdefault(b, []).append(g)
    scores: dict[tuple[Group, Group], int] = {}
    for buffer, groups in users.items():
        for i, a in enumerate(groups):
            for b in groups[i + 1 :]:
                pair = (a, b) if a.position <= b.position else (b, a)
                scores[pair] = scores.get(pair, 0) + state.nbytes.get(buffer, 0)
    return sorted(scores, key=lambda p: (-scores[p], abs(p[1].position - p[0].position), p[0].position))


def why_no_fuse(state: FusionState, a: Group, b: Group) -> str | None:
    """None when `a` and `b` can become one kernel, else the reason they cannot."""
    if len(a.nodes) + len(b.nodes) > MAX_FUSED_NODES:
        return f"the kernel would have more than {MAX_FUSED_NODES} nodes"
    members = sorted(a.nodes + b.nodes, key=lambda n: n.position)
    alignment = align([n.step.buffer.layout.size for n in members])
    if alignment is None:
        return "iteration spaces differ: " + " vs ".join(str(n.step.buffer.layout.size) for n in members)
    if (member := recomputed_member([n.step.buffer.layout.size for n in members], alignment)) is not None:
        return f"{members[member].name} would be recomputed in an inner loop it does not use"
    if (partials := reads_partials(a, b) or reads_partials(b, a)) is not None:
        return f"{partials} holds a split reduction's partials: its reader reduces them in another kernel"
    if (through := cycle_through(state, a, b)) is not None:
        return f"fusion would create a cycle through {through}"
    bodies = resolve_bodies([n.step for n in members])
    if isinstance(bodies, str):
        return bodies
    if (recomputed := recomputed_reduction(bodies, alignment)) is not None:
        return f"the reduction in {recomputed} would be recomputed for every element of an inner loop"
    if all(split_reduction_member(state, n) for n in members):
        return None  # a few KiB held longer: one kernel reads the data (or the partials) once
    return peak_memory_refusal(state, a, b)


SMALL_BYTES = 1 << 16


def split_reduction_member(state: FusionState, node: SchedulerNode) -> bool:
    """Partials of a split reduction, or a small result that reduces some (Note: split reductions)."""
    step = node.step
    if not state.partials or not isinstance(step, ComputedBuffer):
        return False
    if step.split_partials:
        return True
    return state.nbytes.get(step.name, 0) <= SMALL_BYTES and bool(node.read_buffers & state.partials)


def reads_partials(producer: Group, consumer: Group) -> str | None:
    """A split reduction's partials fused into their reader would be the reduction in one program
    again, inside another reduction's loop (Note: split reductions, lower/split_reductions.py)."""
    partials = {n.name for n in producer.nodes if isinstance(n.step, ComputedBuffer) and n.step.split_partials}
    read = partials & consumer.reads()
    return next(iter(sorted(read))) if read else None


def cycle_through(state: FusionState, a: Group, b: Group) -> str | None:
    """A group on a path between `a` and `b`: fusing them would make it both before and after."""
    between = (descendants(state, a) & ancestors(state, b)) | (descendants(state, b) & ancestors(state, a))
    between -= {a, b}
    return "+".join(next(iter(between)).names) if between else None


def _edges(state: FusionState) -> dict[Group, set[Group]]:
    owner = state.group_of()
    return {g: {owner[d] for n in g.nodes for d in n.depends_on if owner[d] is not g} for g in state.groups}


def ancestors(state: FusionState, group: Group) -> set[Group]:
    return _reach(group, _edges(state))


def descendants(state: FusionState, group: Group) -> set[Group]:
    successors: dict[Group, set[Group]] = {g: set() for g in state.groups}
    for g, preds in _edges(state).items():
        for p in preds:
            successors[p].add(g)
    return _reach(group, successors)


def _reach(start: Group, edges: dict[Group, set[Group]]) -> set[Group]:
    seen: set[Group] = set()
    stack = list(edges.get(start, ()))
    while stack:
        g = stack.pop()
        if g not in seen:
            seen.add(g)
            stack.extend(edges.get(g, ()))
    return seen


def recomputed_reduction(bodies: dict, alignment: tuple) -> str | None:
    """A reduction is computed once per value of the loops it depends on only when those are
    outer loops; one that depends on an inner loop alone would run again for each outer one."""
    _, placements = alignment
    for (name, body), placement in zip(bodies.items(), placements):
        for u in body.toposort:
            if u.op is not Ops.REDUCE:
                continue
            dims = sorted({placement[a.arg] for a in u.toposort if a.op is Ops.AXIS})
            if dims != list(range(len(dims))):
                return name
    return None


def peak_memory_refusal(state: FusionState, a: Group, b: Group) -> str | None:
    fused = Group(sorted(a.nodes + b.nodes, key=lambda n: n.position))
    after = [g for g in state.groups if g is not a and g is not b] + [fused]
    before_peak, after_peak = schedule_peak(state, state.groups), schedule_peak(state, topological_order(after))
    if after_peak > before_peak:
        return f"fusion would raise peak memory from {before_peak} to {after_peak} bytes"
    return None


def schedule_peak(state: FusionState, groups: list[Group]) -> int:
    return peak_bytes(
        groups,
        reads=lambda g: g.reads(),
        writes=lambda g: state.stored(g, groups),
        nbytes=lambda b: state.nbytes.get(b, 0),
        never_freed=state.outputs,
    )


def topological_order(groups: list[Group]) -> list[Group]:
    """Groups in dependency order, earliest program position first among the ready ones."""
    owner = {n: g for g in groups for n in g.nodes}
    preds = {g: {owner[d] for n in g.nodes for d in n.depends_on if owner[d] is not g} for g in groups}
    done: set[Group] = set()
    order: list[Group] = []
    remaining = sorted(groups, key=lambda g: g.position)
    while remaining:
        ready = next((g for g in remaining if preds[g] <= done), None)
        if ready is None:
            raise RuntimeError("schedule: dependency cycle between groups")
        order.append(ready)
        done.add(ready)
        remaining.remove(ready)
    return order
