"""Stage `codegen`, step 1: a fused group of computed buffers -> one kernel AST.

The AST is `SINK(STORE(INDEX(out, idx), value), …)` over RANGEs shared by the group
(schedule/group.py lines the members' loops up and turns reads of members into their
values). Every buffer is renamed to a positional parameter (p0, p1, …) so identical
computations in different graphs have identical ASTs, source and cache entries.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from ember.ir import Buffer, ComputedBuffer, IndexedStore, Layout, same_sizes
from ember.metrics import metrics
from ember.schedule.group import align, resolve_bodies
from ember.uop.dtypes import dtypes
from ember.uop.ops import BufferArg, Ops, RangeKind, ScatterArg, UOp, substitute
from ember.uop.symbolic import element_form, simplify
from ember.uop.variables import size_hint


@dataclass(frozen=True)
class KernelAST:
    sink: UOp
    params: tuple[str, ...]  # wrapper buffer name of parameter i
    outputs: frozenset[str]  # the params the kernel writes
    inplace: dict[str, str] = field(default_factory=dict)  # output buffer -> dying input it overwrites

    def arguments(self, kernel_params: list[tuple[str, object, bool]]) -> tuple[str, ...]:
        """The wrapper buffers to pass to the rendered kernel, whose parameters (p0, p1, ...) are
        those its code still reads: the rewrite phases may drop a read (an index tensor of a
        stride-0 dim is multiplied by 0), and the wrapper must then skip that buffer too, or every
        later argument lands in the wrong parameter."""
        return tuple(self.params[int(name[1:])] for name, _, _ in kernel_params)


def build_kernel_ast(
    group: list[ComputedBuffer | IndexedStore],
    stored: set[str] | None = None,
    dying: dict[str, Buffer] | None = None,
    alignment: tuple | None = None,
    bodies: dict[str, UOp] | None = None,
) -> KernelAST:
    """Stores every member in `stored` (default: all); the others live only in registers.
    An output may be written over one of the `dying` inputs (Note: in-place kernels); a
    store at computed positions mutates a buffer that exists already, and never does.
    `alignment` and `bodies`: the scheduler's, for a fused group (computed here otherwise)."""
    if len(group) == 1 and isinstance(group[0], IndexedStore):
        return _rename_buffers(indexed_store_sink(group[0]), frozenset({group[0].name}))
    stored = {c.name for c in group} if stored is None else stored
    sink = group_sink(group, stored, alignment, bodies)  # type: ignore[arg-type]
    if isinstance(sink, str):
        raise ValueError(sink)
    inplace = choose_inplace(sink, {c.name: c.buffer for c in group}, dying or {})
    if inplace:
        outs = {c.name: c.buffer for c in group}
        sink = substitute(sink, {dying[v].uop(): outs[o].uop() for o, v in inplace.items()})  # type: ignore[index]
    ast = _rename_buffers(sink, frozenset(stored))
    return KernelAST(ast.sink, ast.params, ast.outputs, inplace)


