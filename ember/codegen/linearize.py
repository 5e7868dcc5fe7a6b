"""Stage `codegen`, step 3: order a kernel's UOps into a flat program with explicit loops.

Note: scopes and loop nests
    Every UOp varies with a set of ranges (`UOp.ranges`); it is placed in the innermost
    loop it needs and no deeper, so loop-invariant work is hoisted for free. A set of
    ranges maps to one canonical loop stack: loop ranges by axis up to the deepest one
    used, then, inside a reduction, the stack its accumulator lives in plus that
    reduction's ranges. Stacks of a value's sources are prefixes of its own stack, so
    emitting sources first and then the value only opens loops. When a later value needs
    a loop closed (a reduction result read outside its loop), values defined inside it
    die; if they are needed again they are recomputed in the new loop, which is correct
    by construction and rare.

Note: reductions before the loops that read them
    A column reduction's lane accumulators are declared outside the kernel's innermost loop and
    read inside it (Note: lane accumulators, codegen/lanes.py); a scalar reduction in the same
    kernel (`(a * n).sum((0, 1)) + b.sum((0, 1))`, n broadcast along the lanes: a layer norm
    weight's gradient summed over two layers that share it) is declared inside that loop. Were
    the loop opened for the scalar one first, the lane reduction would have to close it, and the
    scalar result, declared and updated in it, could not be recomputed. Preferring the
    shallowest scope runs every reduction declared outside a loop before the loop opens.

Note: a loop opens when what it reads from outside is done
    A value inside a loop may read one computed outside it: `x.sum(-1).argmax()` is an argmin
    over rows of `row_sum == max(row_sums)`, the max a reduction declared outside the row loop.
    Were the row loop opened first (its row sum is as shallow as the max's own loop), the max's
    loop could only run by closing it, and the row sum, an accumulator already updated, could not
    be recomputed. So a loop counts as premature while a value read inside it from outside is
    not emitted yet, and the scheduler opens premature loops last.
"""

from __future__ import annotations

from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, UOp


def linearize(sink: UOp) -> list[UOp]:
    return _Linearizer(sink).run()


STATEFUL = frozenset({Ops.DEFINE_ACC, Ops.ACC_UPDATE, Ops.STORE})


def _trivial(u: UOp) -> bool:
    """Values the renderer writes inline, never as statements."""
    return u.op in (Ops.CONST, Ops.BUFFER, Ops.RANGE, Ops.BLOCK_SIZE, Ops.DEFINE_VAR)


