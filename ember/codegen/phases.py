"""Stage `codegen`, step 2: the kernel AST through named rewrite phases.

    early     simplify index math (symbolic rules); float16/bfloat16 math in float32;
              identical reductions collapse (codegen/shared_loops.py)
    optimize  choose loop order from the store's strides; tile transposed reads (codegen/tiling.py)
    lower     REDUCE -> accumulator declared outside its loops, updated inside, read after
              (an array of lane accumulators for column reductions: codegen/lanes.py);
              independent accumulators of one scope share a loop (Note: shared reduce loops)
    blocks    (block backends) x loops -> one masked x index, REDUCE/SCAN -> block reductions,
              block scans and block accumulators (Note: block lowering, codegen/block_lowering.py)

Each phase is a PatternMatcher (or a small function over the whole AST when it needs a
global view, like loop order), run as a named `Step` whose result meets a stage of the IR spec
(uop/spec.py). A backend's steps are the shared early and late ones around its own: loop
lowering for C++ (`full_rewrite`), none for Triton's blocks (`block_rewrite`), whose block plan
(codegen/blocks.py) is then carried out per variant by `block_lowering`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from ember.codegen.block_lowering import lower_blocks
from ember.codegen.blocks import BlockPlan
from ember.codegen.float_sums import AVX512_LANES, float_partial_sums
from ember.codegen.lanes import MAX_LANES, innermost_loop, lane_copy, lane_range
from ember.codegen.low_precision import pm_low_precision
from ember.codegen.primitives import primitive_ops
from ember.codegen.shared_loops import merge_identical_reductions, share_reduce_loops
from ember.codegen.tiling import tile_loops
from ember.uop.dtypes import dtypes
from ember.uop.ops import (
    AccArg,
    CheckArg,
    Ops,
    RangeArg,
    RangeKind,
    ScatterArg,
    UOp,
    normalize_const,
    reduce_identity,
    substitute,
)
from ember.uop.pattern import PatternMatcher, UPat, graph_rewrite, rewrite_each_once
from ember.uop.spec import Stage, verify
from ember.uop.symbolic import linear_terms, pm_recombine, pm_symbolic
from ember.uop.symbolic_division import factors
from ember.uop.variables import UNBOUNDED, estimate


@dataclass(frozen=True)
class Step:
    """One named codegen step and the stage of the IR spec its result meets (uop/spec.py)."""

    name: str
    run: Callable[[UOp], UOp]
    stage: Stage


def run_steps(sink: UOp, steps: list[Step], check: bool = False) -> UOp:
    """`sink` through `steps`; with `check`, the spec is verified before the first and after
    each, so a bad rewrite fails at the step that made it (STYLE 16)."""
    if check:
        verify(sink, Stage.AST, "build_kernel_ast")
    for step in steps:
        sink = step.run(sink)
        if check:
            verify(sink, step.stage, step.name)
    return sink


def early_steps() -> list[Step]:
    """Every backend's first steps: the kernel AST simplified, 16-bit float math in float32
    (Note: low-precision floats), every REDUCE over ranges of its own, loops in store order."""
    return [
        Step("low_precision", lambda s: graph_rewrite(s, pm_low_precision), Stage.EARLY),
        Step("symbolic", lambda s: graph_rewrite(s, pm_symbolic), Stage.EARLY),
        Step("merge_identical_reductions", merge_identical_reductions, Stage.EARLY),
        Step("unique_reduce_ranges", lambda s: graph_rewrite(s, pm_unique_reduce_ranges, ctx={}), Stage.EARLY),
        Step("order_loops", order_loops, Stage.EARLY),
    ]


def loop_steps(max_lanes: int = MAX_LANES, float_lanes: int = AVX512_LANES) -> list[Step]:
    """A loop backend's steps (C++): 2-D tiles, REDUCE and SCAN to accumulators (lane accumulators
    up to `max_lanes`; 0: scalar ones only), independent accumulators sharing loops."""
    return [
        Step("tile_loops", tile_loops, Stage.EARLY),  # Note: 2-D tiles
        # Note: float32 sums in blocks
        Step("float_partial_sums", lambda s: float_partial_sums(s, max_lanes, float_lanes), Stage.EARLY),
        Step("lower_reduce", lambda s: lower_reductions(s, max_lanes), Stage.LOWERED),
        Step("share_reduce_loops", share_reduce_loops, Stage.LOWERED),
    ]


def late_steps(stage: Stage, native_bfloat16: bool = False) -> list[Step]:
    """Every backend's last steps: integer division checked, what earlier steps exposed folded,
    casts, integer division and shifts in primitive ops, ranges numbered for reading."""
    return [
        Step("check_integer_division", check_integer_division, stage),
        Step("symbolic_and_checks", lambda s: graph_rewrite(s, pm_symbolic + pm_checks), stage),
        Step("primitive_ops", lambda s: primitive_ops(s, native_bfloat16), stage),  # Note: semantics written once
        Step("number_ranges", number_ranges, stage),
    ]


def full_rewrite(sink: UOp, max_lanes: int = MAX_LANES, check: bool = False, float_lanes: int = AVX512_LANES) -> UOp:
    """The C++ backend's steps: a kernel AST -> the lowered AST the linearizer takes. `float_lanes`:
    the float32 lanes of the host's vectors (Note: float32 sums in blocks)."""
    steps = early_steps() + loop_steps(max_lanes, float_lanes) + late_steps(Stage.LOWERED)
    return run_steps(sink, steps, check)


