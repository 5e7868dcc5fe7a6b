"""Stage `codegen` (block backends), the last step: a kernel AST after `phases.block_rewrite` and its
block plan (codegen/blocks.py) -> the block UOps of one variant, which the linearizer orders and
renderer/triton.py spells.

Note: block lowering
    A block backend computes on blocks of positions, not in scalar loops. `lower_blocks` makes
    that explicit in UOps, so the shared linearizer places every value (its loops are then the
    backend's loops) and hash-consing shares what text CSE used to (Note: blocks for a kernel
    AST, codegen/blocks.py, says which loops go where):
    - The loops on the x axis become one x index, PROGRAM_ID * BLOCK_SIZE(X) + ARANGE(X), with
      its mask (x < xnumel); each x loop is its decomposition ((x // stride) % size).
    - A blocked REDUCE walks its own elements, flattened, on the r axis (a *phase*). Persistent:
      the phase's position is ARANGE(R) itself, shared by every phase (so identical loads of two
      phases are one UOp), and the REDUCE is a BLOCK_REDUCE of its value where the lanes are
      active, else the combine's identity. Looped: the position is a RANGE over RBLOCK chunks
      (`RangeArg.block` R) plus ARANGE(R), and the REDUCE is an [XBLOCK, RBLOCK] accumulator
      (AccBlock.TILE) updated in that loop and folded by a BLOCK_REDUCE after it.
    - Note: independent reductions share a looped phase. Blocked REDUCEs over as many elements,
      in one enclosing phase, none reading another (layer norm's backward: the sums of dy and of
      dy * xhat over one row; a column sum next to a weighted one), walk one loop: each keeps
      its accumulator, and loads of the same element in them are one UOp, so the looped variant
      reads each input once, as the persistent one does.
    - A sequential REDUCE (Note: nested reductions, codegen/blocks.py) is a RANGE over its
      elements, one at a time, with an [XBLOCK, 1] accumulator (AccBlock.ROWS); a chunked one
      walks XBLOCK of them at a time on the x lanes (a RANGE stepping by XBLOCK plus ARANGE(X),
      masked by its own bound) and folds the x axis at the end.
    - Stores that vary with loops besides the x ones are one more phase (softmax's normalizing
      pass): the same position as the persistent phases, or a loop over chunks of its own.
    - A SCAN (Note: scans on blocks, renderer/triton_scan.py) is a BLOCK_SCAN of its masked value;
      looped, its accumulator is a carry (AccBlock.CARRY): each chunk's scan combined with the
      carry of the chunks before, which becomes the combined chunk's last position. A float sum's
      carry starts at -0.0, the one identity that leaves every value (-0.0 too) unchanged.
    - LOAD, STORE and CHECK take the mask of their active lanes as a last source: the x mask and
      the mask of each phase their position varies with (a load), or of the lanes they run on (a
      store, a failed CHECK's report).
    - Philox words come from one PHILOX4 per counter (WORD picks one): tl.randint4x gives four.
    Nothing here is backend text: the renderer spells each op on its own.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from ember.codegen.blocks import BlockPlan, elements
from ember.codegen.online_softmax import (
    ExpSum,
    exp_sum_of_max,
    lane_sum_dtype,
    lane_total,
    online_update,
    row_total,
    summed_as,
)
from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import (
    AccArg,
    AccBlock,
    AccUpdate,
    BlockArg,
    BlockAxis,
    BlockReduceArg,
    Ops,
    RangeArg,
    RangeKind,
    UOp,
    normalize_const,
    reduce_identity,
)


@dataclass(frozen=True, eq=False)
class Phase:
    """One walk over `ranges`' elements, flattened (Note: block lowering)."""

    ranges: tuple[UOp, ...]
    position: UOp  # the flattened position: a block, or a sequential loop's RANGE
    mask: UOp | None  # the positions in bounds (None: a sequential loop, always in bounds)
    parent: Phase | None  # the sequential phase it runs inside
    loop: UOp | None = None  # the RANGE it walks (None: a persistent phase, in no loop)
    chunked: bool = False  # a sequential phase walking XBLOCK elements at a time on the x lanes
    sequential: bool = False

    def chain(self) -> Iterator[Phase]:
        """This phase and those it runs inside, innermost first."""
        phase: Phase | None = self
        while phase is not None:
            yield phase
            phase = phase.parent

    @property
    def depth(self) -> int:
        return sum(1 for _ in self.chain())


