"""Stage `codegen` (block backends): a kernel's scheduling decisions on blocks, made from the
kernel AST after `phases.block_rewrite` and the limits the backend declares.

It takes the sink and the backend's `BlockLimits` (compile_triton.TritonBackend's capabilities)
and gives a `BlockPlan`: which loops go on the x axis and which on the r axis (`KernelShape`,
Note: blocks for a kernel AST), which variants to render (pointwise, or persistent and looped),
and the width of index math. Block lowering (codegen/block_lowering.py) carries the plan out in
UOps; the launcher (runtime/triton.py) times block sizes within it.

Note: blocks for a kernel AST
    The loop ranges a REDUCE varies with are the *outer* ranges; flattened, they index the
    x axis: program `pid` owns x positions pid*XBLOCK + arange(XBLOCK). A kernel with no
    REDUCE is all outer ranges (pointwise: blocks of shape [XBLOCK]), or its innermost range is
    the final phase described next (Note: pointwise kernels in rows). Otherwise blocks are
    [XBLOCK, RBLOCK]: each REDUCE is one *phase* over its own reduce ranges, flattened onto
    the r axis and reduced to [XBLOCK, 1]; then the stores that vary with the remaining
    loop ranges (the *inner* ranges: softmax's normalizing pass over the row) are one more
    phase over those. A value is computed in the scope of the ranges it varies with: outer
    values once per program, phase values inside their phase. The *persistent* variant
    takes a whole row in one block (RBLOCK >= every phase's extent), so the phases share
    one r position and identical loads in two phases are one load (one UOp); the *looped*
    variant walks each phase in RBLOCK steps, with a block accumulator per REDUCE. The
    launcher (runtime/triton.py) times both.

Note: nested reductions
    A REDUCE whose source holds another REDUCE that varies with its reduce ranges (the mean
    over rows of each row's logsumexp: cross-entropy; multilabel_margin_loss) cannot be one
    block phase: the inner one needs the r axis for its own elements. The enclosing REDUCE is
    *sequential* instead: a `for` loop over its elements with a [XBLOCK, 1] accumulator, and
    the reductions inside run as ordinary phases in each iteration (persistent or looped), so
    nesting goes as deep as the AST does. A sequential REDUCE that varies with no loop (a
    loss: one number) is *chunked*: XBLOCK elements per iteration on the x lanes (nothing in it
    varies with x, so the lanes are free; masked by the loop's own bound instead of xmask),
    reduced over x at the end; the launcher sizes XBLOCK by that extent (`xextent`), the grid
    by xnumel. When the kernel also has an x axis (cross-entropy's loss fused with per-row
    outputs), every program computes the loss (redundant work, no extra kernel). A sequential
    REDUCE that varies with other loops walks one element (a scalar) per iteration. Phases
    form a chain: a value is computed in the innermost phase whose ranges it varies with, so
    per-row values are computed once per row, row-invariant ones once.

Note: symbolic blocks
    In a graph with symbolic sizes (Note: symbolic sizes, uop/variables.py) a loop's size is an
    expression of size variables, so are the x extent, a phase's extent and the decomposition
    strides; block lowering uses them as UOps where it used constants, and every lane is masked
    by them as it is by a static extent. The kernel takes each variable it reads as an int64
    argument after its buffers, never specialized (renderer/triton_module.py), so one compiled
    kernel serves every shape. The launcher computes the grid at every call from the x extent's
    Python source over the variables (`BlockPlan.launch`) and keeps a launch configuration per
    size class of its calls (Note: size classes, runtime/triton_sized.py), chosen as a static
    kernel's is at the class's largest sizes. A symbolic row's kernel has both variants while
    its lower bound fits a block (`persistent_row`): the launcher takes persistent blocks for the
    classes whose rows fit one and the looped variant for longer rows, from one module.
    Index math is 32-bit where the variables' bounds keep every value within int32
    (`index_bits`); dynamo's sizes are unbounded, so for their kernels codegen finds the largest
    power of two C (`narrow_size_cap`) such that every index fits while each size is at most C,
    and the module has each variant twice: with 32-bit index math (sizes cast to int32 on
    entry) and with 64-bit (`<variant>_wide`). The launcher checks each call's sizes against C
    and takes the wide kernel past it (compiled at its first need; the pool compiles the narrow
    ones). Split reductions take static sizes only (lower/split_reductions.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, UOp


@dataclass(frozen=True)
class BlockLimits:
    """What a block backend can hold (its capabilities; codegen decides from them), and the choices
    config makes for its codegen."""

    persistent_row: int = 16384  # the longest row a persistent variant keeps in one block (registers)
    persistent_scan_row: int = 4096  # the same for a scan, which keeps more per element
    # where a looped exp sum takes its maximum from: "row", "lane" or "off" (Note: a row's exponential
    # sum in one pass, codegen/online_softmax.py; config.online_exp_sums)
    exp_sum_maximum: str = "row"
    # float32 <-> bfloat16 converted by the target itself (a GPU), not through the bits (the
    # interpreter, whose conversion truncates): Note: semantics written once, codegen/primitives.py
    native_bfloat16: bool = False
    # a pointwise kernel whose innermost loop and rows are both at least this long is planned in rows
    # (Note: pointwise kernels in rows; config.pointwise_rows); 0: never
    pointwise_rows: int = 1024


@dataclass(frozen=True)
class KernelShape:
    """Note: blocks for a kernel AST."""

    outer: tuple[UOp, ...]  # loop ranges flattened onto x, outermost first
    inner: tuple[UOp, ...]  # loop ranges of the final phase (empty for pointwise kernels)
    reduces: tuple[UOp, ...]  # REDUCEs, sources before users
    xnumel: int | UOp  # a UOp of size variables where symbolic (Note: symbolic blocks)
    rnumel: int | UOp  # the largest block phase's extent (0 for pointwise kernels)
    scans: tuple[UOp, ...] = ()  # SCANs, over the one inner range (Note: scans on blocks, triton_scan.py)
    sequential: frozenset[UOp] = frozenset()  # REDUCEs walked in a loop (Note: nested reductions)
    chunked: frozenset[UOp] = frozenset()  # sequential REDUCEs walked XBLOCK elements at a time

    @property
    def xextent(self) -> int | UOp:
        """The extent an x block covers: the x axis, or the elements a chunked loop walks."""
        return largest([self.xnumel] + [elements(red.src[1:]) for red in self.chunked])

    @property
    def pointwise(self) -> bool:
        """Blocks of shape [XBLOCK]: no reduction, no scan, and not planned in rows."""
        return not self.reduces and not self.scans and not self.inner


@dataclass(frozen=True)
class BlockPlan:
    """Everything codegen decided about one block kernel."""

    shape: KernelShape
    variants: tuple[str, ...]  # "pointwise", or "persistent" (a row in one block) and/or "looped"
    index_bits: int  # 32 or 64: the integer width of index math
    size_cap: int = 0  # 32-bit index math only while every size variable is at most this (Note: symbolic blocks)
    exp_sum_maximum: str = "row"  # BlockLimits.exp_sum_maximum
    persistent_row: int = 0  # the longest row the persistent variant may take, where the row is symbolic

    @property
    def in_rows(self) -> bool:
        """A pointwise kernel planned in rows (Note: pointwise kernels in rows)."""
        return not self.shape.reduces and not self.shape.scans and bool(self.shape.inner)

    @property
    def launch(self) -> dict:
        """The facts the launcher (runtime/triton.py) sizes blocks and the grid by: each extent at
        its upper bound, and where the x extent is symbolic, its Python source over the size
        variables, from which the launcher computes each call's grid (Note: symbolic blocks)."""
        xnumel, xextent = self.shape.xnumel, self.shape.xextent
        facts = {"variants": list(self.variants), "xnumel": bound(xnumel), "rnumel": bound(self.shape.rnumel)}
        if xextent is not xnumel and bound(xextent) > bound(xnumel):  # Note: nested reductions
            facts["xextent"] = bound(xextent)
        from ember.uop.variables import python_source

        if isinstance(xnumel, UOp):
            facts["grid_numel"] = python_source(xnumel)
        if isinstance(xextent, UOp) and xextent is not xnumel:
            facts["xextent_source"] = python_source(xextent)
        if isinstance(self.shape.rnumel, UOp):  # Note: size classes, runtime/triton_sized.py
            facts |= {"rnumel_source": python_source(self.shape.rnumel), "persistent_row": self.persistent_row}
        if self.size_cap:
            facts["size_cap"] = self.size_cap
        return facts