def block_rewrite(sink: UOp, check: bool = False, native_bfloat16: bool = False) -> UOp:
    """The Triton backend's steps: REDUCE and SCAN stay, reductions over a block axis.
    `native_bfloat16`: on a GPU, float32 <-> bfloat16 stay conversions (Note: semantics written once)."""
    return run_steps(sink, early_steps() + late_steps(Stage.EARLY, native_bfloat16), check)


def block_lowering(sink: UOp, plan: BlockPlan, variant: str, check: bool = False) -> UOp:
    """A block backend's last step, once per variant of its plan: the block_rewrite result as
    block UOps, the linearizer's input (Note: block lowering, codegen/block_lowering.py)."""
    # the flattened block index split into the plan's dims and rejoined ((x//k)*k + x%k) is x again
    lowered = graph_rewrite(lower_blocks(sink, plan, variant), pm_recombine)
    return verify(lowered, Stage.BLOCKED, "lower_blocks") if check else lowered


def lower_reductions(sink: UOp, max_lanes: int) -> UOp:
    lowering = ReduceLowering(itertools.count(), innermost_loop(sink), max_lanes)
    return graph_rewrite(sink, pm_lower_reduce, ctx=lowering)


def number_ranges(sink: UOp) -> UOp:
    """Ranges renumbered 0, 1, ... in nesting order within each nesting rank, kinds kept: readable
    names (r0, red1, lane0), and kernels that differ only in lowering's counters get one source."""
    ranges = [u for u in sink.toposort if u.op is Ops.RANGE]
    ranks: dict[int, list[UOp]] = {}
    for r in sorted(ranges, key=lambda r: r.arg.nesting):
        ranks.setdefault(r.arg.nesting[0], []).append(r)
    order = {r: i for group in ranks.values() for i, r in enumerate(group)}
    mapping: dict[UOp, UOp] = {}
    for r in ranges:  # sources first: an element loop after its tile loop
        arg = RangeArg(r.arg.kind, order[r], tile=r.arg.tile)
        mapping[r] = UOp(Ops.RANGE, r.dtype, tuple(mapping.get(s, s) for s in r.src), arg)
    return substitute(sink, mapping)


def check_integer_division(sink: UOp) -> UOp:
    """Integer division by zero raises in eager: each integer IDIV/MOD whose divisor may be
    zero reports it, as eager does: RuntimeError("ZeroDivisionError") (Note: kernel errors,
    renderer/cpp.py)."""
    error = CheckArg("RuntimeError", "ZeroDivisionError: integer division by zero")

    def checked(u: UOp) -> UOp:
        if u.op not in (Ops.IDIV, Ops.MOD) or not u.dtype.is_int or u.dtype is dtypes.index:
            return u
        if u.src[1].vmin > 0 or u.src[1].vmax < 0:
            return u
        return UOp(Ops.CHECK, u.dtype, (u, u.src[1].alu(Ops.CMPNE, u.src[1].const_like(0)), u.src[1]), error)

    # once each, sources first: a division whose only user is another division keeps its CHECK
    return rewrite_each_once(sink, checked)


