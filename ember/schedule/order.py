"""The fusion loop's schedule: groups in order, what each stores, and live memory, kept up
to date as groups merge (Note: incremental schedule).

Takes groups in a topological order, the graph's outputs and each buffer's bytes; answers,
for a candidate pair, whether merging it would close a cycle and what peak memory the merged
schedule would reach; applies a merge. `ScheduleWork` counts what that cost.

Note: incremental schedule
    The order is a list of slots. Merging the groups in slots i < j reorders the window
    [i, j] only: groups before i depend on neither, groups after j keep their slots, and the
    merged group is placed in the window by the same rule as the whole order (earliest
    program position first among the ready ones). Live bytes before the window and after it
    do not change: a buffer allocated before i or last used after j keeps those events, and
    one that becomes kernel-local was written and last used inside the window. So the merged
    schedule's peak exceeds the current peak exactly when the window's simulated peak does:
    a check costs the window's length, not the program's. A cycle through a third group
    would be a path from the earlier group to the later one, which only visits groups
    between them: the check walks predecessors inside the window. Each slot keeps its
    simulated peak and the live bytes after its frees, so the window starts from the live
    bytes at its left edge. A merge leaves one slot empty; `compact` drops empty slots.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.schedule.ranges import RangeMax

if TYPE_CHECKING:
    from ember.schedule.fusion import Group
    from ember.schedule.nodes import SchedulerNode


@dataclass
class ScheduleWork:
    """What the scheduler did, in units of work (tests assert these grow linearly with the graph)."""

    candidate_pairs: int = 0  # pairs listed by `candidate_pairs`, over all rounds
    pairs_examined: int = 0  # pairs `why_no_fuse` looked at
    edges_visited: int = 0  # dependency edges followed (orders, cycle checks, node building)
    simulation_steps: int = 0  # groups stepped through by the peak-memory simulation

    def add(self, other: ScheduleWork) -> None:
        for name, value in other.__dict__.items():
            setattr(self, name, getattr(self, name) + value)


@dataclass
class Window:
    """A candidate merge's window of the order: its first and last slot, and its groups
    reordered with the pair replaced by the merged group."""

    first: int
    last: int
    groups: list[Group]


class ScheduleOrder:
    def __init__(self, groups: list[Group], outputs: set[str], nbytes: dict[str, int], work: ScheduleWork):
        self.slots: list[Group | None] = list(groups)
        self.outputs, self.nbytes, self.work = outputs, nbytes, work
        self.slot_of = {g: i for i, g in enumerate(groups)}
        self.group_of: dict[SchedulerNode, Group] = {n: g for g in groups for n in g.nodes}
        self.readers: dict[str, set[Group]] = {}
        for g in groups:
            for b in g.reads:
                self.readers.setdefault(b, set()).add(g)
        self.ancestors = node_ancestors([n for g in groups for n in g.nodes], work)
        self.last_use: dict[str, int] = {}  # slot of the last group reading or storing the buffer
        self.first_store: dict[str, int] = {}  # slot of the first group storing it (allocation)
        self._index_uses(0, len(groups) - 1)
        peaks, after = self._simulate(Window(0, len(groups) - 1, groups), self.stored, entering=0)
        self.peak_at = RangeMax(peaks)  # per slot: live bytes once the slot's outputs exist
        self.live_after = RangeMax(after)  # per slot: live bytes after the slot's frees

    @property
    def peak(self) -> int:
        return max(0, self.peak_at.max(0, len(self.slots) - 1))

    # -- what groups read and store --------------------------------------------------------

    def groups_in(self, first: int, last: int) -> list[Group]:
        return [g for g in self.slots[first : last + 1] if g is not None]

    @property
    def groups(self) -> list[Group]:
        return [g for g in self.slots if g is not None]

    def stored(self, group: Group) -> set[str]:
        """Buffers a group must write to memory: outputs, and what other groups read."""
        if group.is_extern:
            return set(group.writes)
        return {b for b in group.writes if b in self.outputs or self._read_elsewhere(b, group, group)}

    def _read_elsewhere(self, buffer: str, *members: Group) -> bool:
        return any(r not in members for r in self.readers.get(buffer, ()))

    def predecessors(self, group: Group) -> set[Group]:
        preds = set()
        for n in group.nodes:
            self.work.edges_visited += len(n.depends_on)
            preds.update(self.group_of[d] for d in n.depends_on)
        preds.discard(group)
        return preds

    # -- a candidate merge -----------------------------------------------------------------

    def cycle_through(self, a: Group, b: Group) -> Group | None:
        """A group on a path from one of `a`, `b` to the other (see the Note), or None."""
        (first, early), (_, late) = sorted([(self.slot_of[a], a), (self.slot_of[b], b)], key=lambda p: p[0])
        if (through := self._node_path(early, late)) is not None:
            return through
        stack = [p for p in self.predecessors(late) if p is not early and self.slot_of[p] > first]
        seen = set(stack)
        while stack:  # a path through groups made of several nodes (no single nodes' path)
            group = stack.pop()
            for p in self.predecessors(group):
                if p is early:
                    return group
                if p not in seen and self.slot_of[p] > first:
                    seen.add(p)
                    stack.append(p)
        return None

    def node_path_between(self, a: Group, b: Group) -> Group | None:
        """A group on a path of nodes outside both from one of `a`, `b` to the other, or None
        (a few bit tests per dependency of the later one: candidate pairs filter on it)."""
        (_, early), (_, late) = sorted([(self.slot_of[a], a), (self.slot_of[b], b)], key=lambda p: p[0])
        return self._node_path(early, late)

    def _node_path(self, early: Group, late: Group) -> Group | None:
        """The group of a node outside both on a path of nodes from `early` to `late` (merging
        groups only adds paths, so the merged pair would be on a cycle), found with the
        nodes' ancestor sets in a few bit tests per predecessor of `late`."""
        pair = early.node_mask | late.node_mask
        for n in late.nodes:
            self.work.edges_visited += len(n.depends_on)
            for d in n.depends_on:
                if not pair >> d.position & 1 and self.ancestors[d] & early.node_mask:
                    return self.group_of[d]
        return None

    def plan(self, a: Group, b: Group, merged: Group) -> Plan:
        """Where the merged group goes (no cycle): into the earlier group's slot when the later
        group depends on nothing in between (the common case, priced from a few lifetimes),
        else the window reordered."""
        (first, early), (last, late) = sorted([(self.slot_of[a], a), (self.slot_of[b], b)], key=lambda p: p[0])
        stored = self._stored_after(a, b, merged)
        if all(self.slot_of[p] < first for p in self.predecessors(late) if p is not early):
            return Plan(first, last, merged, stored, lifetimes=self._moved_lifetimes(early, late, stored(merged)))
        inside = [merged if g is a or g is b else g for g in self.groups_in(first, last)]
        inside = list(dict.fromkeys(inside))
        owner = {g: g for g in inside} | {a: merged, b: merged}
        preds = {g: {owner[p] for p in self._predecessors_via(g, a, b, merged) if p in owner} for g in inside}
        return Plan(first, last, merged, stored, window=Window(first, last, topological_order(inside, preds)))

    def _predecessors_via(self, group: Group, a: Group, b: Group, merged: Group) -> set[Group]:
        if group is not merged:
            return self.predecessors(group)
        return (self.predecessors(a) | self.predecessors(b)) - {a, b}

    def _stored_after(self, a: Group, b: Group, merged: Group) -> Callable[[Group], set[str]]:
        def stored(group: Group) -> set[str]:
            if group is not merged:
                return self.stored(group)
            return {w for w in group.writes if w in self.outputs or self._read_elsewhere(w, a, b)}

        return stored

    def peak_after(self, plan: Plan) -> int:
        """The merged schedule's peak live bytes where it differs from the current one (the
        rest is unchanged: the merge raises the peak exactly when this exceeds `peak`)."""
        if plan.window is not None:
            peaks, _ = self._simulate(plan.window, plan.stored, self._entering(plan.first))
            return max(peaks, default=0)
        return self._peak_with(plan.first, plan.last - 1, plan.lifetimes)

    def _entering(self, first: int) -> int:
        return self.live_after.get(first - 1) if first > 0 else 0

    def _peak_with(self, first: int, last: int, lifetimes: list[Lifetime]) -> int:
        """max over slots first..last of the peak once `lifetimes` changed (piecewise: one
        range maximum per stretch between two ends of a changed lifetime)."""
        cuts = sorted({first, last + 1} | {c for t in lifetimes for c in t.cuts() if first < c <= last})
        best = 0
        for low, high in zip(cuts, cuts[1:]):
            self.work.simulation_steps += 1
            delta = sum(t.delta_at(low) for t in lifetimes)
            best = max(best, self.peak_at.max(low, high - 1) + delta)
        return best

    def _moved_lifetimes(self, early: Group, late: Group, merged_stores: set[str]) -> list[Lifetime]:
        """Buffers whose lifetime changes when `late` moves up into `early`'s slot: its outputs
        are allocated there, outputs of `early` only `late` read are never allocated, and a
        buffer `late` used last is freed at its last other use."""
        first, last = self.slot_of[early], self.slot_of[late]
        end = len(self.slots) - 1
        changes = []
        for x in early.writes | late.writes | late.reads:
            self.work.simulation_steps += 1
            old = self._lifetime(x, end)
            if x in early.writes or x in late.writes:
                if x not in merged_stores:
                    new = None
                elif old is not None and old[0] == last:
                    new = (first, old[1])
                else:
                    new = old
            else:
                new = old
            if new is not None and x not in self.outputs and self.last_use.get(x) == last:
                new = (new[0], self._last_other_use(x, early, late, first))
            if new != old:
                changes.append(Lifetime(self.nbytes.get(x, 0), old, new, x))
        return changes

    def _lifetime(self, x: str, end: int) -> tuple[int, int] | None:
        if x not in self.first_store:
            return None
        return (self.first_store[x], end if x in self.outputs else self.last_use[x])

    def _last_other_use(self, x: str, early: Group, late: Group, first: int) -> int:
        uses = [self.slot_of[g] for g in self.readers.get(x, ()) if g is not late and g is not early]
        self.work.edges_visited += len(uses)
        return max([first, self.first_store[x], *uses])

    def _simulate(self, window: Window, stored_of, entering: int) -> tuple[list[int], list[int]]:
        """Per group of the window: live bytes once its outputs exist, and after its frees."""
        live = entering
        stores = [stored_of(g) for g in window.groups]
        last_here = {}  # buffers whose last use is in the window: where, in the new order
        for k, (g, stored) in enumerate(zip(window.groups, stores)):
            for x in (*g.reads, *stored):
                if self.last_use.get(x, -1) <= window.last and x not in self.outputs:
                    last_here[x] = k
        frees: dict[int, list[str]] = {}
        for x, k in last_here.items():
            frees.setdefault(k, []).append(x)
        allocated: set[str] = set()
        peaks, after = [], []
        for k, stored in enumerate(stores):
            self.work.simulation_steps += 1
            for x in stored:
                if x not in allocated and self.first_store.get(x, window.first) >= window.first:
                    allocated.add(x)
                    live += self.nbytes.get(x, 0)
            peaks.append(live)
            for x in frees.get(k, ()):
                if x in allocated or self.first_store.get(x, window.first) < window.first:
                    live -= self.nbytes.get(x, 0)
            after.append(live)
        return peaks, after

    # -- applying a merge ------------------------------------------------------------------

    def merge(self, a: Group, b: Group, plan: Plan) -> None:
        merged = plan.merged
        for group in (a, b):
            for x in group.reads:
                self.readers[x].discard(group)
                self.readers[x].add(merged)
            del self.slot_of[group]
        for n in merged.nodes:
            self.group_of[n] = merged
        if plan.window is None:
            self._merge_moved_up(plan)
        else:
            self._merge_window(a, b, plan.window)

    def _merge_moved_up(self, plan: Plan) -> None:
        self.slots[plan.first], self.slots[plan.last] = plan.merged, None
        self.slot_of[plan.merged] = plan.first
        for t in plan.lifetimes:
            t.apply(self.peak_at, self.live_after)
        for x, t in plan.lifetime_of.items():
            if t.new is None:
                self.first_store.pop(x, None)
            else:
                self.first_store[x] = t.new[0]
                if x not in self.outputs:
                    self.last_use[x] = t.new[1]
        for x in plan.merged.reads | plan.merged.writes:  # uses at the late slot move up
            if self.last_use.get(x) == plan.last:
                self.last_use[x] = plan.first
        left = self.live_after.get(plan.last - 1)
        self.peak_at.set(plan.last, left)
        self.live_after.set(plan.last, left)

    def _merge_window(self, a: Group, b: Group, window: Window) -> None:
        for x in a.writes | b.writes:  # stored again below if still read elsewhere
            if window.first <= self.first_store.get(x, -1) <= window.last:
                del self.first_store[x]
        slots = window.groups + [None] * (window.last - window.first + 1 - len(window.groups))
        self.slots[window.first : window.last + 1] = slots
        for k, g in enumerate(window.groups):
            self.slot_of[g] = window.first + k
        self._index_uses(window.first, window.last)
        placed = Window(window.first, window.first + len(window.groups) - 1, window.groups)
        peaks, after = self._simulate(placed, self.stored, self._entering(window.first))
        for k in range(window.last - window.first + 1):
            left = after[-1]
            self.peak_at.set(window.first + k, peaks[k] if k < len(peaks) else left)
            self.live_after.set(window.first + k, after[k] if k < len(after) else left)

    def _index_uses(self, first: int, last: int) -> None:
        """Last uses and first stores of the buffers used in slots first..last, where they
        fall in those slots (a use after `last`, or a store before `first`, stays)."""
        last_slot: dict[str, int] = {}
        first_slot: dict[str, int] = {}
        for slot in range(first, last + 1):
            group = self.slots[slot]
            if group is None:
                continue
            stored = self.stored(group)
            for x in (*group.reads, *stored):
                last_slot[x] = slot
            for x in stored:
                first_slot.setdefault(x, slot)
        for x, slot in last_slot.items():
            if self.last_use.get(x, -1) <= last:
                self.last_use[x] = slot
        for x, slot in first_slot.items():
            if self.first_store.get(x, first) >= first:
                self.first_store[x] = slot

    def compact(self) -> None:
        """Drop the empty slots, renumbering everything kept by slot."""
        keep = [i for i, g in enumerate(self.slots) if g is not None]
        if len(keep) == len(self.slots):
            return
        renumber = {old: new for new, old in enumerate(keep)}
        self.slots = [self.slots[i] for i in keep]
        self.peak_at = RangeMax([self.peak_at.get(i) for i in keep])
        self.live_after = RangeMax([self.live_after.get(i) for i in keep])
        self.slot_of = {g: i for i, g in enumerate(self.slots)}  # type: ignore[misc]
        self.last_use = {x: renumber[s] for x, s in self.last_use.items()}
        self.first_store = {x: renumber[s] for x, s in self.first_store.items()}