@dataclass(frozen=True)
class OnlineMax:
    """A looped maximum's lanes, as an exp sum shifted by it reads them (Note: a row's exponential
    sum in one pass, codegen/online_softmax.py)."""

    prior: UOp  # each row's (or lane's) maximum before this chunk
    after: UOp  # and after it
    element: UOp  # the chunk's elements (-inf where masked)
    final: UOp  # each row's (or lane's) maximum after the loop
    per_row: bool  # "row": one maximum per row, each chunk's folded in; "lane": one per lane of the tile


def lower_blocks(sink: UOp, plan: BlockPlan, variant: str) -> UOp:
    """`sink` (after phases.block_rewrite) as the block UOps of `variant` (one of plan.variants)."""
    return _BlockLowering(sink, plan, variant).run()


def _index(value: int | UOp) -> UOp:
    """An extent as an index UOp: a constant, or already an expression of size variables
    (Note: symbolic blocks, codegen/blocks.py)."""
    return value if isinstance(value, UOp) else UOp.const(dtypes.index, value)


def decompose(position: UOp, ranges: tuple[UOp, ...], r: UOp) -> UOp:
    """Range `r`'s value at the flattened `position` over `ranges` (last fastest)."""
    i = ranges.index(r)
    stride = elements(ranges[i + 1 :])
    value = position if isinstance(stride, int) and stride == 1 else position.alu(Ops.IDIV, _index(stride))
    return value if i == 0 else value.alu(Ops.MOD, r.src[0])


def _and(masks: list[UOp]) -> UOp | None:
    """The lanes every mask of `masks` keeps (None: no mask), each mask once, in order."""
    unique = list(dict.fromkeys(masks))
    return functools.reduce(lambda a, b: a.alu(Ops.AND, b), unique) if unique else None