def plan_blocks(sink: UOp, limits: BlockLimits, rows: bool = True) -> BlockPlan:
    """`rows`: a pointwise kernel may be planned in rows (not a horizontal kernel's part)."""
    scan = any(u.op is Ops.SCAN for u in sink.toposort)
    shape = scan_kernel_shape(sink) if scan else kernel_shape(sink)
    if rows and shape.pointwise and in_rows(sink, shape, limits.pointwise_rows):
        shape = replace(shape, outer=shape.outer[:-1], inner=shape.outer[-1:], xnumel=elements(shape.outer[:-1]),
                        rnumel=elements(shape.outer[-1:]))  # fmt: skip
    if shape.pointwise:
        variants: tuple[str, ...] = ("pointwise",)
    else:  # a symbolic row: persistent for the calls whose row fits a block (Note: symbolic blocks)
        longest = limits.persistent_scan_row if scan else limits.persistent_row
        variants = (("persistent",) if lowest(shape.rnumel) <= longest else ()) + ("looped",)
    bits = index_bits(sink, shape, limits)
    cap = narrow_size_cap(sink, shape, limits) if bits == 64 else 0
    row = longest if "persistent" in variants and isinstance(shape.rnumel, UOp) else 0
    return BlockPlan(shape, variants, 32 if cap else bits, cap, limits.exp_sum_maximum, row)