def choose_inplace(sink: UOp, members: dict[str, Buffer], dying: dict[str, Buffer]) -> dict[str, str]:
    """Note: in-place kernels
    A kernel output may take over the storage of an input that dies with this kernel (seed
    003's decide_inplace_update; a donated input of a backward at its last use, Note: donated
    inputs, donation.py) when no element of the input is read after the kernel stored over it:
      - a read at the very index the output is stored at, made by the output's own value: the
        same iteration (program) reads the element and then stores it; the load is one
        hash-consed UOp emitted before the store;
      - a read inside reductions, in the stored element's row: the read index with its reduce
        ranges replaced by loop ranges of the store (the row's *element* loops) is the store's
        index, so the element it reads is stored by an iteration of the same row. Each row is
        then read whole before any of it is stored, when no reduction varies with an element
        loop and every loop a reduction varies with is outside them: C++ computes a row's
        reductions (hoisted out of the element loops, phases.py `_loops_may_move` keeps that
        order; a reduction split over threads ends at its barrier) before the element loop
        stores; a Triton program owns whole rows on its x axis and runs every reduction phase
        (persistent, looped, online softmax's one pass) before the store phase (Note: blocks
        for a kernel AST, codegen/blocks.py). Nested reductions, whose rows a program walks in
        sequential pieces, and scans are refused.
    No other store of the kernel may read the input (it could run after the overwrite: relu(y)
    and y * 2 in one kernel). The input's buffer is renamed to the output's, so the kernel sees
    one `__restrict__` pointer, never two aliasing ones. An aten result that may be a view of
    its arguments (as_strided of a graph input) is never among the dying inputs: its storage is
    another tensor's (LoweredGraph.aliasing_outputs). Each refusal of a candidate is counted by
    its reason (`ember.metrics.inplace_refusals`)."""
    if not dying or any(u.op is Ops.SCAN for u in sink.toposort):
        return {}
    reads: dict[str, list[UOp]] = {}
    for u in sink.toposort:
        if u.op is Ops.INDEX and u.src[0].op is Ops.BUFFER and u.src[0].arg.name in dying:
            reads.setdefault(u.src[0].arg.name, []).append(u.src[1])
    chosen: dict[str, str] = {}
    stores = [s for s in sink.src if s.op is Ops.STORE]
    read_by = [{u.src[0].arg.name for u in s.src[1].toposort if u.op is Ops.INDEX and u.src[0].op is Ops.BUFFER}
               for s in stores]  # fmt: skip
    reduces = [u for u in sink.toposort if u.op is Ops.REDUCE]
    refusals: Counter = Counter()
    for i, store in enumerate(stores):
        target = store.src[0]
        out = members[target.src[0].arg.name]
        if isinstance(store.arg, ScatterArg):  # (stores at computed positions: never in place)
            continue
        # another store's value reading the input would read it after this store overwrote it
        read_elsewhere = set().union(*(r for j, r in enumerate(read_by) if j != i))
        for name, indexes in reads.items():
            if name in chosen.values() or name not in read_by[i] or not _can_overwrite(dying[name], out):
                continue
            why = "another store reads it" if name in read_elsewhere else None
            why = why or _unsafe_reads(indexes, target.src[1], reduces)
            if why is None:
                chosen[out.name] = name
                break
            refusals[why] += 1
    if refusals:
        metrics.tally("inplace_refusals", refusals)
    return chosen


def _unsafe_reads(indexes: list[UOp], stored: UOp, reduces: list[UOp]) -> str | None:
    """Why reads of a buffer at `indexes` may see an element after a store at `stored` wrote it
    over (Note: in-place kernels), or None."""
    target = element_form(stored)
    elements: set[UOp] = set()  # the store's loops a row read moves along
    for index in indexes:
        if element_form(index) == target:
            continue
        moved = _row_element_loops(index, stored, target)
        if moved is None:
            return "reads other elements than it stores"
        elements |= moved
    if not elements:
        return None
    if any(r.arg.reduce for red in reduces for r in red.ranges):
        return "a nested reduction reads its rows"
    if any(elements & red.ranges for red in reduces):
        return "a reduction varies with the row's element loops"
    row_loops = frozenset().union(*(red.ranges for red in reduces))
    if any(r.arg.nesting >= e.arg.nesting for r in row_loops for e in elements):
        return "a row loop runs inside an element loop"
    return None


def _row_element_loops(index: UOp, stored: UOp, target: object) -> set[UOp] | None:
    """The loop ranges of `stored` that `index`'s reduce ranges stand for, when replacing them
    (one for one, of equal extents) gives the stored element; None when no replacement does."""
    reduced = sorted((r for r in index.ranges if r.arg.reduce), key=lambda r: r.arg.nesting)
    loops = sorted((r for r in stored.ranges if not r.arg.reduce), key=lambda r: r.arg.nesting)
    if not reduced or len(reduced) > MAX_ROW_DIMS:
        return None
    for chosen in itertools.permutations(loops, len(reduced)):
        if any(r.src[0] is not c.src[0] for r, c in zip(reduced, chosen)):
            continue
        if element_form(substitute(index, dict(zip(reduced, chosen)))) == target:
            return set(chosen)
    return None