@dataclass
class Lifetime:
    """A buffer's change of lifetime: the slots from its allocation to its last use, before
    and after a merge (None: never allocated); it counts in `peak_at` over those slots and in
    `live_after` over all of them but the last."""

    nbytes: int
    old: tuple[int, int] | None
    new: tuple[int, int] | None
    buffer: str = ""

    def cuts(self) -> list[int]:
        return [c for span in (self.old, self.new) if span for c in (span[0], span[1] + 1)]

    def delta_at(self, slot: int) -> int:
        inside = [span is not None and span[0] <= slot <= span[1] for span in (self.old, self.new)]
        return self.nbytes * (inside[1] - inside[0])

    def apply(self, peak_at: RangeMax, live_after: RangeMax) -> None:
        for span, sign in ((self.old, -1), (self.new, 1)):
            if span is not None:
                peak_at.add(span[0], span[1], sign * self.nbytes)
                live_after.add(span[0], span[1] - 1, sign * self.nbytes)


@dataclass
class Plan:
    """A merge that passed the cycle check: the earlier and later group's slots, the merged
    group, what each group of the merged schedule stores, and either the lifetimes that change
    (the later group moves up) or the reordered window."""

    first: int
    last: int
    merged: Group
    stored: Callable[[Group], set[str]]
    lifetimes: list[Lifetime] = field(default_factory=list)
    window: Window | None = None

    @property
    def lifetime_of(self) -> dict[str, Lifetime]:
        return {t.buffer: t for t in self.lifetimes}


def node_ancestors(nodes: list[SchedulerNode], work: ScheduleWork) -> dict[SchedulerNode, int]:
    """Each node's ancestors as a bit set over program positions (nodes in a topological order)."""
    ancestors: dict[SchedulerNode, int] = {}
    for n in nodes:
        mask = 0
        for d in n.depends_on:
            mask |= ancestors[d] | 1 << d.position
        work.edges_visited += len(n.depends_on)
        ancestors[n] = mask
    return ancestors


def topological_order(groups: Iterable[Group], preds: dict[Group, set[Group]]) -> list[Group]:
    """Groups in dependency order, earliest program position first among the ready ones
    (`preds`: each group's predecessors among `groups`)."""
    waiting = {g: len(p) for g, p in preds.items()}
    successors: dict[Group, list[Group]] = {g: [] for g in preds}
    for g, ps in preds.items():
        for p in ps:
            successors[p].append(g)
    ready = [(g.position, id(g), g) for g in groups if waiting[g] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, g = heapq.heappop(ready)
        order.append(g)
        for s in successors[g]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (s.position, id(s), s))
    if len(order) != len(preds):
        raise RuntimeError("schedule: dependency cycle between groups")
    return order
