"""Stage `lower`, GPU graphs only: reductions with few outputs split over many programs.

Takes the LoweredGraph that lower_graph made and, for the Triton backend, rewrites each
REDUCE that would keep too few GPU programs busy into two computed buffers (Note: split
reductions). CPU graphs never come here: their reduction loops are already split over
threads by OpenMP (renderer/cpp.py).

Note: split reductions
    A Triton kernel's programs walk its outputs (Note: blocks for a kernel AST,
    renderer/triton.py), so a reduction with few outputs and a long reduced extent
    (x.sum() of 64M elements, the column sums of a (1M, 16) tensor, a loss) would run on one
    or a few of the GPU's SMs. Before scheduling, such a REDUCE(value, *ranges) becomes
      - a *partials* buffer of shape (S, *outer sizes): partials[s, o] reduces chunk s of the
        row-major flattened reduced positions, positions s*chunk .. s*chunk+chunk-1, so a
        program reads one contiguous stretch (as inductor's split reductions do);
      - in the original body, a REDUCE over the S partials.
    Both levels combine with the REDUCE's own op in its own dtype (float sums in float64,
    integer sums in int64, max/min in the input's type, NaN-propagating), so results match
    the one-program reduction up to summation order. The last chunk may run past the end:
    there the read is clamped to position 0 and the value is the combine's identity.
    The rewrite walks REDUCEs sources first, so a reduction that reads another one (the
    squared deviations of var read the mean; argmax's least index that hits the max reads
    the max, lower/reductions.py) reads it through its already split form: each partials
    program re-reduces the other's S partials (a few hundred values, from cache) instead of
    a third kernel. Partials buffers are ordinary computed buffers: the scheduler fuses
    those of one shape (sum and max of one tensor read it once) and the final REDUCE with
    its consumers, never a partials buffer into its own final REDUCE (a reduction inside
    a reduction).
    Not yet: var reads its input twice (mean, then squared deviations), where a Welford
    combine of (mean, m2, count) partials would read it once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ember.ir import Buffer, ComputedBuffer, Layout, LoweredGraph
from ember.lower.context import LoweringContext
from ember.lower.values import axis
from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import Ops, UOp, substitute


@dataclass(frozen=True)
class SplitPolicy:
    """When a reduction is split, and into how many chunks."""

    min_extent: int  # reductions shorter than this stay whole (0: never split)
    max_outputs: int = 256  # this many outputs already fill the GPU (about 2 per SM of an H100)
    target_programs: int = 1024  # programs the partials kernel aims at (about 8 per SM)

    def splits(self, outputs: int, extent: int) -> tuple[int, int] | None:
        """(number of chunks, chunk length), or None to keep the reduction whole."""
        if self.min_extent <= 0 or extent < self.min_extent or outputs >= self.max_outputs or outputs == 0:
            return None
        min_chunk = max(self.min_extent // 16, 1)
        count = min(_ceil_div(self.target_programs, outputs), extent // min_chunk)
        if count < 2:
            return None
        align = min(1024, 1 << (min_chunk.bit_length() - 1))  # chunks start at aligned positions
        chunk = _ceil_div(_ceil_div(extent, count), align) * align
        count = _ceil_div(extent, chunk)
        return (count, chunk) if count >= 2 else None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def split_reductions(graph: LoweredGraph, ctx: LoweringContext, policy: SplitPolicy) -> int:
    """Splits the graph's long reductions with few outputs in place; returns how many."""
    steps: list = []
    total = 0
    done: dict[tuple[UOp, tuple[int, ...]], UOp] = {}  # (REDUCE, its axes' sizes) -> REDUCE over partials
    for step in graph.steps:
        if isinstance(step, ComputedBuffer) and any(u.op is Ops.REDUCE for u in step.body.toposort):
            partials, step = _split_step(step, ctx, policy, done)
            steps += partials
            total += len(partials)
        steps.append(step)
    graph.steps = steps
    return total