class _Linearizer:
    """A list scheduler: of the UOps whose sources are done, it takes one that needs no loop
    closed (the shallowest such), else the one that closes the fewest loops."""

    def __init__(self, sink: UOp):
        self.sink = sink
        self.order = [u for u in sink.toposort if not _trivial(u) and u is not sink]
        self.loops = sorted((u for u in sink.toposort if u.op is Ops.RANGE and not u.arg.reduce),
                            key=lambda r: r.arg.nesting)  # fmt: skip
        self.reduce_parent: dict[UOp, tuple[UOp, list[UOp]]] = {}  # reduce range -> (DEFINE_ACC, group)
        for u in self.order:
            if u.op is Ops.ACC_UPDATE:
                group = sorted(u.src[2:], key=lambda r: r.arg.nesting)
                for r in group:
                    self.reduce_parent[r] = (u.src[0], group)
        self.stacks = {u: self.canonical(u) for u in self.order}
        self.position = {u: i for i, u in enumerate(self.order)}
        self.program: list[UOp] = []
        self.stack: list[UOp] = []
        self.blocks: list[set[UOp]] = [set()]  # values defined at each depth
        self.live: set[UOp] = set()
        self.updated: set[UOp] = set()  # accumulators whose ACC_UPDATE was emitted
        self.waiting_outside = self.reads_from_outside()  # Note: a loop opens when what it reads ...

    def reads_from_outside(self) -> dict[UOp, set[UOp]]:
        """Per loop, the values read inside it that are placed outside it (not emitted yet)."""
        outside: dict[UOp, set[UOp]] = {}
        for u in self.order:
            for s in u.src:
                if _trivial(s):
                    continue
                inner = set(self.stacks[s])
                for r in self.stacks[u]:
                    if r not in inner:
                        outside.setdefault(r, set()).add(s)
        return outside

    def canonical(self, u: UOp) -> list[UOp]:
        """The loop stack `u` is placed in (Note: scopes and loop nests)."""
        scope = u.ranges
        reduce_ranges = [r for r in scope if r.arg.reduce]
        if reduce_ranges:
            # nested reductions: the innermost one is the one whose accumulator is deepest
            innermost = max(reduce_ranges, key=lambda r: len(self.canonical(self.reduce_parent[r][0])))
            acc, group = self.reduce_parent[innermost]
            deepest = max(r.arg.nesting for r in reduce_ranges if r in group)
            return self.canonical(acc) + [r for r in group if r.arg.nesting <= deepest]
        if not scope:
            return []
        deepest = max(r.arg.nesting for r in scope)
        return [r for r in self.loops if r.arg.nesting <= deepest]

    def run(self) -> list[UOp]:
        waiting = {u: sum(1 for s in set(u.src) if not _trivial(s)) for u in self.order}
        users: dict[UOp, list[UOp]] = {}
        for u in self.order:
            for s in set(u.src):
                users.setdefault(s, []).append(u)
        ready = [u for u in self.order if waiting[u] == 0]
        while ready:
            u = min(ready, key=lambda c: self.preference(c, self.position[c]))
            ready.remove(u)
            self.emit(u)
            for user in users.get(u, []):
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready.append(user)
        self.move_to([])
        return remove_dead_code(self.program)

    def preference(self, u: UOp, position: int) -> tuple[bool, int, int, int, int]:
        """No premature loop opened (Note: a loop opens when what it reads from outside is done),
        then fewest loops closed, then the shallowest scope (loop ranges around it, reduce loops
        not counted), then the fewest loops, then program order. Scope before loops: a reduction
        declared outside a loop runs before the loop opens (Note: reductions before the loops
        that read them)."""
        target = self.stacks[u]
        common = self.common_prefix(target)
        closes = len(self.stack) - common
        premature = any(self.waiting_outside.get(r) for r in target[common:])
        scope = sum(1 for r in target if not r.arg.reduce)
        return (premature, closes, scope, len(target), position)

    def common_prefix(self, target: list[UOp]) -> int:
        keep = 0
        while keep < min(len(self.stack), len(target)) and self.stack[keep] is target[keep]:
            keep += 1
        return keep

    def emit(self, u: UOp) -> None:
        """Place `u` in its loop stack; sources that died with a closed loop are recomputed,
        shallowest first: placing one may close a loop, killing deeper values, which are
        then recomputed too (all these stacks are prefixes of u's, so deeper ones only open loops)."""
        while dead := self.dead_sources(u):
            self.place(min(dead, key=lambda s: (len(self.stacks[s]), self.position[s])))
        self.place(u)

    def dead_sources(self, u: UOp) -> set[UOp]:
        """The values `u` needs (directly or through others) that are not live now. An
        accumulator declared in a loop that had to close before its first update is declared
        again; any other stateful op is never emitted twice."""
        dead: set[UOp] = set()
        todo = [u]
        while todo:
            for s in todo.pop().src:
                if _trivial(s) or s in self.live or s in dead or s.op is Ops.ACC_UPDATE:  # an update is done
                    continue
                if s.op in STATEFUL and not (s.op is Ops.DEFINE_ACC and s not in self.updated):
                    raise RuntimeError(f"linearize: {s.op.name} would be emitted twice")
                dead.add(s)
                todo.append(s)
        return dead

    def place(self, u: UOp) -> None:
        self.move_to(self.stacks[u])
        self.program.append(u)
        for waiting in self.waiting_outside.values():
            waiting.discard(u)
        if u.op is Ops.ACC_UPDATE:
            self.updated.add(u.src[0])
        self.live.add(u)
        self.blocks[-1].add(u)

    def move_to(self, target: list[UOp]) -> None:
        keep = self.common_prefix(target)
        while len(self.stack) > keep:
            closed = self.stack.pop()
            self.live -= self.blocks.pop()
            self.program.append(UOp(Ops.ENDRANGE, dtypes.void, (closed,)))
        for r in target[keep:]:
            self.program.append(r)
            self.stack.append(r)
            self.blocks.append(set())


def remove_dead_code(program: list[UOp]) -> list[UOp]:
    """Drop values computed early and never used (their users got a recomputed copy after a
    loop closed; an accumulator declared before its loop had to close), then empty loops."""
    needed: set[UOp] = set()
    kept: list[UOp] = []
    for u in reversed(program):
        if u.op in (Ops.ACC_UPDATE, Ops.STORE, Ops.RANGE, Ops.ENDRANGE) or u in needed:
            needed.discard(u)
            needed.update(u.src)
            kept.append(u)
    kept.reverse()
    result: list[UOp] = []
    for u in kept:
        if u.op is Ops.ENDRANGE and result and result[-1] is u.src[0]:
            result.pop()  # an empty loop
        else:
            result.append(u)
    return result
