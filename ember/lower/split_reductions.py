"""Stage `lower`, GPU graphs only: reductions with few outputs split over many programs.

Takes the LoweredGraph that lower_graph made and, for the Triton backend, rewrites each
REDUCE that would keep too few GPU programs busy into two computed buffers (Note: split
reductions). CPU graphs never come here: their reduction loops are already split over
threads by OpenMP (renderer/cpp.py).

Note: split reductions
    A Triton kernel's programs walk its outputs (Note: blocks for a kernel AST,
    renderer/triton.py), so a reduction with few outputs and a long reduced extent
    (x.sum() of 64M elements, the column sums of a (1M, 16) tensor, a loss) would run on one
    or a few of the GPU's SMs; so would up to a few thousand long outputs, as a looped program
    walks up to 32 of them (the 1024 column sums of a (131072, 1024) tensor: 32 to 128
    programs; `SplitPolicy.wide_outputs`), and so would a shorter sum across rows of as many
    outputs (an RMSNorm weight's gradient: 1024 columns of 4096 rows, `reads_across`). Before
    scheduling, such a REDUCE(value, *ranges) becomes
      - a *partials* buffer of shape (S, *outer sizes): partials[s, o] reduces chunk s of the
        row-major flattened reduced positions, positions s*chunk .. s*chunk+chunk-1, so a
        program reads one contiguous stretch (as inductor's split reductions do);
      - in the original body, a REDUCE over the S partials.
    Both levels combine with the REDUCE's own op in its own dtype (float sums in float64,
    integer sums in int64, max/min in the input's type, NaN-propagating), so results match
    the one-program reduction up to summation order. The last chunk may run past the end:
    there the read is clamped to position 0 and the value is the combine's identity.
    The rewrite walks REDUCEs sources first, so a reduction that reads another one
    (argmax's least index that hits the max reads the max, lower/reductions.py) reads it
    through its already split form: each partials program re-reduces the other's S partials
    (a few hundred values, from cache) instead of a third kernel.
    Note: an arg-extreme split in one pass. argmax (argmin) is the least position whose element is
    the max (a NaN's, NaN included: lower/reductions.py `arg_extreme`); read through the split max,
    each chunk's program would re-reduce the max's partials and read the data a second time after
    the max's own kernel read it once. Instead each chunk keeps its own max and the first position
    hitting it (one read of a chunk its program holds: chunks of at most `one_pass_chunk`), and the
    final kernel takes the least of those positions among the chunks whose max is the overall max
    (or NaN): the first hit overall, since an earlier chunk holding the max would have it as its own.
    var's squared deviations from the mean (`variance_parts`) would so read the data twice;
    instead each chunk gets its sum and its squared deviations from its *own* mean, two
    passes over values one program holds (chunks of at most `one_pass_chunk`, so the
    persistent variant loads them once), and the final kernel combines them as Chan et al.:
    M2 = sum_s M2_s + sum_s n_s (mean_s - mean)^2. As robust as eager's Welford (no sum of
    squares minus squared sum), in float64, and one read of the data.
    Partials buffers are ordinary computed buffers: the scheduler fuses those of one shape
    (sum and max of one tensor read it once) and small final results that read partials
    without its peak-memory check, and never fuses a partials buffer into its reader (a
    reduction inside a reduction, schedule/fusion.py `reads_partials`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ember.ir import Buffer, ComputedBuffer, Layout, LoweredGraph
from ember.lower.context import LoweringContext
from ember.lower.values import axis
from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import Ops, UOp, reduce_identity, substitute
from ember.uop.symbolic import distributed_terms, simplify


@dataclass(frozen=True)
class SplitPolicy:
    """When a reduction is split, and into how many chunks."""

    min_extent: int  # reductions shorter than this stay whole (0: never split)
    max_outputs: int = 256  # this many outputs already fill the GPU (about 2 per SM of an H100)
    target_programs: int = 1024  # programs the partials kernel aims at (about 8 per SM)
    one_pass_chunk: int = 4096  # var's chunks: short enough that a program holds one (persistent)
    # A program of a looped reduction may walk up to 32 outputs at once (XBLOCK: the column sums
    # of a (131072, 1024) tensor ran on 32 to 128 programs, at a third of eager's speed on an
    # H200), so chunks are counted for 32 outputs a program, and up to `wide_outputs` outputs
    # still split where each is at least `wide_ratio` times longer than there are outputs.
    wide_outputs: int = 4096
    wide_ratio: int = 64
    outputs_per_program: int = 32
    # A reduction across rows (a column sum: the reduced positions far apart in memory, the
    # outputs side by side) of up to `wide_outputs` outputs splits from `across_elements` elements
    # on, however short each column: an RMSNorm weight's gradient, 1024 column sums of 4096 rows
    # of 4 tensors, ran on 32 to 128 programs at 1.1 TB/s on an H100 (inductor splits it).
    across_elements: int = 1 << 20
    across_chunk: int = 256  # rows a partials program sums at least

    def splits(self, outputs: int, extent: int, max_chunk: int | None = None,
               across: bool = False) -> tuple[int, int] | None:  # fmt: skip
        """(number of chunks, chunk length), or None to keep the reduction whole. `across`: the
        reduction walks rows of side-by-side outputs (`reads_across`)."""
        if self.min_extent <= 0 or outputs == 0:
            return None
        if across and outputs < self.wide_outputs and outputs * extent >= self.across_elements and max_chunk is None:
            return self._across(outputs, extent)
        if extent < self.min_extent:
            return None
        if outputs >= self.max_outputs and (outputs >= self.wide_outputs or extent < self.wide_ratio * outputs):
            return None
        # counted as a looped program walks them (XBLOCK up to 32): a column sum's partials are coalesced
        # only when a program takes a row's neighbouring columns at once, so (4M, 16) needs 1024 chunks
        # of (4096, 16) to keep 512 such programs busy (64 chunks ran on 32 programs)
        programs = _ceil_div(outputs, self.outputs_per_program)
        min_chunk = max(self.min_extent // 16, 1)
        count = min(_ceil_div(self.target_programs, programs), extent // min_chunk)
        if max_chunk is not None:
            count = max(count, _ceil_div(extent, max_chunk))
        if count < 2:
            return None
        align = min(1024, 1 << (min_chunk.bit_length() - 1))  # chunks start at aligned positions
        chunk = _ceil_div(_ceil_div(extent, count), align) * align
        count = _ceil_div(extent, chunk)
        return (count, chunk) if count >= 2 else None

    def symbolic_splits(self, outputs: int, extent: UOp, across: bool = False) -> tuple[int, int] | None:
        """(number of chunks, what a chunk's length is a multiple of) for a reduced extent of
        symbolic size (Note: split reductions of symbolic extents), or None to keep it whole."""
        if self.min_extent <= 0 or outputs == 0 or extent.vmax < self.min_extent:
            return None
        if across and outputs < self.wide_outputs:
            align = 64
        elif outputs < self.max_outputs:
            align = min(1024, 1 << (max(self.min_extent // 16, 1).bit_length() - 1))
        else:
            return None
        count = _ceil_div(self.target_programs, _ceil_div(outputs, self.outputs_per_program))
        return (count, align) if count >= 2 else None

    def _across(self, outputs: int, extent: int) -> tuple[int, int] | None:
        programs = _ceil_div(outputs, self.outputs_per_program)
        count = min(_ceil_div(self.target_programs, programs), extent // self.across_chunk)
        if count < 2:
            return None
        chunk = _ceil_div(_ceil_div(extent, count), 64) * 64
        count = _ceil_div(extent, chunk)
        return (count, chunk) if count >= 2 else None


def reads_across(red: UOp) -> bool:
    """Whether REDUCE `red` reads across rows: some load of its value steps through memory by
    more than one element along its innermost reduced position while its neighbouring outputs
    (an output axis of stride 1) lie side by side, and no load that varies with the outputs
    reads along the reduced position (a per-row scale, read the same by every output, may)."""
    innermost = red.src[-1]
    across = False
    for u in red.src[0].toposort:
        if u.op is not Ops.INDEX or len(u.src) < 2:
            continue
        form = distributed_terms(simplify(u.src[1]))
        if form is None:
            continue
        coefficients = form[0]
        output_strides = [k for v, k in coefficients.items() if v.op is Ops.AXIS]
        if not output_strides:
            continue
        step = coefficients.get(innermost, 0)
        if step in (1, -1):
            return False
        across = across or (step != 0 and 1 in output_strides)
    return across


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


@dataclass(frozen=True)
class Chunks:
    """How one REDUCE splits: `count` chunks of `length` of its `extent` flattened reduced
    positions, for each position of the outer `axes` (of `sizes`) of the step's buffer."""

    count: int
    length: int | UOp  # UOps where the extent is symbolic (Note: split reductions of symbolic extents)
    extent: int | UOp
    axes: tuple[int, ...]
    sizes: tuple[int, ...]


def _split_step(step: ComputedBuffer, ctx: LoweringContext, policy: SplitPolicy,
                done: dict[tuple[UOp, tuple[int, ...]], UOp]) -> tuple[list, ComputedBuffer]:  # fmt: skip
    """`done`: reductions split for earlier steps (var_mean's mean is in both of its outputs)."""
    shape = step.buffer.layout.size
    replaced: dict[UOp, UOp] = {}  # original REDUCE -> REDUCE over its partials
    partials: list[tuple[Buffer, UOp]] = []  # (buffer, body)
    reduces = [u for u in step.body.toposort if u.op is Ops.REDUCE]
    variances = {parts[0]: red for red in reduces if (parts := variance_parts(red)) is not None}
    first_hits = {red: hit for red in reduces if (hit := first_hit_parts(red)) is not None}
    extremes = {hit[0] for hit in first_hits.values()}  # split with their first hits, in one pass
    for red in reduces:
        if red in replaced or red in extremes:
            continue
        current = substitute(red, replaced) if replaced else red
        axes = tuple(sorted({u.arg for u in current.toposort if u.op is Ops.AXIS}))
        sizes = tuple(shape[a] for a in axes)
        if any(type(s) is not int for s in sizes):
            continue  # symbolic outputs (Note: symbolic sizes): as many as rows, they fill the GPU
        if (current, sizes) in done:  # (checked after: a SymInt has no hash)
            replaced[red] = done[current, sizes]
            continue
        one_pass = (red in variances and variances[red] not in replaced) or red in first_hits
        if any(r.src[0].op is not Ops.CONST for r in current.src[1:]):
            if not one_pass and (chunks := _symbolic_chunks(current, axes, sizes, policy)) is not None:
                replaced[red] = _reduce_partials(current, _partials(current, chunks, ctx, partials), chunks, ctx)
                done[current, sizes] = replaced[red]
            continue
        extent = math.prod(r.src[0].arg for r in current.src[1:])
        split = policy.splits(math.prod(sizes), extent, policy.one_pass_chunk if one_pass else None,
                              across=reads_across(current))  # fmt: skip
        if split is None or (_reads_own_ranges(current) and red not in first_hits):
            continue
        chunks = Chunks(*split, extent, axes, sizes)
        if red in first_hits:
            extreme = first_hits[red][0]
            replaced[extreme], replaced[red] = _split_first_hit(current, *first_hits[red], chunks, ctx, partials)
            done[extreme, sizes] = replaced[extreme]
        elif one_pass:
            replaced[red], replaced[variances[red]] = _split_variance(current, chunks, ctx, partials)
        else:
            replaced[red] = _reduce_partials(current, _partials(current, chunks, ctx, partials), chunks, ctx)
        done[current, sizes] = replaced[red]
    if not replaced:
        return [], step
    computed = [ComputedBuffer(b, body, step.origins, split_partials=True) for b, body in partials]
    return computed, ComputedBuffer(step.buffer, substitute(step.body, replaced), step.origins)


def _symbolic_chunks(red: UOp, axes: tuple[int, ...], sizes: tuple[int, ...], policy: SplitPolicy) -> Chunks | None:
    """Note: split reductions of symbolic extents
    A reduction over a symbolic extent (x.sum() of every element of a (s, 768) tensor, the column
    sums of (s, 16)) with few static outputs would run on one program per output whatever the
    size: 35 ms for a 64 MB sum on an H200, against 0.5 for the static split. It splits into a
    static number of chunks (as a static one of unbounded length would) whose length is a
    multiple of `align` computed from the sizes, ceil(extent / (count * align)) * align: the
    chunks past the end read nothing. One-pass splits (var, argmax) need a chunk a program holds,
    which a symbolic length cannot promise: they split in two passes instead, the mean's (the max's)
    partials first, then the squared deviations' (the first hits') partials, each chunk's program
    re-reducing the first partials (the data read twice, by many programs, not once by one)."""
    if _reads_own_ranges(red):
        return None
    extent = simplify(math.prod((r.src[0] for r in red.src[1:]), start=UOp.const(dtypes.index, 1)))
    split = policy.symbolic_splits(math.prod(sizes), extent, across=reads_across(red))
    if split is None:
        return None
    count, align = split
    span = UOp.const(dtypes.index, count * align)
    length = simplify((extent + span - UOp.const(dtypes.index, 1)) // span * UOp.const(dtypes.index, align))
    return Chunks(count, length, extent, axes, sizes)


def _reads_own_ranges(red: UOp) -> bool:
    """A reduction inside this one's loop (none come from lowering today): left whole."""
    own = set(red.src[1:])
    return any(u is not red and u.op is Ops.REDUCE and u.ranges & own for u in red.toposort)


def _chunk_positions(red: UOp, chunks: Chunks, step: UOp) -> tuple[dict[UOp, UOp], UOp | None]:
    """The substitution that reads `red`'s value at position `step` of chunk AXIS 0 (outer axes
    moved one place right), and the condition that the position is inside the extent (None:
    always)."""
    flat = axis(0) * chunks.length + step
    inside = None
    symbolic = isinstance(chunks.length, UOp)
    if symbolic or chunks.count * chunks.length != chunks.extent:
        inside = flat.alu(Ops.CMPLT, UOp.const(dtypes.index, chunks.extent))
        flat = inside.where(flat, UOp.const(dtypes.index, 0))
    mapping = {axis(a): axis(i + 1) for i, a in enumerate(chunks.axes)}
    sizes = [r.src[0] for r in red.src[1:]]
    for i, r in enumerate(red.src[1:]):
        stride = simplify(math.prod(sizes[i + 1 :], start=UOp.const(dtypes.index, 1)))  # row-major
        position = flat if stride.op is Ops.CONST and stride.arg == 1 else flat // stride
        mapping[r] = position if i == 0 else position % sizes[i]
    return mapping, inside


def _chunk_reduce(red: UOp, chunks: Chunks, ctx: LoweringContext, then=None) -> UOp:
    """REDUCE over one chunk of `red`'s value (`then` applied to it after the move to chunk
    positions), the combine's identity past the end."""
    step = ctx.reduce_range(chunks.length)
    mapping, inside = _chunk_positions(red, chunks, step)
    value = substitute(red.src[0], mapping)
    if then is not None:
        value = then(value)
    if inside is not None:
        value = inside.where(value, UOp.const(value.dtype, reduce_identity(red.arg, value.dtype)))
    return UOp(Ops.REDUCE, value.dtype, (value, step), red.arg)


def _partials(red: UOp, chunks: Chunks, ctx: LoweringContext, partials: list) -> Buffer:
    """A partials buffer (S, *sizes) whose body reduces chunk AXIS 0; appended to `partials`."""
    return _partials_of(_chunk_reduce(red, chunks, ctx), chunks, ctx, partials)


def _partials_of(body: UOp, chunks: Chunks, ctx: LoweringContext, partials: list) -> Buffer:
    layout = Layout.contiguous((chunks.count, *chunks.sizes))
    buffer = ctx.add_buffer(Buffer(ctx.new_name(), body.dtype, layout, "computed"))
    partials.append((buffer, body))
    return buffer


def _read_partial(buffer: Buffer, part: UOp, chunks: Chunks) -> UOp:
    index = buffer.layout.index([part, *(axis(a) for a in chunks.axes)])
    return UOp(Ops.LOAD, buffer.dtype, (UOp(Ops.INDEX, buffer.dtype, (buffer.uop(), index)),))


def _reduce_partials(red: UOp, buffer: Buffer, chunks: Chunks, ctx: LoweringContext) -> UOp:
    part = ctx.reduce_range(chunks.count)
    return UOp(Ops.REDUCE, red.dtype, (_read_partial(buffer, part, chunks), part), red.arg)


# ---- an arg-extreme in one pass ----------------------------------------------------------------


def first_hit_parts(red: UOp) -> tuple[UOp, UOp, bool] | None:
    """(extreme, element, NaN counts) when `red` is the least position of its elements that hits
    their extreme, REDUCE_MIN(where(element == REDUCE_MAX(element) [| isnan(element)], position, n))
    over the same positions, as lower/reductions.py `arg_extreme` builds argmax and argmin."""
    if red.arg is not Ops.MIN or len(red.src) != 2 or red.src[0].op is not Ops.WHERE:
        return None
    (hit, position, missing), r = red.src[0].src, red.src[1]
    if position is not r.cast(dtypes.int64) or missing.op is not Ops.CONST:
        return None
    nan = hit.op is Ops.OR
    compare = hit.src[0] if nan else hit
    if compare.op is not Ops.CMPEQ or compare.src[1].op is not Ops.REDUCE:
        return None
    element, extreme = compare.src
    if extreme.arg not in (Ops.MAX, Ops.MIN) or len(extreme.src) != 2 or extreme.src[1].src[0] is not r.src[0]:
        return None
    if substitute(extreme.src[0], {extreme.src[1]: r}) is not element:
        return None
    if nan and hit is not compare.alu(Ops.OR, element.alu(Ops.ISNAN)):
        return None
    return extreme, element, nan


def _split_first_hit(red: UOp, extreme: UOp, element: UOp, nan: bool, chunks: Chunks, ctx: LoweringContext,
                     partials: list) -> tuple[UOp, UOp]:  # fmt: skip
    """argmax/argmin in one pass over the data (Note: an arg-extreme split in one pass): per chunk its
    extreme and the first position hitting it, then the first of those positions among the chunks
    whose extreme is the overall one. Returns the REDUCEs for (extreme, position)."""
    chunk_extreme = _chunk_reduce(extreme, chunks, ctx)
    extremes = _partials_of(chunk_extreme, chunks, ctx, partials)
    moved = substitute(extreme, {axis(a): axis(i + 1) for i, a in enumerate(chunks.axes)})  # as _chunk_positions
    chunk_first = _chunk_reduce(red, chunks, ctx, then=lambda v: substitute(v, {moved: chunk_extreme}))
    firsts = _partials_of(chunk_first, chunks, ctx, partials)
    overall = _reduce_partials(extreme, extremes, chunks, ctx)
    part = ctx.reduce_range(chunks.count)
    candidate = _read_partial(extremes, part, chunks)
    hit = candidate.alu(Ops.CMPEQ, overall)
    hit = hit.alu(Ops.OR, candidate.alu(Ops.ISNAN)) if nan else hit
    value = hit.where(_read_partial(firsts, part, chunks), red.src[0].src[2])
    return overall, UOp(Ops.REDUCE, red.dtype, (value, part), Ops.MIN)


# ---- variance in one pass ----------------------------------------------------------------------


def variance_parts(red: UOp) -> tuple[UOp, UOp] | None:
    """(sum, value) when `red` is the sum of squared deviations of `value` from its mean,
    REDUCE((v - REDUCE(v) / n)^2) over the same positions, as lower/reductions.py builds var."""
    if red.arg is not Ops.ADD or red.src[0].op is not Ops.MUL or red.src[0].src[0] is not red.src[0].src[1]:
        return None
    centered = red.src[0].src[0]
    if centered.op is not Ops.SUB or centered.src[1].op is not Ops.FDIV:
        return None
    value, (total, count) = centered.src[0], centered.src[1].src
    if total.op is not Ops.REDUCE or total.arg is not Ops.ADD or count.op is not Ops.CONST:
        return None
    ranges = red.src[1:]
    if [r.src[0].arg for r in total.src[1:]] != [r.src[0].arg for r in ranges] or count.arg != math.prod(
        r.src[0].arg for r in ranges
    ):
        return None
    if substitute(total.src[0], dict(zip(total.src[1:], ranges))) is not value:
        return None
    return total, value


def _split_variance(total: UOp, chunks: Chunks, ctx: LoweringContext, partials: list) -> tuple[UOp, UOp]:
    """var's sum and sum of squared deviations in one pass over the data (Note: split
    reductions): per chunk its sum and the squared deviations from the chunk's own mean (a
    second pass over values the program holds), combined as Chan et al. do:
    M2 = sum_s M2_s + sum_s n_s (mean_s - mean)^2. Returns the REDUCEs for (sum, M2)."""
    chunk_sum = _chunk_reduce(total, chunks, ctx)
    sums = _partials_of(chunk_sum, chunks, ctx, partials)
    chunk_mean = chunk_sum.alu(Ops.FDIV, _chunk_length(chunks, axis(0), total.dtype))
    chunk_m2 = _chunk_reduce(total, chunks, ctx, then=lambda v: _square(v - chunk_mean))
    deviations = _partials_of(chunk_m2, chunks, ctx, partials)
    overall = _reduce_partials(total, sums, chunks, ctx)
    mean = overall.alu(Ops.FDIV, UOp.const(total.dtype, chunks.extent))
    part = ctx.reduce_range(chunks.count)
    length = _chunk_length(chunks, part, total.dtype)
    spread = length * _square(_read_partial(sums, part, chunks).alu(Ops.FDIV, length) - mean)
    between = UOp(Ops.REDUCE, total.dtype, (spread, part), Ops.ADD)
    return overall, _reduce_partials(total, deviations, chunks, ctx) + between


def _chunk_length(chunks: Chunks, chunk: UOp, dtype: DType) -> UOp:
    """How many positions chunk `chunk` holds (the last one may be short)."""
    full = UOp.const(dtype, chunks.length)
    last = chunks.extent - (chunks.count - 1) * chunks.length
    if last == chunks.length:
        return full
    return chunk.alu(Ops.CMPLT, UOp.const(dtypes.index, chunks.count - 1)).where(full, UOp.const(dtype, last))


def _square(x: UOp) -> UOp:
    return x * x
