"""Horizontal fusion (after vertical fusion, fusion.py): independent small elementwise kernels
launched as one.

Takes the fused groups in their order (fusion.py `FusionState`) and gives them in units: a unit
of one group is a kernel (or extern) as before; a unit of several is one *horizontal* kernel whose
parts run side by side in one launch (codegen: renderer/cpp_horizontal.py, one OpenMP region;
renderer/triton_horizontal.py, program ids split into a range per part). Every refusal of an
eligible kernel is a `WhyNoFuse`, as vertical fusion's are.

Note: horizontal fusion
    An optimizer step lowers to one elementwise update per parameter (lower/foreach.py), which
    vertical fusion makes one kernel per parameter: a GPT-2's AdamW step is a launch per tensor,
    each a few thousand elements, so the launches (a Triton launch, an OpenMP fork and join)
    cost more than the work. Kernels that
      - are elementwise (no reduction or scan: a part is one loop nest over its own elements),
      - have static sizes, some work, and fewer than HORIZONTAL_MAX_ELEMENTS iterations,
      - and are independent: none reads (directly or through kernels between them) what another
        writes, nor writes what another reads (the scheduler's dependencies, WeakDeps of
        mutations included, say both)
    are gathered into units, greedily in schedule order. A unit runs where its first member ran
    (its *anchor* slot): a kernel joins only when every group it depends on runs before the
    anchor, so moving it up keeps the order valid and no member can reach another. Moving a
    kernel up allocates its outputs earlier; one that allocates (stores a buffer that is not an
    input written in place) joins only a unit right before it (nothing left between them), so
    horizontal fusion moves no allocation past other work. An optimizer's updates store only into
    their inputs and move freely. A unit holds at most HORIZONTAL_MAX_PARTS parts and
    HORIZONTAL_MAX_ARGUMENTS distinct buffers (a GPU kernel's parameters are bounded, and each
    part is one more branch to compile); at most MAX_OPEN_UNITS units take members at a time.

    The size rule: a kernel of HORIZONTAL_MAX_ELEMENTS (1M) iterations or more moves at least
    8 MB (two float32 streams), several microseconds of an H100's bandwidth and a millisecond of
    a CPU core's, against a launch of a few microseconds: launched alone it loses nothing, and
    grouping it would only stretch the unit's slowest program.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.schedule.fusion import FusionState, Group, WhyNoFuse
from ember.uop.ops import Ops

HORIZONTAL_MAX_ELEMENTS = 1 << 20
HORIZONTAL_MAX_PARTS = 32
HORIZONTAL_MAX_ARGUMENTS = 256
MAX_OPEN_UNITS = 4


@dataclass
class Unit:
    """Groups that become one launch, anchored at the slot of the first."""

    anchor: int
    groups: list[Group]
    buffers: set[str] = field(default_factory=set)  # every buffer the parts read or store


@dataclass
class HorizontalPlan:
    units: list[list[Group]]  # in schedule order; a list of one group is an ordinary kernel or extern
    refusals: list[WhyNoFuse]

    @property
    def horizontal(self) -> list[list[Group]]:
        return [u for u in self.units if len(u) > 1]


def group_horizontally(state: FusionState) -> HorizontalPlan:
    """The groups of `state` in units (see the Note)."""
    groups = state.groups
    anchor: dict[Group, int] = {g: i for i, g in enumerate(groups)}
    units: list[Unit | None] = [None] * len(groups)
    moved: set[int] = set()  # slots whose group moved into an earlier unit
    open_units: list[Unit] = []
    refusals: list[WhyNoFuse] = []
    last_kept = -1  # the last slot before the current one that still runs something
    for i, g in enumerate(groups):
        if (buffers := part_buffers(state, g)) is not None:
            unit = _join(state, g, i, buffers, anchor, open_units, last_kept, refusals)
            if unit is not None:
                unit.groups.append(g)
                unit.buffers |= buffers
                anchor[g] = unit.anchor
                moved.add(i)
                open_units = [u for u in open_units if len(u.groups) < HORIZONTAL_MAX_PARTS]
                continue
            units[i] = Unit(i, [g], set(buffers))
            open_units = (open_units + [units[i]])[-MAX_OPEN_UNITS:]  # type: ignore[list-item]
        last_kept = i
    ordered = [units[i].groups if units[i] is not None else [g]  # type: ignore[union-attr]
               for i, g in enumerate(groups) if i not in moved]  # fmt: skip
    return HorizontalPlan(ordered, refusals)


def _join(state: FusionState, g: Group, slot: int, buffers: set[str], anchor: dict[Group, int],
          open_units: list[Unit], last_kept: int, refusals: list[WhyNoFuse]) -> Unit | None:  # fmt: skip
    """The open unit `g` can join, oldest first, or None; each refusal recorded."""
    predecessors = state.order.predecessors(g)
    for unit in open_units:
        reason = why_not_join(state, g, slot, buffers, unit, predecessors, anchor, last_kept)
        if reason is None:
            return unit
        refusals.append(WhyNoFuse(tuple(n for m in unit.groups for n in m.names), tuple(g.names),
                                  f"horizontal: {reason}"))  # fmt: skip
    return None


def why_not_join(state: FusionState, g: Group, slot: int, buffers: set[str], unit: Unit, predecessors: set[Group],
                 anchor: dict[Group, int], last_kept: int) -> str | None:  # fmt: skip
    """Why `g` (at `slot`) cannot run as a part of `unit`, or None."""
    if (after := [p for p in predecessors if anchor[p] >= unit.anchor]) != []:
        through = min(after, key=lambda p: p.position)
        return f"{'+'.join(g.names)} depends on {'+'.join(through.names)}, which runs after the unit's first kernel"
    if len(unit.buffers | buffers) > HORIZONTAL_MAX_ARGUMENTS:
        return f"the kernel would take more than {HORIZONTAL_MAX_ARGUMENTS} buffers"
    if last_kept != unit.anchor and allocates(state, g):
        return f"{'+'.join(g.names)} allocates its output: it would move past other work"
    return None


def part_buffers(state: FusionState, g: Group) -> set[str] | None:
    """The buffers `g` reads and stores when it may be a part of a horizontal kernel, else None:
    an elementwise kernel of static sizes with 1 to HORIZONTAL_MAX_ELEMENTS - 1 iterations."""
    if g.is_extern or g.runs_alone:
        return None
    sizes = [c.buffer.layout.numel for c in g.computed]
    if not all(type(s) is int for s in sizes) or not 0 < max(sizes) < HORIZONTAL_MAX_ELEMENTS:
        return None
    if any(u.op in (Ops.REDUCE, Ops.SCAN, Ops.DEFINE_VAR) for c in g.computed for u in c.body.toposort):
        return None  # (a size variable: a symbolic stride, Note: symbolic sizes)
    return set(g.reads) | state.stored(g)


def allocates(state: FusionState, g: Group) -> bool:
    """Whether `g` stores a buffer the wrapper allocates (anything but an input written in place)."""
    stored = state.stored(g)
    return any(c.name in stored and c.buffer.kind != "input" for c in g.computed)