MAX_ROW_DIMS = 3  # reduce ranges of one row read matched against the store's loops (their permutations)


def _can_overwrite(victim: Buffer, out: Buffer) -> bool:
    if victim.dtype != out.dtype or out.kind == "input":  # an input stored in place keeps its own storage
        return False
    if victim.kind == "computed":  # allocated by the wrapper: its storage is exactly its layout's
        return same_sizes((victim.layout.storage_size,), (out.layout.storage_size,))
    # a donated input (Note: donated inputs) or an aten result may be a view into a larger
    # storage: only the very same elements, which a dense layout of as many elements from its
    # first one are (the wrapper's reinterpret counts from the tensor's first element). A saved
    # (256, V) logits tensor and its (2, 128, V) gradient are such a pair; which element each
    # reads is _unsafe_reads' question. An aten result's own layout is its elements, dense or not.
    if victim.kind not in ("input", "extern"):
        return False
    if victim.kind == "extern" and victim.layout == out.layout:
        return True
    return (_is_dense(victim.layout) and _is_dense(out.layout)
            and same_sizes((victim.layout.numel,), (out.layout.numel,)))  # fmt: skip


def _is_dense(layout: Layout) -> bool:
    """Every element of [offset 0, numel) exactly once: strides, smallest first, are the
    running products of their sizes."""
    if layout.offset != 0 or layout.numel == 0:
        return False
    expected = 1
    for size, stride in sorted(zip(layout.size, layout.stride), key=lambda p: size_hint(p[1])):
        if size != 1 and not same_sizes((stride,), (expected,)):
            return False
        expected *= size
    return True


def group_sink(
    group: list[ComputedBuffer], stored: set[str], alignment: tuple | None = None, bodies: dict | str | None = None
) -> UOp | str:
    """The SINK of the group's stores over shared ranges, or why the group can't be one kernel.
    `alignment` and `bodies`: what the scheduler's fusion check computed, when it did."""
    alignment = alignment or align([c.buffer.layout.size for c in group])
    if alignment is None:
        return "iteration spaces differ: " + " vs ".join(str(c.buffer.layout.size) for c in group)
    sizes, placements = alignment
    bodies = bodies or resolve_bodies(group)
    if isinstance(bodies, str):
        return bodies
    scanned = {u.src[1].arg for c in group for u in c.body.toposort if u.op is Ops.SCAN}
    # a scanned dim is a sequential loop inside the others (Note: scans, lower/scans.py); a scan
    # kernel has no other member, so its dims are the group's dims
    ranges = [UOp.range(size, d, RangeKind.SCAN if d in scanned else RangeKind.LOOP) if size != 1
              else UOp.const(dtypes.index, 0) for d, size in enumerate(sizes)]  # fmt: skip
    stores = []
    for computed, placement in zip(group, placements):
        if computed.name not in stored:
            continue
        loop_vars = [ranges[d] if s != 1 else UOp.const(dtypes.index, 0)
                     for d, s in zip(placement, computed.buffer.layout.size)]  # fmt: skip
        stores.append(_store(computed, bodies[computed.name], loop_vars))
    return UOp(Ops.SINK, dtypes.void, tuple(stores))