def kernel_shape(sink: UOp) -> KernelShape:
    loops = sorted((u for u in sink.toposort if u.op is Ops.RANGE and not u.arg.reduce), key=lambda r: r.arg.nesting)
    reduces = tuple(u for u in sink.toposort if u.op is Ops.REDUCE)
    if not reduces:
        return KernelShape(tuple(loops), (), (), elements(loops), 0)
    outer_set = frozenset().union(*(r.ranges for r in reduces))
    nested_ranges = frozenset(r for r in outer_set if r.arg.reduce)  # e.g. the mean over rows of a row's logsumexp
    sequential = frozenset(red for red in reduces if nested_ranges & set(red.src[1:]))
    outer = tuple(r for r in loops if r in outer_set)
    inner = tuple(r for r in loops if r not in outer_set)
    blocked = [elements(red.src[1:]) for red in reduces if red not in sequential]
    extents = blocked + ([elements(inner)] if inner else [])
    # a sequential REDUCE that varies with nothing (a loss) uses the x lanes for its own elements
    chunked = frozenset(red for red in sequential if not red.ranges)
    return KernelShape(outer, inner, reduces, elements(outer), largest(extents or [1]), sequential=sequential,
                       chunked=chunked)  # fmt: skip


# Note: pointwise kernels in rows
#   A pointwise kernel's x axis is its loops flattened, and each loop's value is decomposed from the
#   flat position ((x // stride) % size). A read that varies with some loops only needs that
#   decomposition per element: cross-entropy's gradient over (8192, 32000) bfloat16 logits divides
#   every position by 32000 to find its row, and loads the row's logsumexp, scale and target per
#   element (0.271 ms on an H100, inductor's 0.211). When the innermost loop is long (at least
#   `BlockLimits.pointwise_rows`, 1024), not a power of two (a shift and a mask cost nothing), its
#   rows are as many (enough programs to fill a GPU), and some read is such a broadcast (a per-row
#   or per-column value), the kernel is planned in rows: the outer loops on x, the innermost on r
#   as the final phase of a reduction kernel with no reduction (Note: blocks for a kernel AST), so a
#   row's values are computed once per program and a column's position is the r position itself.
#   Persistent (a row in one block, rows up to `persistent_row`) and looped (RBLOCK columns at a
#   time) variants, timed by the launcher. Symbolic sizes keep the flat plan.
def in_rows(sink: UOp, shape: KernelShape, least: int) -> bool:
    """Note: pointwise kernels in rows."""
    if least <= 0 or len(shape.outer) < 2:
        return False
    columns, rows = elements(shape.outer[-1:]), elements(shape.outer[:-1])
    if not isinstance(columns, int) or not isinstance(rows, int) or columns < least or rows < least:
        return False
    if columns & (columns - 1) == 0:
        return False
    loops = frozenset(shape.outer)
    return any(u.op is Ops.LOAD and u.src[0].src[1].ranges and u.src[0].src[1].ranges != loops for u in sink.toposort)


def scan_kernel_shape(sink: UOp) -> KernelShape:
    """Loop ranges on x, the one scanned range on r (Note: scans on blocks, renderer/triton_scan.py)."""
    scans = tuple(u for u in sink.toposort if u.op is Ops.SCAN)
    scanned = {s.src[1] for s in scans}
    if len(scanned) != 1 or next(iter(scanned)).op is not Ops.RANGE:
        raise NotImplementedError("Triton renderer: a scan kernel scans over exactly one range")
    if any(u.op is Ops.REDUCE for u in sink.toposort):
        raise NotImplementedError("Triton renderer: a reduction inside a scan kernel (not yet)")
    scan_range = next(iter(scanned))
    ranges = [u for u in sink.toposort if u.op is Ops.RANGE]
    if any(r.arg.reduce and r is not scan_range for r in ranges):
        raise NotImplementedError("Triton renderer: a reduce range besides the scanned one in a scan kernel")
    loops = tuple(sorted((r for r in ranges if not r.arg.reduce), key=lambda r: r.arg.nesting))
    return KernelShape(loops, (scan_range,), (), elements(loops), elements((scan_range,)), scans)