def _split_step(step: ComputedBuffer, ctx: LoweringContext, policy: SplitPolicy,
                done: dict[tuple[UOp, tuple[int, ...]], UOp]) -> tuple[list, ComputedBuffer]:  # fmt: skip
    """`done`: reductions split for earlier steps (var_mean's mean is in both of its outputs)."""
    shape = step.buffer.layout.size
    replaced: dict[UOp, UOp] = {}  # original REDUCE -> REDUCE over its partials
    partials: list[ComputedBuffer] = []
    for red in [u for u in step.body.toposort if u.op is Ops.REDUCE]:
        current = substitute(red, replaced) if replaced else red
        axes = sorted({u.arg for u in current.toposort if u.op is Ops.AXIS})
        sizes = tuple(shape[a] for a in axes)
        if (current, sizes) in done:
            replaced[red] = done[current, sizes]
            continue
        split = policy.splits(math.prod(sizes), math.prod(r.src[0].arg for r in current.src[1:]))
        if split is None or _reads_own_ranges(current):
            continue
        buffer, body = _partials(current, axes, list(sizes), split, ctx)
        partials.append(ComputedBuffer(buffer, body, step.origins, split_partials=True))
        replaced[red] = done[current, sizes] = _reduce_partials(current, buffer, axes, ctx)
    if not replaced:
        return [], step
    return partials, ComputedBuffer(step.buffer, substitute(step.body, replaced), step.origins)


def _reads_own_ranges(red: UOp) -> bool:
    """A reduction inside this one's loop (none come from lowering today): left whole."""
    own = set(red.src[1:])
    return any(u is not red and u.op is Ops.REDUCE and u.ranges & own for u in red.toposort)


def _partials(red: UOp, axes: list[int], sizes: list[int], split: tuple[int, int],
              ctx: LoweringContext) -> tuple[Buffer, UOp]:  # fmt: skip
    """The partials buffer (S, *sizes) and its body: chunk AXIS 0 of the reduced positions,
    the outer axes moved one place right."""
    count, chunk = split
    ranges = red.src[1:]
    extent = math.prod(r.src[0].arg for r in ranges)
    step = ctx.reduce_range(chunk)
    flat = axis(0) * chunk + step
    inside = None
    if count * chunk != extent:
        inside = flat.alu(Ops.CMPLT, UOp.const(dtypes.index, extent))
        flat = inside.where(flat, UOp.const(dtypes.index, 0))
    mapping = {axis(a): axis(i + 1) for i, a in enumerate(axes)}
    stride = extent
    for r in ranges:
        size = r.src[0].arg
        stride //= size
        position = flat if stride == 1 else flat // stride
        mapping[r] = position if stride * size == extent else position % size
    value = substitute(red.src[0], mapping)
    if inside is not None:
        value = inside.where(value, UOp.const(red.dtype, identity(red.arg, red.dtype)))
    buffer = ctx.add_buffer(Buffer(ctx.new_name(), red.dtype, Layout.contiguous((count, *sizes)), "computed"))
    return buffer, UOp(Ops.REDUCE, red.dtype, (value, step), red.arg)


def _reduce_partials(red: UOp, buffer: Buffer, axes: list[int], ctx: LoweringContext) -> UOp:
    part = ctx.reduce_range(buffer.layout.size[0])
    index = buffer.layout.index([part, *(axis(a) for a in axes)])
    load = UOp(Ops.LOAD, red.dtype, (UOp(Ops.INDEX, red.dtype, (buffer.uop(), index)),))
    return UOp(Ops.REDUCE, red.dtype, (load, part), red.arg)


def identity(combine: Ops, dtype: DType) -> int | float | bool:
    """The value that leaves a combine unchanged (codegen/phases.py has the same table)."""
    if combine is Ops.ADD:
        return 0
    if combine is Ops.MUL:
        return 1
    if combine is Ops.MAX:
        return dtype.min
    if combine is Ops.MIN:
        return dtype.max
    raise ValueError(f"split reductions: no identity for {combine}")