def indexed_store_sink(step: IndexedStore) -> UOp:
    """One loop nest over `step.shape` storing each value at its computed position (Note: stores
    at computed positions). With an owner dim, its loop is outermost (the parallel one), so
    threads never share an element and the stores need no atomics; it is split into chunks of
    OWNER_CHUNK, the chunk loop outermost and the lane loop innermost, so reads stay sequential."""
    owners = [
        d
        for d in step.owner_dims  # (a symbolic size: no owner chunks, Note: symbolic sizes)
        if type(step.shape[d]) is int and step.shape[d] >= 2 * OWNER_CHUNK and step.shape[d] % OWNER_CHUNK == 0
    ]
    owner = max(owners, key=lambda d: step.shape[d], default=None)
    loop_vars = [UOp.range(s, d + 1) if s != 1 else UOp.const(dtypes.index, 0) for d, s in enumerate(step.shape)]
    if owner is not None:
        chunk = UOp.range(step.shape[owner] // OWNER_CHUNK, 0)
        lane = UOp.range(OWNER_CHUNK, len(step.shape) + 1)
        loop_vars[owner] = chunk * OWNER_CHUNK + lane
    mapping = {UOp(Ops.AXIS, dtypes.index, (), d): v for d, v in enumerate(loop_vars)}
    index, value = substitute(step.index, mapping), substitute(step.value, mapping)
    out = step.buffer.uop()
    arg = ScatterArg(step.combine, atomic=owner is None)
    repeats = _repeated_loops(step, loop_vars, index, value)
    store = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, out.dtype, (out, index)), value, *repeats), arg)
    return UOp(Ops.SINK, dtypes.void, (store,))


def _repeated_loops(step: IndexedStore, loop_vars: list[UOp], index: UOp, value: UOp) -> tuple[UOp, ...]:
    """Loops of `step.shape` that neither the position nor the value varies with: iterations
    that fold the same value into the same element again. Overwriting (or MAX/MIN) again
    changes nothing, but ADD and MUL fold once per iteration (scatter_add of an index and a
    source expanded along a dim, stride 0), so the store takes those ranges as extra sources
    and is placed inside their loops (a UOp is placed by the ranges its sources vary with)."""
    if step.combine not in (Ops.ADD, Ops.MUL):
        return ()
    loops = {u for v in loop_vars for u in v.toposort if u.op is Ops.RANGE}
    used = simplify(index).ranges | simplify(value).ranges  # x*0 varies not
    return tuple(sorted(loops - used, key=lambda r: r.arg.nesting))


OWNER_CHUNK = 16


def _store(computed: ComputedBuffer, body: UOp, loop_vars: list[UOp]) -> UOp:
    mapping = {UOp(Ops.AXIS, dtypes.index, (), i): v for i, v in enumerate(loop_vars)}
    value = substitute(body, mapping)
    out = computed.buffer.uop()
    index = computed.buffer.layout.index(loop_vars)
    return UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, out.dtype, (out, index)), value))


def _larger(a: int | UOp, b: int | UOp) -> int | UOp:
    """The larger of two element counts of one buffer; symbolic ones (Note: symbolic sizes,
    uop/variables.py) by their bounds, or the MAX of both."""
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    x, y = (v if isinstance(v, UOp) else UOp.const(dtypes.index, v) for v in (a, b))
    if x is y or y.vmax <= x.vmin:
        return a
    return b if x.vmax <= y.vmin else x.alu(Ops.MAX, y)


def _rename_buffers(sink: UOp, outputs: frozenset[str]) -> KernelAST:
    buffers = [u for u in sink.toposort if u.op is Ops.BUFFER]
    # outputs first, then inputs in order of first use (a stable sort keeps that order)
    ordered = sorted(buffers, key=lambda b: b.arg.name not in outputs)
    names = list(dict.fromkeys(b.arg.name for b in ordered))
    position = {n: i for i, n in enumerate(names)}
    sizes: dict[str, int | UOp] = {}
    for b in buffers:
        sizes[b.arg.name] = _larger(sizes.get(b.arg.name, 0), b.arg.size)
    mapping = {
        b: UOp(Ops.BUFFER, b.dtype, (), BufferArg(f"p{position[b.arg.name]}", sizes[b.arg.name])) for b in buffers
    }
    written = frozenset(f"p{position[n]}" for n in outputs if n in position)
    return KernelAST(substitute(sink, mapping), tuple(names), written)