def elements(ranges) -> int | UOp:
    """How many positions `ranges` walk together: an int, or a UOp of size variables where a
    range's size is symbolic (Note: symbolic blocks)."""
    sizes = [r.src[0] for r in ranges]
    if all(s.op is Ops.CONST for s in sizes):
        return math.prod(s.arg for s in sizes)
    from ember.uop.symbolic import simplify

    return simplify(functools.reduce(lambda a, b: a * b, sizes))


def largest(extents: list[int | UOp]) -> int | UOp:
    """The largest of `extents`: an int when all are, else their MAX as a size expression."""
    if all(isinstance(e, int) for e in extents):
        return max(extents)  # type: ignore[type-var]
    from ember.uop.symbolic import simplify

    as_uops = [e if isinstance(e, UOp) else UOp.const(dtypes.index, e) for e in extents]
    return simplify(functools.reduce(lambda a, b: a.alu(Ops.MAX, b), as_uops))


def bound(extent: int | UOp) -> int:
    """An extent's value, or a symbolic one's upper bound (what the launcher sizes blocks by)."""
    return extent if isinstance(extent, int) else int(extent.vmax)


def lowest(extent: int | UOp) -> int:
    """An extent's value, or a symbolic one's lower bound."""
    return extent if isinstance(extent, int) else int(extent.vmin)


def index_bits(sink: UOp, shape: KernelShape, limits: BlockLimits) -> int:
    """32-bit index math when every index value and the padded block positions fit."""
    return 32 if index_fits(sink, (shape.xnumel, shape.rnumel), limits) else 64


def index_fits(sink: UOp, extents: tuple[int | UOp, ...], limits: BlockLimits) -> bool:
    """Every index value computed from the kernel's positions (program ids, ranges, sizes) fits
    int32. Values computed from data (Note: data-derived indexes) are not asked."""
    limit = 2**31 - 1 - 2 * limits.persistent_row
    if any(bound(extent) * 2 >= limit for extent in extents):
        return False
    data = data_derived(sink)
    return not any(u.dtype is dtypes.index and u not in data and (u.vmin < -limit or u.vmax > limit)
                   for u in sink.toposort)  # fmt: skip


# Note: data-derived indexes
#   A gather's position is loaded data (a token id, a target class): cast to an index, clamped
#   into range and checked (Note: kernel errors), it may hold any int64 before the clamp. The
#   Triton renderer casts every value to the index type as int64 (renderer/triton.py), and
#   Triton's promotion keeps whatever is computed from an int64 in int64, so such values never
#   narrow, whatever the kernel's index width; only the values computed from program ids, ranges
#   and sizes alone are int32 in a 32-bit kernel, and only they must fit. Asking the unclamped
#   position too made every gathering kernel (embeddings, cross-entropy, scatter as a select)
#   index in 64 bits, which costs a GPU several instructions per multiply and many per division.
def data_derived(sink: UOp) -> set[UOp]:
    """The UOps of `sink` computed from a load or from a cast of a non-index value to an index."""
    data: set[UOp] = set()
    for u in sink.toposort:
        if u.op is Ops.LOAD or (u.op is Ops.CAST and u.dtype is dtypes.index and u.src[0].dtype is not dtypes.index):
            data.add(u)
        elif any(s in data for s in u.src):
            data.add(u)
    return data


def narrow_size_cap(sink: UOp, shape: KernelShape, limits: BlockLimits) -> int:
    """The largest power of two C such that, with every size variable at most C, every index value
    still fits int32 (0: none does, or the kernel has no size variable). Bounds are intervals, so
    what holds with each variable anywhere in [its minimum, C] holds at any call whose sizes are
    at most C: the launcher takes the kernel with 32-bit index math for those calls and one with
    64-bit for the others (Note: symbolic blocks)."""
    variables = {u for u in sink.toposort if u.op is Ops.DEFINE_VAR}
    if not variables:
        return 0
    from ember.uop.ops import substitute
    from ember.uop.variables import variable

    extents = (shape.xnumel, shape.xextent, shape.rnumel)  # (block lowering's masks and loops compare with them)
    root = UOp(Ops.SINK, dtypes.void, (sink, *(e for e in extents if isinstance(e, UOp))))

    def fits(cap: int) -> bool:
        capped = {v: variable(v.arg.name, v.arg.vmin, min(v.arg.vmax, cap)) for v in variables}
        kernel, *capped_extents = substitute(root, capped).src
        return index_fits(kernel, tuple(capped_extents), limits)

    low, high = max(1, (max(v.arg.vmin for v in variables) - 1).bit_length()), 31  # exponents of caps
    if low > high or not fits(2**low):
        return 0
    while low < high:  # the largest exponent that fits
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(2**middle) else (low, middle - 1)
    return 2**low
