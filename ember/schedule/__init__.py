"""Stage `schedule`: the lowered graph's steps -> kernels and extern calls, in order, with
the last use of every buffer.

Today every computed buffer is its own kernel (pointwise producers were already inlined
into their consumers during lowering); the fusion scheduler of seed 001 replaces
`group_into_kernels` with dependency analysis and the fusion loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils._pytree import tree_flatten

from ember.ir import BufferRef, ComputedBuffer, ExternCall, LoweredGraph
from ember.uop.ops import Ops


@dataclass
class KernelStep:
    group: list[ComputedBuffer]

    @property
    def writes(self) -> list[str]:
        return [c.name for c in self.group]

    @property
    def reads(self) -> list[str]:
        names = []
        for c in self.group:
            names += [u.arg.name for u in c.body.toposort if u.op is Ops.BUFFER]
        return list(dict.fromkeys(names))


Step = KernelStep | ExternCall


def schedule(graph: LoweredGraph) -> list[Step]:
    return group_into_kernels(graph)


def group_into_kernels(graph: LoweredGraph) -> list[Step]:
    return [KernelStep([s]) if isinstance(s, ComputedBuffer) else s for s in graph.steps]


def reads_of(step: Step) -> list[str]:
    if isinstance(step, KernelStep):
        return step.reads
    refs, _ = tree_flatten((step.args, step.kwargs))
    return list(dict.fromkeys(r.name for r in refs if isinstance(r, BufferRef)))


def writes_of(step: Step) -> list[str]:
    return step.writes if isinstance(step, KernelStep) else [b.name for b in step.outputs]


def last_uses(steps: list[Step], keep: set[str]) -> list[list[str]]:
    """For each step, the buffers whose last reader (or writer) it is, except those in `keep`."""
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in [*reads_of(step), *writes_of(step)]:
            last[name] = i
    freed: list[list[str]] = [[] for _ in steps]
    for name, i in last.items():
        if name not in keep:
            freed[i].append(name)
    return freed
