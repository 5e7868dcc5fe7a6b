"""The fusion loop (after TorchInductor's scheduler): merge groups of computed buffers into kernels.

Each round lists candidate pairs (groups that share a buffer), best first by bytes of
memory traffic saved, then by closeness in program order, and merges every pair that
`why_no_fuse` accepts. Rounds repeat until nothing changes. Every refusal is recorded
with its reason (`WhyNoFuse`), for `EMBER_DEBUG` and `ember.explain`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ember.ir import ComputedBuffer
from ember.schedule.group import align, recomputed_member, resolve_bodies, unsafe_in_place_read
from ember.schedule.nodes import SchedulerNode
from ember.schedule.order import Plan, ScheduleOrder, ScheduleWork
from ember.uop.ops import Ops, UOp
from ember.uop.variables import size_hint

MAX_ROUNDS = 10
MAX_FUSED_NODES = 64


class Group:
    """Scheduler nodes that become one kernel (or a single extern call), in program order.
    A merged group keeps the alignment and bodies its fusion check computed, for codegen."""

    def __init__(self, nodes: list[SchedulerNode]):
        self.nodes = sorted(nodes, key=lambda n: n.position)
        self.position = self.nodes[0].position
        self.is_extern = self.nodes[0].is_extern
        self.runs_alone = any(n.runs_alone for n in self.nodes)
        self.writes = frozenset(b for n in self.nodes for b in n.writes)
        self.reads = frozenset(b for n in self.nodes for b in n.read_buffers)
        self.node_mask = sum(1 << n.position for n in self.nodes)  # its nodes, as a bit set by position
        self.alignment: tuple | None = None
        self.bodies: dict[str, UOp] | None = None

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def computed(self) -> list[ComputedBuffer]:
        return [n.step for n in self.nodes]  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Group({'+'.join(self.names)})"


@dataclass(frozen=True)
class WhyNoFuse:
    first: tuple[str, ...]
    second: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        return f"cannot fuse {'+'.join(self.first)} with {'+'.join(self.second)}: {self.reason}"


class FusionState:
    """The groups in order (order.py keeps them and their memory up to date), with every
    refusal and the work done."""

    def __init__(self, groups: list[Group], outputs: set[str], nbytes: dict[str, int], blocks: bool = False):
        self.work = ScheduleWork()
        # kernels run as blocks of programs (Triton): no fusion may leave a kernel's work to a
        # few programs (Note: fusions that starve the GPU)
        self.blocks = blocks
        self.order = ScheduleOrder(groups, outputs, nbytes, self.work)
        self.outputs, self.nbytes = outputs, nbytes
        self.refusals: list[WhyNoFuse] = []
        self.fusions = 0
        # split reductions' partials buffers (GPU graphs only)
        self.partials = {n.name for g in groups for n in g.nodes
                         if isinstance(n.step, ComputedBuffer) and n.step.split_partials}  # fmt: skip

    @property
    def groups(self) -> list[Group]:
        return self.order.groups

    def stored(self, group: Group) -> set[str]:
        return self.order.stored(group)


def fuse(state: FusionState) -> FusionState:
    for _ in range(MAX_ROUNDS):
        merged: set[Group] = set()
        for a, b in candidate_pairs(state):
            if a in merged or b in merged:
                continue
            state.work.pairs_examined += 1
            fused = why_no_fuse(state, a, b)
            if isinstance(fused, str):
                state.refusals.append(WhyNoFuse(tuple(a.names), tuple(b.names), fused))
                continue
            state.order.merge(a, b, fused.plan)
            merged |= {a, b, fused.group}
            state.fusions += 1
        state.order.compact()
        if not merged:
            break
    return state


# A group is paired with at most this many of the next groups using the same buffer: an input
# read by hundreds of groups (a weight, a mask) would otherwise list every pair of them.
MAX_PAIRS_PER_USER = 64


def candidate_pairs(state: FusionState) -> list[tuple[Group, Group]]:
    """Pairs of groups sharing a buffer, best first: most bytes shared, then closest in program
    order. A pair where one group depends on the other through a third node would close a
    cycle: only a group's nearest such partner per buffer stays a candidate (`why_no_fuse`
    refuses it, and `ember explain` says why); the others are left out, or a buffer every layer
    reads (the random seed, an attention mask) would pair each layer with each later one."""
    users: dict[str, list[Group]] = {}
    for g in state.groups:
        if g.runs_alone:  # externs, stores at computed positions, scans
            continue
        for b in g.reads | g.writes:
            users.setdefault(b, []).append(g)
    scores: dict[tuple[Group, Group], int] = {}
    cyclic: set[tuple[Group, Group]] = set()
    for buffer, groups in users.items():
        nbytes = state.nbytes.get(buffer, 0)
        for i, a in enumerate(groups):
            said = False
            for b in groups[i + 1 : i + 1 + MAX_PAIRS_PER_USER]:
                pair = (a, b) if a.position <= b.position else (b, a)
                if pair in cyclic:
                    continue
                if pair not in scores and state.order.node_path_between(*pair) is not None:
                    if said:
                        cyclic.add(pair)
                        continue
                    said = True
                scores[pair] = scores.get(pair, 0) + nbytes
    state.work.candidate_pairs += len(scores) + len(cyclic)
    return sorted(scores, key=lambda p: (-scores[p], abs(p[1].position - p[0].position), p[0].position))


@dataclass
class Fused:
    """A fusion `why_no_fuse` accepted: the merged group and where it goes in the schedule."""

    group: Group
    plan: Plan


def why_no_fuse(state: FusionState, a: Group, b: Group) -> str | Fused:
    """The merged group when `a` and `b` can become one kernel, else the reason they cannot."""
    if len(a.nodes) + len(b.nodes) > MAX_FUSED_NODES:
        return f"the kernel would have more than {MAX_FUSED_NODES} nodes"
    fused = Group(a.nodes + b.nodes)
    members = fused.nodes
    alignment = align([n.step.buffer.layout.size for n in members])
    if alignment is None:
        return "iteration spaces differ: " + " vs ".join(str(n.step.buffer.layout.size) for n in members)
    if (member := recomputed_member([n.step.buffer.layout.size for n in members], alignment)) is not None:
        return f"{members[member].name} would be recomputed in an inner loop it does not use"
    if (partials := reads_partials(a, b) or reads_partials(b, a)) is not None:
        return f"{partials} holds a split reduction's partials: its reader reduces them in another kernel"
    if (through := state.order.cycle_through(a, b)) is not None:
        return f"fusion would create a cycle through {'+'.join(through.names)}"
    bodies = resolve_bodies([n.step for n in members])
    if isinstance(bodies, str):
        return bodies
    if (recomputed := recomputed_reduction(bodies, alignment)) is not None:
        return f"the reduction in {recomputed} would be recomputed for every element of an inner loop"
    if (recomputed := inner_reduction_per_output(bodies)) is not None:
        return f"a reduction inside {recomputed}'s reduction would be computed again for each of its outputs"
    if (unsafe := unsafe_in_place_read([n.step for n in members], bodies, alignment)) is not None:
        return unsafe
    if state.blocks and (starved := starved_programs(members, bodies)) is not None:
        return starved
    if state.blocks and (repeated := stored_by_every_program(members)) is not None:
        return repeated
    fused.alignment, fused.bodies = alignment, bodies
    plan = state.order.plan(a, b, fused)
    if all(split_reduction_member(state, n) for n in members):
        return Fused(fused, plan)  # a few KiB held longer: one kernel reads the data (or the partials) once
    if (after := state.order.peak_after(plan)) > state.order.peak:
        return f"fusion would raise peak memory from {state.order.peak} to {after} bytes"
    return Fused(fused, plan)


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
    read = partials & consumer.reads
    return next(iter(sorted(read))) if read else None


# Note: fusions that starve the GPU
# A Triton kernel's programs walk its outputs (the x axis); whatever a member computes per
# element of a reduced loop runs inside that loop, on those few programs. Two fusions the C++
# renderer runs well (as loops over all threads) would so leave a GPU kernel's work to one or a
# few programs, and the scheduler refuses them for block backends (`Capabilities.blocks`):
#   - a reduction inside another reduction's loop: a row-wise reduction fused into a reduction
#     over those rows (cross-entropy's mean of per-row terms; x.sum(1).amax()): one program
#     walked every row, each row's reduction inside it (8192 rows of 32000 logits: 14 GB/s,
#     0.5% of copy bandwidth);
#   - a large member fused with a reduction that has few outputs (a language model's saved
#     log-softmax, 4096 x 32000, written by the program that sums the loss: 78 ms for 0.5 GB).
# Apart, the row-wise or large kernel runs on a program per block of its elements, and the
# small reduction reads its result (split in turn when it is long, lower/split_reductions.py).
STARVED_PROGRAMS = 256  # fewer outputs than this leave an H100's 132 SMs partly idle
STARVED_ELEMENTS = 32768  # ... which matters once a member has this much work


def starved_programs(members: list[SchedulerNode], bodies: dict) -> str | None:
    """Why the fused kernel would leave its work to too few GPU programs, or None."""
    if (outer := nested_reduction(bodies)) is not None:
        return f"the reduction in {outer} would hold another in its loop (one GPU program for all of it)"
    reduces = [name for name, body in bodies.items() if any(u.op is Ops.REDUCE for u in body.toposort)]
    # symbolic sizes at the example's values: an estimate, it changes speed only (Note: symbolic sizes)
    sizes = {n.name: size_hint(n.step.buffer.layout.numel) for n in members}
    few = min((sizes[name] for name in reduces), default=None)
    big = max(sizes, key=lambda name: sizes[name])
    if few is not None and few < STARVED_PROGRAMS and sizes[big] >= STARVED_ELEMENTS and sizes[big] > few:
        return f"{big} ({sizes[big]} elements) would be computed by the {few} GPU program(s) of a reduction"
    return None


def stored_by_every_program(members: list[SchedulerNode]) -> str | None:
    """An input stored in place over fewer elements than the kernel's (an optimizer's 0-d step
    count, fused with the update that reads it): a loop nest stores it once, outside the loops
    (the linearizer hoists it), but every GPU program of the kernel would read it and store it
    again, and a program that reads after another stored sees the new value (Note: inputs written
    in place, lower/mutation.py)."""
    numel = max(size_hint(n.step.buffer.layout.numel) for n in members)
    for n in members:
        if n.step.buffer.kind == "input" and size_hint(n.step.buffer.layout.numel) < numel:
            return f"every GPU program of the kernel would store input {n.name} in place, read by the others"
    return None


def nested_reduction(bodies: dict) -> str | None:
    """The member whose body would reduce over values that themselves reduce, per position of
    the outer reduction's loop (cross-entropy's mean of per-row logsumexps)."""
    return next((name for name, body in bodies.items() if next(reductions_in_reductions(body), None)), None)


def reductions_in_reductions(body: UOp) -> Iterator[UOp]:
    """Each reduction in `body` that runs inside another's loop: it depends on that one's range."""
    for u in body.toposort:
        if u.op is Ops.REDUCE:
            yield from (v for v in u.src[0].toposort if v is not u and v.op is Ops.REDUCE and v.ranges & set(u.src[1:]))


def inner_reduction_per_output(bodies: dict) -> str | None:
    """The member whose reduction would hold another (nested_reduction) that depends on fewer of
    the member's output axes than the member: its loop nest computes that inner reduction again
    for every output element it does not depend on. A one-row matmul (Note: a vector times a
    matrix, passes/vector_matmul.py) fused into the next one's reduction over its outputs
    computed the whole first product once per output of the second: 1024 times over, 70 ms for a
    LLaMA layer's step that takes 1. (Cross-entropy's mean of row logsumexps has no output axes:
    each row's inner reduction runs once.)"""
    for name, body in bodies.items():
        outputs = {u.arg for u in body.toposort if u.op is Ops.AXIS}
        for inner in reductions_in_reductions(body):
            if outputs - {a.arg for a in inner.toposort if a.op is Ops.AXIS}:
                return name
    return None


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
