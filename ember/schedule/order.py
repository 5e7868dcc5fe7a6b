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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
        self.peak_at: list[int] = [0] * len(groups)  # live bytes once the slot's outputs exist
        self.live_after: list[int] = [0] * len(groups)  # live bytes after the slot's frees
        self.last_use: dict[str, int] = {}  # slot of the last group reading or storing the buffer
        self.first_store: dict[str, int] = {}  # slot of the first group storing it (allocation)
        self._index_uses(0, len(groups) - 1)
        self._record(0, self.groups_in(0, len(groups) - 1))
        self.peak = max(self.peak_at, default=0)

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
        (first, early), (last, late) = sorted([(self.slot_of[a], a), (self.slot_of[b], b)], key=lambda p: p[0])
        stack = [p for p in self.predecessors(late) if p is not early and self.slot_of[p] > first]
        seen = set(stack)
        while stack:
            group = stack.pop()
            for p in self.predecessors(group):
                if p is early:
                    return group
                if p not in seen and self.slot_of[p] > first:
                    seen.add(p)
                    stack.append(p)
        return None

    def window(self, a: Group, b: Group, merged: Group) -> Window:
        """The window between `a` and `b` reordered with `merged` in their place (no cycle)."""
        first, last = sorted((self.slot_of[a], self.slot_of[b]))
        inside = [merged if g is a or g is b else g for g in self.groups_in(first, last)]
        inside = list(dict.fromkeys(inside))
        owner = {g: g for g in inside} | {a: merged, b: merged}
        preds = {g: {owner[p] for p in self._predecessors_via(g, a, b, merged) if p in owner} for g in inside}
        return Window(first, last, topological_order(inside, preds))

    def _predecessors_via(self, group: Group, a: Group, b: Group, merged: Group) -> set[Group]:
        if group is not merged:
            return self.predecessors(group)
        return (self.predecessors(a) | self.predecessors(b)) - {a, b}

    def window_peak(self, window: Window, a: Group, b: Group, merged: Group) -> int:
        """The merged schedule's live bytes at its highest point inside the window."""

        def stored(group: Group) -> set[str]:
            if group is not merged:
                return self.stored(group)
            return {w for w in group.writes if w in self.outputs or self._read_elsewhere(w, a, b)}

        peaks, _ = self._simulate(window, stored)
        return max(peaks, default=0)

    def _simulate(self, window: Window, stored_of) -> tuple[list[int], list[int]]:
        """Per group of the window: live bytes once its outputs exist, and after its frees."""
        live = self.live_after[window.first - 1] if window.first > 0 else 0
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

    def merge(self, a: Group, b: Group, merged: Group, window: Window) -> None:
        for x in a.writes | b.writes:  # stored again below if still read elsewhere
            if window.first <= self.first_store.get(x, -1) <= window.last:
                del self.first_store[x]
        for group in (a, b):
            for x in group.reads:
                self.readers[x].discard(group)
                self.readers[x].add(merged)
            del self.slot_of[group]
        for n in merged.nodes:
            self.group_of[n] = merged
        slots = window.groups + [None] * (window.last - window.first + 1 - len(window.groups))
        self.slots[window.first : window.last + 1] = slots
        for k, g in enumerate(window.groups):
            self.slot_of[g] = window.first + k
        self._index_uses(window.first, window.last)
        self._record(window.first, window.groups)
        hole = window.first + len(window.groups)
        self.peak_at[hole : window.last + 1] = [self.live_after[hole - 1]] * (window.last + 1 - hole)
        self.live_after[hole : window.last + 1] = [self.live_after[hole - 1]] * (window.last + 1 - hole)
        self.peak = max(self.peak_at)  # one pass in C per merge

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

    def _record(self, first: int, groups: list[Group]) -> None:
        window = Window(first, first + len(groups) - 1, groups)
        peaks, after = self._simulate(window, self.stored)
        self.peak_at[first : first + len(groups)] = peaks
        self.live_after[first : first + len(groups)] = after

    def compact(self) -> None:
        """Drop the empty slots, renumbering everything kept by slot."""
        keep = [i for i, g in enumerate(self.slots) if g is not None]
        renumber = {old: new for new, old in enumerate(keep)}
        self.slots = [self.slots[i] for i in keep]
        self.peak_at = [self.peak_at[i] for i in keep]
        self.live_after = [self.live_after[i] for i in keep]
        self.slot_of = {g: i for i, g in enumerate(self.slots)}  # type: ignore[misc]
        self.last_use = {x: renumber[s] for x, s in self.last_use.items()}
        self.first_store = {x: renumber[s] for x, s in self.first_store.items()}


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