pm_checks = PatternMatcher(
    [
        (UPat(Ops.CHECK, src=(UPat.var("x"), UPat.const(True), UPat())), lambda x: x),  # CHECK(x, True, r) -> x
    ]
)


# ---- early: every REDUCE owns its ranges ------------------------------------------------


def give_fresh_ranges(ctx: dict[UOp, UOp], red: UOp) -> UOp | None:
    """The linearizer places a reduce range by the one REDUCE it belongs to. A reduction
    read at two positions in one kernel is two REDUCEs over the same ranges: copy them."""
    ranges = red.src[1:]
    if all(ctx.setdefault(r, red) is red for r in ranges):
        return None
    fresh = {r: UOp(Ops.RANGE, r.dtype, r.src, replace(r.arg, copy=len(ctx) + 1)) for r in ranges}
    return UOp(Ops.REDUCE, red.dtype, (substitute(red.src[0], fresh), *fresh.values()), red.arg)


pm_unique_reduce_ranges = PatternMatcher(
    [
        (UPat(Ops.REDUCE, name="red"), give_fresh_ranges),  # REDUCE over claimed ranges -> REDUCE over copies
    ]
)


# ---- optimize: loop order --------------------------------------------------------------


def order_loops(sink: UOp) -> UOp:
    """Renumber loop ranges so the one with the largest store stride is outermost, as a
    row-major walk of each output keeps both the writes and most reads sequential."""
    loops = [u for u in sink.toposort if u.op is Ops.RANGE and not u.arg.reduce]
    if len(loops) < 2 or not _loops_may_move(sink.toposort, set(loops)):
        return sink
    # symbolic strides are ranked at small sizes first, then at large ones: (s + 3)//4 * 32 ties
    # with a static 32 where s is 2, and is larger for every image bigger than that
    sizes = (SMALL_SIZE, LARGE_SIZE) if any(u.op is Ops.DEFINE_VAR for u in sink.toposort) else (SMALL_SIZE,)
    stride = {r: [0, 0] for r in loops}
    for store in (s for s in sink.src if s.op is Ops.STORE):
        for i, at in enumerate(sizes):
            for r, coefficient in _coefficients(store.src[0].src[1], at).items():
                if r in stride:
                    stride[r][i] = max(stride[r][i], abs(coefficient))
    order = sorted(loops, key=lambda r: (-stride[r][0], -stride[r][1], r.arg.nesting))
    if order == sorted(loops, key=lambda r: r.arg.nesting):
        return sink
    renumbered = {r: UOp(Ops.RANGE, r.dtype, r.src, RangeArg(RangeKind.LOOP, i)) for i, r in enumerate(order)}
    return substitute(sink, renumbered)


SMALL_SIZE, LARGE_SIZE = 2, 1024  # where symbolic strides are estimated (Note: symbolic sizes)


def symbolic_stride(term: UOp, at: int = SMALL_SIZE) -> tuple[UOp, int] | None:
    """(r, an estimate of its stride) for a term r * (size expressions and constants): each
    variable counted at its lower bound, and at least `at`, so a stride with more variables
    ranks larger, as it is for any sizes above 1 (Note: symbolic sizes)."""
    constant, found = factors(term)
    loops = [u for u in found if u.op is Ops.RANGE]
    if len(loops) != 1 or found[loops[0]] != 1:
        return None
    stride = constant
    for u, n in found.items():
        if u is loops[0]:
            continue
        value = estimate(u, at) if not any(v.op is Ops.RANGE for v in u.toposort) else UNBOUNDED
        if value >= UNBOUNDED:  # another loop in the factor, or an expression that does not fold
            return None
        stride *= value**n
    return loops[0], stride


def _loops_may_move(uops: Iterable[UOp], loops: set[UOp]) -> bool:
    """Reductions stay hoisted only while their loops stay outermost (a row's maximum computed
    once per row), so a kernel with a reduction keeps its order, unless every reduction varies
    with every loop (a pooling window per output element: nothing hoisted, and walking NHWC
    activations channels innermost gives the reduction one accumulator per lane, Note: lane
    accumulators). Scans and scatters chose their order."""
    for u in uops:
        if u.op is Ops.SCAN or isinstance(u.arg, ScatterArg):
            return False
        if u.op is Ops.REDUCE and not loops <= u.ranges:
            return False
    return True


