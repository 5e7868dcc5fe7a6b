"""Stage `codegen`, part of the C++ backend's `lower` phase: float32 sums added in float32 blocks.

Takes the kernel AST after the early steps (REDUCEs still whole) and gives it with every float32
sum that lowering accumulates in double (lower/reductions.py `accumulator`) summed in two levels.

Note: float32 sums in blocks
    A float32 sum accumulates in double so that a long sum stays exact enough (eager's CPU
    kernels sum in float32, in a cascade). Converted element by element, each element costs a
    float -> double conversion and a double add, at half the lanes of a float32 vector: x.sum()
    of 16M floats took 2.70 ms of one core (eager's: 2.42), summed as below 2.45. So the sum is
    taken in two levels: float32 partial sums over blocks of at most BLOCK elements (the
    vectorized loop keeps one partial sum per lane, each adding BLOCK / lanes elements in order),
    each block's sum converted once and added in double (BLOCK and ROW_BLOCK: `block_lengths`):

        REDUCE_f64(CAST_f64(x), r)                ->  CAST_f64(REDUCE_f32(x, r))     r <= BLOCK
      and for a sum of a whole tensor (no loop around it, as each part of x.sum()):
        REDUCE_f64(CAST_f64(x), *outer, r)        ->  REDUCE_f64(CAST_f64(REDUCE_f32(x, r)), *outer)
        REDUCE_f64(CAST_f64(x), *outer, r)        ->  REDUCE_f64(CAST_f64(REDUCE_f32(x[o*b+i], i)), *outer, o)
                                                      (r longer than BLOCK: b a divisor of its extent)

    A row (a sum per output: layer norm's, softmax's) is one block up to ROW_BLOCK elements, and
    longer rows stay in double: in blocks, their loops could no longer be shared with the row's
    other statistics (amax, a count: Note: shared reduce loops), which would read the row twice.
    The bias that identical blocks add up (0.1 summed 4M times) bounds the whole-tensor BLOCK
    (256 elements with AVX-512; below).

    A whole tensor's sum comes in parts (Note: a long sum in parts, lower/reductions.py): the
    parts' double sums of blocks share their block loop and their blocks' float32 sums the inner
    loop (Note: shared reduce loops), so the parts' chains of vector adds still run side by side.
    (Two or four float32 chains per block besides, each over a part of the block, made that sum
    slower than one: with blocks of 1024, 2.71 and 2.85 ms against 2.53.)

    The error of a float32 block sum grows with the elements each lane adds in order: bounded,
    whatever the length of the whole sum. So the blocks are as long as the host's float32 vectors
    have lanes (`float_lanes`: 16 with AVX-512, 8 with AVX2, 4 with SSE or NEON) times
    ELEMENTS_PER_LANE, and each lane adds the same few elements on every host: within eager's
    float32 cascade on the tests' adversarial inputs (tests/test_float_sums.py). One length for
    all hosts did not hold: blocks of 256 on an AVX2 host (32 elements a lane) summed 0.1 4M times
    with twice eager's error. A loop gcc leaves scalar adds a whole block in order.

    Reductions that keep lane accumulators (Note: lane accumulators) already add whole vectors
    per element and keep their double arrays. A sum that another reduction reads keeps its double
    too: a variance's mean must be exact for a row of equal
    values (the deviations are 0 and group norm gives the bias, as eager's Welford), which float32
    block sums of 100.3 are not. A sum whose innermost extent is short (fewer than MIN_BLOCK
    elements) or not static keeps its double accumulator.
    C++ only: Triton's reductions are blocks already.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ember.codegen.lanes import innermost_loop, lane_range
from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, RangeKind, UOp, substitute
from ember.uop.pattern import PatternMatcher, UPat, graph_rewrite

ELEMENTS_PER_LANE = 16  # in a whole tensor's block: 256 elements with AVX-512 (1024: 4x eager's error)
ROW_ELEMENTS_PER_LANE = 64  # in a row (a sum per output) summed in float32: 1024 elements with AVX-512
MIN_BLOCK = 64  # shorter inner extents: a conversion per few elements gains little
AVX512_LANES = 16


@dataclass(frozen=True)
class BlockContext:
    orders: itertools.count  # fresh reduce-range orders, past every range of the kernel
    innermost_loop: UOp | None
    max_lanes: int
    read_by_reductions: frozenset[UOp]  # REDUCEs another REDUCE's value reads: they stay in double
    block: int  # the most elements of a whole tensor's float32 partial sum
    row_block: int  # the most elements of a row summed in float32


def block_lengths(float_lanes: int) -> tuple[int, int]:
    """The most elements of a whole tensor's float32 block, and of a row's, on a host whose
    vectors hold `float_lanes` float32s."""
    return max(MIN_BLOCK, ELEMENTS_PER_LANE * float_lanes), max(MIN_BLOCK, ROW_ELEMENTS_PER_LANE * float_lanes)


def float_partial_sums(sink: UOp, max_lanes: int, float_lanes: int = AVX512_LANES) -> UOp:
    """`sink` with its float32 sums in double summed in float32 blocks (Note: float32 sums in blocks);
    `float_lanes`: the float32 lanes of the host's vectors."""
    reduce_orders = [u.arg.order for u in sink.toposort if u.op is Ops.RANGE and u.arg.reduce]
    start = max(reduce_orders, default=0) + 1
    reduces = [u for u in sink.toposort if u.op is Ops.REDUCE]
    read = frozenset(v for red in reduces for v in red.src[0].toposort if v.op is Ops.REDUCE)
    ctx = BlockContext(itertools.count(start), innermost_loop(sink), max_lanes, read, *block_lengths(float_lanes))
    return graph_rewrite(sink, pm_float_partial_sums, ctx=ctx)