class _BlockLowering:
    def __init__(self, sink: UOp, plan: BlockPlan, variant: str):
        self.sink, self.shape, self.persistent = sink, plan.shape, variant == "persistent"
        dims = 1 if self.shape.pointwise else 2
        start = UOp(Ops.PROGRAM_ID, dtypes.index).alu(Ops.MUL, UOp(Ops.BLOCK_SIZE, dtypes.index, (), BlockAxis.X))
        self.xindex = start.alu(Ops.ADD, UOp(Ops.ARANGE, dtypes.index, (), BlockArg(BlockAxis.X, dims)))
        self.xmask = self.xindex.lt(_index(self.shape.xnumel))
        self.rbase = UOp(Ops.ARANGE, dtypes.index, (), BlockArg(BlockAxis.R))
        self.loop_orders = itertools.count()
        self.acc_ids = itertools.count()
        self.owner = {r: red for red in self.shape.reduces for r in red.src[1:]}  # reduce range -> its REDUCE
        self.phases: dict[UOp, Phase] = {}  # REDUCE -> its phase
        self.range_phase: dict[UOp, Phase] = {}  # a phase's range -> the phase
        # Note: a row's exponential sum in one pass (codegen/online_softmax.py)
        self.exp_sum_maximum = plan.exp_sum_maximum  # "row", "lane" or "off"
        self.exp_sums = {} if self.persistent or self.exp_sum_maximum == "off" else self.find_exp_sums()
        self.online_maxima: dict[UOp, OnlineMax] = {}  # a maximum an exp sum walks with -> its lanes' values
        for red in self.shape.reduces:
            self.phase_of_reduce(red)
        self.inner = self.make_phase(self.shape.inner, None, self.inner_kind()) if self.shape.inner else None

    # -- phases --
    def inner_kind(self) -> RangeKind:
        """The inner phase's loop: a scan's carry updates in it (a scan loop), stores only in a
        reduction kernel's (an output loop)."""
        return RangeKind.SCAN if self.shape.scans else RangeKind.LOOP

    def find_exp_sums(self) -> dict[UOp, ExpSum]:
        """The blocked sums of exponentials shifted by a blocked maximum of their own row in this
        kernel (Note: a row's exponential sum in one pass)."""
        blocked = set(self.shape.reduces) - set(self.shape.sequential)
        found = {red: exp_sum_of_max(red) for red in blocked}
        return {red: f for red, f in found.items() if f is not None and f.maximum in blocked}

    def phase_of_reduce(self, red: UOp) -> Phase:
        if red in self.phases:
            return self.phases[red]
        enclosing = [self.phase_of_reduce(self.owner[r]) for r in red.ranges if r in self.owner]
        parent = max(enclosing, key=lambda p: p.depth, default=None)
        ranges = red.src[1:]
        if red in self.shape.sequential:
            phase = self.sequential_phase(ranges, parent, chunked=red in self.shape.chunked)
        else:
            phase = (
                self.maximum_phase(red, parent)
                or self.shared_phase(red, parent)
                or self.make_phase(ranges, parent, RangeKind.REDUCE)
            )
        self.phases[red] = phase
        return phase

    def maximum_phase(self, red: UOp, parent: Phase | None) -> Phase | None:
        """An exp sum walks the loop of the maximum it is shifted by, at the same positions (Note: a
        row's exponential sum in one pass); None: not an exp sum, or its maximum runs elsewhere."""
        if red not in self.exp_sums:
            return None
        phase = self.phase_of_reduce(self.exp_sums[red].maximum)
        if phase.parent is not parent:
            del self.exp_sums[red]
            return None
        return self.keep(Phase(red.src[1:], phase.position, phase.mask, parent, phase.loop))

    def shared_phase(self, red: UOp, parent: Phase | None) -> Phase | None:
        """Looped: the loop of an earlier blocked REDUCE over as many elements, in the same
        enclosing phase, that `red` does not read (Note: independent reductions share a looped
        phase), walked at the same positions; None: a loop of its own."""
        if self.persistent:
            return None  # persistent phases share one position already
        numel = elements(red.src[1:])
        reads = set(red.src[0].toposort)
        read_loops = {phase.loop for other, phase in self.phases.items() if other in reads}  # not final in them
        for phase in self.phases.values():
            if phase.sequential or phase.parent is not parent or elements(phase.ranges) != numel:
                continue
            if phase.loop in read_loops:
                continue
            return self.keep(Phase(red.src[1:], phase.position, phase.mask, parent, phase.loop))
        return None

    def make_phase(self, ranges: tuple[UOp, ...], parent: Phase | None, kind: RangeKind) -> Phase:
        """A phase on the r axis: persistent (the row in one block) or looped (RBLOCK chunks)."""
        numel = elements(ranges)
        if self.persistent:
            phase = Phase(ranges, self.rbase, self.rbase.lt(_index(numel)), parent)
        else:
            loop = self.loop(numel, kind, BlockAxis.R)
            position = loop.alu(Ops.ADD, self.rbase)
            phase = Phase(ranges, position, position.lt(_index(numel)), parent, loop)
        return self.keep(phase)

    def sequential_phase(self, ranges: tuple[UOp, ...], parent: Phase | None, chunked: bool) -> Phase:
        numel = elements(ranges)
        if not chunked:
            loop = self.loop(numel, RangeKind.REDUCE, None)
            return self.keep(Phase(ranges, loop, None, parent, loop, sequential=True))
        loop = self.loop(numel, RangeKind.REDUCE, BlockAxis.X)
        position = loop.alu(Ops.ADD, UOp(Ops.ARANGE, dtypes.index, (), BlockArg(BlockAxis.X)))
        return self.keep(Phase(ranges, position, position.lt(_index(numel)), parent, loop, True, sequential=True))

    def loop(self, numel: int | UOp, kind: RangeKind, block: BlockAxis | None) -> UOp:
        return UOp(Ops.RANGE, dtypes.index, (_index(numel),), RangeArg(kind, next(self.loop_orders), block=block))

    def keep(self, phase: Phase) -> Phase:
        for r in phase.ranges:
            self.range_phase[r] = phase
        return phase

    # -- masks --
    def lanes(self, phase: Phase | None) -> UOp:
        """The active lanes of `phase`: x's, or a chunked loop's, and its block phase's."""
        chain = list(phase.chain()) if phase is not None else []
        chunk = next((p for p in chain if p.chunked), None)
        block = next((p for p in chain if not p.sequential), None)
        masks = [self.xmask if chunk is None or chunk.mask is None else chunk.mask]
        lanes = _and(masks + ([block.mask] if block is not None and block.mask is not None else []))
        assert lanes is not None
        return lanes

    def here(self, ranges: frozenset[UOp]) -> Phase | None:
        """The innermost phase of `ranges` (None: they vary with x loops only)."""
        phases = [self.range_phase[r] for r in ranges if r in self.range_phase]
        return max(phases, key=lambda p: p.depth, default=None)

    def load_mask(self, position: UOp) -> UOp | None:
        """x's mask if the position varies with x, and the mask of each phase it varies with,
        outermost first (as `lanes` orders them, so a load and a store of one phase share one mask)."""
        outer = set(self.shape.outer)
        phases = sorted({self.range_phase[r] for r in position.ranges if r in self.range_phase}, key=lambda p: p.depth)
        masks = ([self.xmask] if position.ranges & outer else []) + [p.mask for p in phases if p.mask is not None]
        return _and(masks)

    # -- the rewrite --
    def run(self) -> UOp:
        new: dict[UOp, UOp] = {}
        for u in self.sink.toposort:
            new[u] = self.lower(u, new)
        return new[self.sink]

    def lower(self, u: UOp, new: dict[UOp, UOp]) -> UOp:
        src = tuple(new[s] for s in u.src)
        if u.op is Ops.RANGE:
            owner = self.range_phase.get(u)
            return (
                decompose(self.xindex, self.shape.outer, u)
                if owner is None
                else decompose(owner.position, owner.ranges, u)
            )
        if u.op is Ops.REDUCE:
            return self.reduce(u, src[0], new)
        if u.op is Ops.SCAN:
            return self.scan(u, src[0])
        if u.op is Ops.LOAD:
            mask = self.load_mask(u.src[0].src[1])
            return UOp(Ops.LOAD, u.dtype, src + ((mask,) if mask is not None else ()), u.arg)
        if u.op is Ops.STORE:
            inner = self.inner if not u.ranges <= set(self.shape.outer) else None
            return UOp(Ops.STORE, u.dtype, (*src[:2], self.lanes(inner)), u.arg)
        if u.op is Ops.CHECK:
            return UOp(Ops.CHECK, u.dtype, (*src, self.lanes(self.here(u.ranges))), u.arg)
        if u.op is Ops.PHILOX:
            return UOp(Ops.WORD, u.dtype, (UOp(Ops.PHILOX4, dtypes.uint32, src),), u.arg)
        return u if all(a is b for a, b in zip(src, u.src)) else UOp(u.op, u.dtype, src, u.arg)

    def accumulator(self, dtype: DType, combine: Ops, phase: Phase, block: AccBlock, identity=None) -> UOp:
        """An accumulator declared inside the loops `phase` runs in (so it restarts for each)."""
        enclosing = tuple(p.loop for p in phase.parent.chain() if p.loop is not None) if phase.parent else ()
        identity = normalize_const(dtype, reduce_identity(combine, dtype) if identity is None else identity)
        return UOp(Ops.DEFINE_ACC, dtype, enclosing, AccArg(combine, identity, next(self.acc_ids), block=block))

    def reduce(self, red: UOp, value: UOp, new: dict[UOp, UOp]) -> UOp:
        phase, combine = self.phases[red], red.arg
        identity = UOp.const(red.dtype, reduce_identity(combine, red.dtype))
        if phase.sequential:
            return self.sequential_reduce(red, value, phase, identity)
        masked = self.lanes(phase).where(value, identity)
        if self.persistent:
            return UOp(Ops.BLOCK_REDUCE, red.dtype, (masked,), BlockReduceArg(combine, BlockAxis.R))
        if red in self.exp_sums:
            return self.exp_sum(red, self.exp_sums[red], new[self.exp_sums[red].shift])
        if any(found.maximum is red for found in self.exp_sums.values()):
            return self.online_maximum(red, masked, phase)
        acc = self.accumulator(red.dtype, combine, phase, AccBlock.TILE)
        assert phase.loop is not None
        read = UOp(Ops.ACC_READ, red.dtype, (acc, UOp(Ops.ACC_UPDATE, red.dtype, (acc, masked, phase.loop))))
        return UOp(Ops.BLOCK_REDUCE, red.dtype, (read,), BlockReduceArg(combine, BlockAxis.R))

    def online_maximum(self, red: UOp, masked: UOp, phase: Phase) -> UOp:
        """A maximum an exp sum walks with (Note: a row's exponential sum in one pass): each row's (a
        [XBLOCK, 1] accumulator, each chunk's maximum folded in) or each lane's, before and after each
        chunk, which the sum's update reads."""
        per_row = self.exp_sum_maximum == "row"
        acc = self.accumulator(red.dtype, Ops.MAX, phase, AccBlock.ROWS if per_row else AccBlock.TILE)
        assert phase.loop is not None
        prior = UOp(Ops.ACC_PRIOR, red.dtype, (acc, phase.loop))
        chunk = UOp(Ops.BLOCK_REDUCE, red.dtype, (masked,), BlockReduceArg(Ops.MAX, BlockAxis.R)) if per_row else masked
        after = prior.alu(Ops.MAX, chunk)
        update = UOp(Ops.ACC_UPDATE, red.dtype, (acc, after, phase.loop), AccUpdate.REPLACE)
        read = UOp(Ops.ACC_READ, red.dtype, (acc, update))
        self.online_maxima[red] = OnlineMax(prior, after, masked, read, per_row)
        return read if per_row else UOp(Ops.BLOCK_REDUCE, red.dtype, (read,), BlockReduceArg(Ops.MAX, BlockAxis.R))

    def exp_sum(self, red: UOp, found: ExpSum, shift: UOp) -> UOp:
        """Note: a row's exponential sum in one pass: each lane's sum, relative to the row's or its own
        maximum, updated in the maximum's loop, then folded and scaled to the row's `shift`."""
        maximum, phase = self.online_maxima[found.maximum], self.phases[red]
        lane = lane_sum_dtype(red.dtype, found)
        acc = self.accumulator(lane, Ops.ADD, phase, AccBlock.TILE)
        assert phase.loop is not None
        prior = UOp(Ops.ACC_PRIOR, lane, (acc, phase.loop))
        value = online_update(summed_as(found, lane), maximum.prior, maximum.after, prior, maximum.element)
        update = UOp(Ops.ACC_UPDATE, lane, (acc, value, phase.loop), AccUpdate.REPLACE)
        lanes = UOp(Ops.ACC_READ, lane, (acc, update))
        lanes = lanes if lane is red.dtype else lanes.cast(red.dtype)
        if maximum.per_row:
            total = UOp(Ops.BLOCK_REDUCE, red.dtype, (lanes,), BlockReduceArg(Ops.ADD, BlockAxis.R))
            return row_total(found, total, maximum.final, shift)
        lanes = lane_total(found, lanes, maximum.final, shift)
        return UOp(Ops.BLOCK_REDUCE, red.dtype, (lanes,), BlockReduceArg(Ops.ADD, BlockAxis.R))

    def sequential_reduce(self, red: UOp, value: UOp, phase: Phase, identity: UOp) -> UOp:
        """Note: nested reductions. A [XBLOCK, 1] accumulator updated once per element, or,
        chunked, once per XBLOCK elements and then folded over x."""
        acc = self.accumulator(red.dtype, red.arg, phase, AccBlock.ROWS)
        assert phase.loop is not None
        if phase.chunked:
            assert phase.mask is not None
            value = phase.mask.where(value, identity)
        read = UOp(Ops.ACC_READ, red.dtype, (acc, UOp(Ops.ACC_UPDATE, red.dtype, (acc, value, phase.loop))))
        if not phase.chunked:
            return read
        return UOp(Ops.BLOCK_REDUCE, red.dtype, (read,), BlockReduceArg(red.arg, BlockAxis.X))

    def scan(self, scan: UOp, value: UOp) -> UOp:
        """Note: scans on blocks (renderer/triton_scan.py); bools scan as int8 (Triton's max has
        no i1 form)."""
        phase, combine = self.inner, scan.arg
        assert phase is not None
        mask = self.lanes(phase)
        work = dtypes.int8 if scan.dtype.is_bool else scan.dtype
        masked = mask.where(value, UOp.const(scan.dtype, reduce_identity(combine, scan.dtype))).cast(work)
        scanned = UOp(Ops.BLOCK_SCAN, work, (masked,), combine)
        if not self.persistent:
            start = -0.0 if combine is Ops.ADD and work.is_float else None
            carry = self.accumulator(work, combine, phase, AccBlock.CARRY, start)
            assert phase.loop is not None
            scanned = UOp(Ops.ACC_RUNNING, work, (carry, UOp(Ops.ACC_UPDATE, work, (carry, scanned, phase.loop))))
        return scanned if work is scan.dtype else scanned.alu(Ops.CMPNE, UOp.const(work, 0))