def _coefficients(index: UOp, at: int = SMALL_SIZE) -> dict[UOp, int]:
    """Multiplier of each RANGE in a sum of products (ranges elsewhere count as 1); a symbolic one
    estimated with its size variables at `at` or more."""
    found: dict[UOp, int] = {}
    terms, _ = linear_terms(index)
    for term, k in terms:
        if term.op is Ops.RANGE:
            found[term] = found.get(term, 0) + k
        elif (symbolic := symbolic_stride(term, at)) is not None:  # r * s0 * 128 (Note: symbolic sizes)
            found[symbolic[0]] = found.get(symbolic[0], 0) + k * symbolic[1]
        else:
            for r in term.ranges:
                found.setdefault(r, 1)
    return found


# ---- lower: reductions to accumulators ----------------------------------------------


@dataclass(frozen=True)
class ReduceLowering:
    ids: itertools.count  # accumulator ids
    innermost_loop: UOp | None
    max_lanes: int


def lower_reduce(ctx: ReduceLowering, red: UOp) -> UOp:
    """REDUCE(value, *ranges) -> ACC_READ(acc, ACC_UPDATE(acc, value, *ranges)), where the
    accumulator is declared in the scope of the result (so it restarts for each output).
    A column reduction keeps one accumulator per lane of the innermost loop instead
    (Note: lane accumulators, codegen/lanes.py)."""
    value, reduce_ranges = red.src[0], red.src[1:]
    identity = normalize_const(red.dtype, reduce_identity(red.arg, red.dtype))
    acc_id = next(ctx.ids)
    lane = lane_range(red, ctx.innermost_loop, ctx.max_lanes)
    outer = tuple(sorted(red.ranges - {lane}, key=lambda r: r.arg.nesting))
    if lane is None:
        acc = UOp(Ops.DEFINE_ACC, red.dtype, outer, AccArg(red.arg, identity, acc_id))
        return UOp(Ops.ACC_READ, red.dtype, (acc, UOp(Ops.ACC_UPDATE, red.dtype, (acc, value, *reduce_ranges))))
    copy = lane_copy(lane, acc_id)
    acc = UOp(Ops.DEFINE_ACC, red.dtype, outer, AccArg(red.arg, identity, acc_id, lane.src[0].arg))
    update = UOp(Ops.ACC_UPDATE, red.dtype, (acc, substitute(value, {lane: copy}), *reduce_ranges, copy))
    return UOp(Ops.ACC_READ, red.dtype, (acc, update, lane))


def lower_scan(ctx: ReduceLowering, scan: UOp) -> UOp:
    """SCAN(value, r, *other ranges) -> ACC_RUNNING(acc, ACC_UPDATE(acc, value, r)): the
    accumulator is declared inside the other ranges' loops and outside the scan loop r, and read
    inside it after each update (Note: scans, lower/scans.py). Scans over one range share its loop."""
    value, scan_range = scan.src[:2]
    if scan_range.op is not Ops.RANGE:  # a scanned dim of size 1
        return value
    arg = AccArg(scan.arg, normalize_const(scan.dtype, reduce_identity(scan.arg, scan.dtype)), next(ctx.ids))
    outer = tuple(sorted(scan.ranges - {scan_range}, key=lambda r: r.arg.nesting))
    acc = UOp(Ops.DEFINE_ACC, scan.dtype, outer, arg)
    return UOp(Ops.ACC_RUNNING, scan.dtype, (acc, UOp(Ops.ACC_UPDATE, scan.dtype, (acc, value, scan_range))))


pm_lower_reduce = PatternMatcher(
    [
        (UPat(Ops.REDUCE, name="red"), lower_reduce),  # REDUCE -> DEFINE_ACC + ACC_UPDATE + ACC_READ
        (UPat(Ops.SCAN, name="scan"), lower_scan),  # SCAN -> DEFINE_ACC + ACC_UPDATE + ACC_RUNNING
    ]
)