def _block_sum(ctx: BlockContext, red: UOp) -> UOp | None:
    """A float32 sum in double -> float32 block sums added in double, or None to leave it."""
    value, ranges = red.src[0], red.src[1:]
    if value.op is not Ops.CAST or value.src[0].dtype is not dtypes.float32 or value.src[0].op is Ops.REDUCE:
        return None  # not a float32 sum in double, or already in blocks
    if red in ctx.read_by_reductions:
        return None  # a variance's mean: exact for a row of equal values, so their deviations are 0
    if lane_range(red, ctx.innermost_loop, ctx.max_lanes) is not None:
        return None
    extents = [n for n in (r.src[0].static_size for r in ranges) if n is not None]
    if len(extents) < len(ranges) or any(r.arg.kind is not RangeKind.REDUCE for r in ranges):
        return None
    x = value.src[0]
    if math.prod(extents) <= (ctx.row_block if red.ranges else ctx.block):  # one block: in float32, converted once
        return UOp(Ops.REDUCE, dtypes.float32, (x, *ranges), Ops.ADD).cast(dtypes.float64)
    if red.ranges:
        return None  # a long row: blocks would keep it from sharing a loop with its row's other statistics
    inner = max(ranges, key=lambda r: r.arg.nesting)
    outer = [r for r in ranges if r is not inner]
    extent = inner.src[0].static_size
    assert extent is not None
    if MIN_BLOCK <= extent <= ctx.block:  # the innermost loop is one block
        block = UOp(Ops.REDUCE, dtypes.float32, (x, inner), Ops.ADD).cast(dtypes.float64)
        return UOp(Ops.REDUCE, dtypes.float64, (block, *outer), Ops.ADD)
    size = _block_size(extent, ctx.block)
    if size is None:
        return None
    blocks = UOp.range(extent // size, next(ctx.orders), RangeKind.REDUCE)
    within = UOp.range(size, next(ctx.orders), RangeKind.REDUCE)
    element = substitute(x, {inner: blocks * size + within})
    block = UOp(Ops.REDUCE, dtypes.float32, (element, within), Ops.ADD).cast(dtypes.float64)
    return UOp(Ops.REDUCE, dtypes.float64, (block, *outer, blocks), Ops.ADD)


def _block_size(extent: int, block: int) -> int | None:
    """The largest divisor of `extent` from `block` / 4 to `block`, if any."""
    for size in range(block, block // 4 - 1, -1):
        if extent % size == 0:
            return size
    return None


pm_float_partial_sums = PatternMatcher(
    [
        # REDUCE_f64(CAST_f64(x_f32), *r, ADD) -> float32 block sums added in double
        (UPat(Ops.REDUCE, dtypes.float64, arg=Ops.ADD, name="red"), _block_sum),
    ]
)
