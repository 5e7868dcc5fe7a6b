"""Stage `renderer` (C++): the decisions of a kernel's rendering that have no one right answer.

Note: kernel choices
    Some of the C++ renderer's decisions are guesses: whether a loop nest is worth several
    threads (`parallel_threshold` is one number for every kernel and machine), whether
    `parallel for` splits the two outer loops together (`collapse(2)`: an outer loop of 3
    iterations on 2 threads leaves one idle half the time), the OpenMP schedule (static
    halves wait for a thread the OS preempted; dynamic chunks do not), the vector width (gcc picks
    512 bits on AVX-512 hosts; 256 may run as fast and clock higher) and whether gcc unrolls
    loops. `KernelChoices` names one set of these decisions; the default is the renderer's
    own rule, so a default rendering is byte for byte the one without choices. The kernel
    search (runtime/search.py, `config.kernel_search`, off by default) renders the few
    alternatives `search_space` lists, times them on the real arguments, and keeps the
    fastest (Note: kernel search).

    Every alternative computes each element exactly as the default does:
      - threading (threads, collapse, schedule) changes only on loops that carry nothing
        between iterations (no reduction clause, no scan): an OpenMP reduction's combining
        order depends on the split;
      - the vector width changes only in kernels that call no libmvec function (libmvec's
        256- and 512-bit versions of one function may round differently);
      - gcc's unroller does not reassociate (no -ffast-math), so unrolled reductions add in
        the same order;
      - kernels with stores at computed positions are never searched (an owner dim's plain
        stores rely on the outermost loop alone being split);
      - the tile size of 2-D tiles (codegen/tiling.py) changes only the order independent
        iterations run in (tiled kernels have no reductions).
    The search checks it too: a candidate whose result on the real arguments differs from
    the default's in one bit is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.codegen.tiling import is_tile_loop, trip_count
from ember.uop.ops import Ops, ScatterArg, UOp


@dataclass(frozen=True)
class KernelChoices:
    parallel: str = "auto"  # "auto": nests of parallel_threshold iterations or more; "never"; "more": 1/16 of that
    collapse: bool = False  # `parallel for collapse(2)` where the two outer loops nest perfectly and carry nothing
    dynamic_chunks: int = 0  # 0: OpenMP's static schedule; N: schedule(dynamic) in about N chunks per nest
    vector_bits: int = 0  # 0: the compiler's width for the host; else gcc's prefer-vector-width
    unroll: bool = False  # gcc unrolls the kernel's loops (-funroll-loops)
    tile: int = 0  # 0: the codegen's tile size for 2-D tiles (codegen/tiling.py); else this many elements


DEFAULT_CHOICES = KernelChoices()
MORE_PARALLEL = 16  # "more": nests this many times smaller than the threshold get threads too


def file_pragmas(choices: KernelChoices) -> str:
    """Lines that open the source. They apply to every function in the file, the prelude's
    helpers included, so those still inline into the kernel's loops (gcc refuses to inline
    across differing optimize or target options)."""
    lines = []
    if choices.vector_bits:
        lines.append(f'#pragma GCC target("prefer-vector-width={choices.vector_bits}")')
    if choices.unroll:
        lines.append('#pragma GCC optimize("unroll-loops")')
    return "".join(line + "\n" for line in lines)


def runs_parallel(choices: KernelChoices, splittable: bool, work: int, threshold: int, carries: bool) -> bool:
    """Whether an outermost loop gets `parallel for`. `splittable`: outermost, more than one
    iteration; `work`: its nest's iterations; `carries`: it has a reduction clause, whose
    combining order depends on the split (so the default rule decides)."""
    if not splittable:
        return False
    if carries or choices.parallel == "auto":
        return work >= threshold
    if choices.parallel == "more":
        return work >= threshold // MORE_PARALLEL
    return False  # "never"


def parallel_clauses(choices: KernelChoices, program: list[UOp], start: int, carries: bool) -> list[str]:
    """The clauses of a `parallel for` on the loop at program[start] beyond the reduction
    clauses: none on a loop that carries an accumulator (another split or schedule would
    combine the threads' partial results in another order)."""
    if carries:
        return []
    clauses, iterations = [], trip_count(program[start], choices.tile)
    if choices.collapse and collapses(program, start):
        clauses.append("collapse(2)")
        iterations *= trip_count(program[start + 1], choices.tile)
    if choices.dynamic_chunks:
        # a thread the OS preempts (a busy machine) holds up one chunk, not its static half
        clauses.append(f"schedule(dynamic, {max(1, -(-iterations // choices.dynamic_chunks))})")
    return clauses


def collapses(program: list[UOp], start: int) -> bool:
    """Whether the loop opened at program[start] and the one right inside it nest perfectly
    (nothing between their openings or their closings), with more loops inside the inner
    one: then `collapse(2)` is legal, and the inner loop keeps no pragma of its own."""
    if start + 1 >= len(program) or program[start + 1].op is not Ops.RANGE:
        return False
    inner_end, depth, has_inner_loop = None, 0, False
    for i in range(start + 2, len(program)):
        op = program[i].op
        if op is Ops.RANGE:
            depth, has_inner_loop = depth + 1, True
        elif op is Ops.ENDRANGE and depth > 0:
            depth -= 1
        elif op is Ops.ENDRANGE:
            inner_end = i
            break
    return (
        inner_end is not None
        and has_inner_loop
        and inner_end + 1 < len(program)
        and (program[inner_end + 1].op is Ops.ENDRANGE)
    )


# What may move from between two loops into the inner one: values, which are recomputed per
# inner iteration (index math gcc hoists again), never effects or accumulators.
_PINNED = {Ops.RANGE, Ops.ENDRANGE, Ops.STORE, Ops.DEFINE_ACC, Ops.ACC_UPDATE, Ops.ACC_READ, Ops.ACC_RUNNING, Ops.CHECK}


def nest_perfectly(program: list[UOp]) -> list[UOp]:
    """For `collapse`: a top-level loop whose body is values, then one loop with loops inside,
    and nothing after it, gets those values moved into the inner loop, so the two nest
    perfectly (the linearizer hoists index math to the outer loop; gcc 12's collapse(2)
    wants nothing between the loops)."""
    result, depth, i = [], 0, 0
    while i < len(program):
        u = program[i]
        if depth == 0 and u.op is Ops.RANGE and (inner := _movable_prefix_end(program, i)) is not None:
            result += [u, program[inner], *program[i + 1 : inner]]
            i = inner + 1
            depth += 2
            continue
        depth += (u.op is Ops.RANGE) - (u.op is Ops.ENDRANGE)
        result.append(u)
        i += 1
    return result


def _movable_prefix_end(program: list[UOp], start: int) -> int | None:
    """The position of the inner loop when the loop at `start` can nest perfectly and will
    collapse (it carries nothing), else None."""
    if _carries(program, start):
        return None
    inner = start + 1
    while inner < len(program) and program[inner].op not in _PINNED:
        inner += 1
    if inner == start + 1 or inner >= len(program) or program[inner].op is not Ops.RANGE:
        return None
    return inner if collapses(program[:start] + [program[start], *program[inner:]], start) else None


def _carries(program: list[UOp], start: int) -> bool:
    """Whether the loop opened at program[start] updates an accumulator declared outside it."""
    declared, depth = set(), 0
    for u in program[start + 1 :]:
        if u.op is Ops.DEFINE_ACC:
            declared.add(u)
        elif u.op in (Ops.ACC_UPDATE, Ops.ACC_RUNNING) and u.src[0] not in declared:
            return True
        depth += (u.op is Ops.RANGE) - (u.op is Ops.ENDRANGE)
        if depth < 0:
            return False
    return False


def search_space(program: list[UOp], narrower_vectors: bool) -> list[KernelChoices]:
    """The choices worth timing for `program`, the default first (Note: kernel choices).
    Several may render the same source (a kernel with no loop to collapse); the search keeps
    one of each. `narrower_vectors`: try 256-bit vectors (the host's default is 512 bits and
    the kernel calls no vector math function)."""
    if any(u.op is Ops.STORE and isinstance(u.arg, ScatterArg) for u in program):
        return [DEFAULT_CHOICES]
    space = [
        DEFAULT_CHOICES,
        KernelChoices(parallel="never"),
        KernelChoices(parallel="more"),
        KernelChoices(collapse=True),
        KernelChoices(dynamic_chunks=16),
        KernelChoices(unroll=True),
    ]
    if narrower_vectors:
        space.append(KernelChoices(vector_bits=256))
    if any(is_tile_loop(u) for u in program):  # Note: 2-D tiles: a smaller and a larger tile
        tile = next(u.arg.tile for u in program if is_tile_loop(u))
        space += [KernelChoices(tile=tile // 2), KernelChoices(tile=tile * 2)]
    return space
