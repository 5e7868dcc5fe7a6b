"""Stage `codegen`, part of the `optimize` phase: 2-D tiles for transposed access.

Note: 2-D tiles
    order_loops puts the loop the output is contiguous along (`col`) innermost. A pointwise
    kernel that also reads an input contiguous (or a few elements apart: `x.t()[::2]`)
    along another loop (`row`) -- a transpose copy, `x.permute(0, 2, 1) + y`, NCHW <-> NHWC
    -- then reads that input `stride` elements apart in its innermost loop: one cache line
    (and soon one page) per element, and by the time the walk comes back for the line's next
    element it has been evicted. Tiling splits both loops into a tile loop and an element loop,
    the tile loops outside:

        for (r_t = 0; r_t < ROWS; r_t += T)               tile loops (parallel over tiles)
          for (c_t = 0; c_t < COLS; c_t += T)
            for (r = r_t; r < min(r_t + T, ROWS); r++)    element loops (partial edge tiles)
              for (c = c_t; c < min(c_t + T, COLS); c++)  contiguous stores, `omp simd`
                out[r, c] = x[c, r]

    so the T x T block of the input the element loops read stays in L1 while each of its
    lines is used T times. An element loop is a RANGE whose second source is its tile loop (a
    RANGE with `RangeArg.tile`); its variable is the full index, so index math is unchanged.
    The renderer writes the loops (renderer/tiles.py); its `KernelChoices.tile` may change
    the tile size, which changes only the order elements are visited in.

    Only kernels without reductions, scans or computed-position stores are tiled: their
    iterations are independent, so any visiting order computes the same elements.
"""

from __future__ import annotations

from ember.uop.ops import Ops, RangeArg, RangeKind, ScatterArg, UOp, substitute
from ember.uop.symbolic import linear_terms

MIN_STRIDE = 16  # a strided read this many elements apart touches a new cache line per element


def tile_loops(sink: UOp) -> UOp:
    """Tile the innermost loop and the one a strided input is contiguous along, when
    a load reads across them (Note: 2-D tiles). Expects loops ordered (order_loops)."""
    if any(u.op in (Ops.REDUCE, Ops.SCAN) or isinstance(u.arg, ScatterArg) for u in sink.toposort):
        return sink
    loops = sorted((u for u in sink.toposort if u.op is Ops.RANGE), key=lambda r: r.arg.nesting)
    choice = choose_tiled_loops(sink, loops)
    if choice is None:
        return sink
    row, col, size = choice
    others = [r for r in loops if r not in (row, col)]
    # order: the other loops, then the two tile loops, then the two element loops
    tiles = {r: UOp(Ops.RANGE, r.dtype, r.src, RangeArg(RangeKind.TILE, len(others) + i, tile=size))
             for i, r in enumerate((row, col))}  # fmt: skip
    mapping = {r: UOp(Ops.RANGE, r.dtype, r.src, RangeArg(RangeKind.LOOP, i)) for i, r in enumerate(others)}
    for i, r in enumerate((row, col)):
        mapping[r] = UOp(Ops.RANGE, r.dtype, (r.src[0], tiles[r]), RangeArg(RangeKind.LOOP, len(others) + 2 + i))
    return substitute(sink, mapping)


def choose_tiled_loops(sink: UOp, loops: list[UOp]) -> tuple[UOp, UOp, int] | None:
    """(row, col, tile size): `col` the innermost loop, contiguous in every store; `row` the
    loop some load reads fewer than MIN_STRIDE elements apart along (contiguous, or a small
    step) while it reads `col` MIN_STRIDE or more apart."""
    if len(loops) < 2:
        return None
    col = loops[-1]
    stores = [s for s in sink.src if s.op is Ops.STORE]
    if not stores or any(_coefficients(s.src[0].src[1]).get(col) != 1 for s in stores):
        return None
    size = tile_size(min(s.src[0].src[0].dtype.itemsize for s in stores))
    for load in (u for u in sink.toposort if u.op is Ops.INDEX and u.src[0].op is Ops.BUFFER):
        coefficients = _coefficients(load.src[1])
        if abs(coefficients.get(col, 0)) < MIN_STRIDE:
            continue
        row = _nearest_loop(coefficients, loops[:-1])
        if row is not None and col.src[0].vmax >= size and row.src[0].vmax >= size:  # (vmax: Note: symbolic sizes)
            return row, col, min(size, tile_size(load.dtype.itemsize))
    return None


def _nearest_loop(coefficients: dict[UOp, int], loops: list[UOp]) -> UOp | None:
    """The loop along which the load reads closest together, when that is under MIN_STRIDE
    elements apart: 1 (contiguous, a transpose) or a small step (`x.t()[::2]` reads every
    other element: a T x T tile then spans 2T elements of each input row, still a few KiB).
    Ties go to the innermost."""
    near = [r for r in loops if 0 < abs(coefficients.get(r, 0)) < MIN_STRIDE]
    return min(reversed(near), key=lambda r: abs(coefficients[r]), default=None)


def tile_size(itemsize: int) -> int:
    """Tile edge in elements: two cache lines of a row of 4-byte elements, at least 32, so a
    tile of each side (T * T * itemsize: 4 KiB of floats, 16 KiB of bools) fits in L1."""
    return max(32, 128 // max(itemsize, 1))


def is_tile_loop(r: UOp) -> bool:
    return r.op is Ops.RANGE and r.arg.kind is RangeKind.TILE


def is_element_loop(r: UOp) -> bool:
    return r.op is Ops.RANGE and len(r.src) == 2


def trip_count(r: UOp, tile: int = 0) -> int:
    """Iterations of loop `r` (an element loop's: of a full tile); `tile` overrides the size. A
    symbolic size counts as its upper bound (Note: symbolic sizes)."""
    size = int(r.src[0].vmax)
    if is_tile_loop(r):
        return -(-size // (tile or r.arg.tile))
    if is_element_loop(r):
        return min(size, tile or r.src[1].arg.tile)
    return size


def _coefficients(index: UOp) -> dict[UOp, int]:
    """Multiplier of each RANGE in an affine index (0 for ranges in non-affine terms)."""
    found: dict[UOp, int] = {}
    terms, _ = linear_terms(index)
    for term, k in terms:
        if term.op is Ops.RANGE:
            found[term] = found.get(term, 0) + k
        else:
            for r in term.ranges:
                found[r] = 0
    return found
