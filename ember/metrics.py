"""Counters of what ember did, for tests and for users asking "what happened?".

import ember
ember.metrics.reset()
...compile and run...
ember.metrics.kernels_generated, ember.metrics.fallback_ops
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

# Graphs run and compile on several threads at once, and `x += n` on an attribute is a read and
# a write that another thread can come between: every change to the counters is one step under
# this lock (Metrics.add, Metrics.tally, Metrics.reset).
_lock = threading.Lock()


@dataclass
class Metrics:
    graphs_compiled: int = 0
    graphs_failed: int = 0  # fell back to eager
    kernels_generated: int = 0
    kernels_codegen: int = 0  # of those, the distinct ASTs that went through the rewrite phases and the renderer
    tiled_kernels: int = 0  # C++ kernels whose loops are 2-D tiles for transposed access (codegen/tiling.py)
    # Triton pointwise kernels walking rows of columns (Note: pointwise kernels in rows, codegen/blocks.py)
    row_kernels: int = 0
    fusions: int = 0  # pairs of groups merged by the scheduler
    fusion_refusals: int = 0
    # horizontal kernels, and the launches they save: parts launched together less one each
    # (Note: horizontal fusion, schedule/horizontal.py)
    horizontal_groups: int = 0
    horizontal_kernels_saved: int = 0
    # loops kernels walk to reduce: C++ kernels, and Triton kernels' looped variants (Note: shared reduce loops,
    # codegen/shared_loops.py; Note: independent reductions share a looped phase, codegen/block_lowering.py)
    reduce_loops: int = 0
    extern_calls: int = 0  # all aten calls in wrappers (fallbacks included)
    # bytes ember's kernels read and write per call of their graphs, summed over graphs: each buffer a
    # kernel touches counted once at its whole size (static shapes; a symbolic one counts its hint)
    kernel_bytes: int = 0
    fallback_calls: int = 0  # aten calls for ops ember has no lowering for
    fallback_ops: Counter = field(default_factory=Counter)
    inputs_written_in_place: int = 0  # graph inputs kernels store into (Note: inputs written in place)
    # kernel outputs written over a buffer that dies in that kernel, and of those, over a donated input of a
    # backward (its saved tensor, Note: in-place kernels, codegen/kernel.py; Note: donated inputs, donation.py)
    inplace_writes: int = 0
    donated_inputs_overwritten: int = 0
    inplace_refusals: Counter = field(default_factory=Counter)  # candidates a kernel may not write over, by why
    # functional collectives in compiled graphs, and the ember kernels scheduled between each and its
    # wait, summed (Note: collectives in the graph, schedule/collectives.py)
    collective_calls: int = 0
    collective_overlap_kernels: int = 0
    # the most collectives of one graph issued and not yet waited for at once, over every graph
    # (Note: gloo runs collectives one at a time, lower/collectives.py)
    collectives_most_in_flight: int = 0
    scalar_inputs_by_value: int = 0  # 0-d CPU inputs Triton kernels take as numbers (schedule/host_scalars.py)
    graph_cache_hits: int = 0  # graphs loaded whole from the cache (no lowering, no gcc)
    code_cache_hits: int = 0
    code_cache_misses: int = 0
    gcc_runs: int = 0  # gcc processes started (Note: kernels compiled together, runtime/cpu.py)
    cache_entries_rebuilt: int = 0  # cache entries that failed their checks or their load, discarded (runtime/cache.py)
    # seconds per compile stage, summed over graphs (graph_key, graph_cache_load, lower, schedule,
    # codegen (render is its share), runtime (waiting for gcc), wrapper, graph_cache_store), and
    # aot_autograd: the frontend's tracing outside ember's stages
    compile_seconds: Counter = field(default_factory=Counter)
    # the scheduler's work (schedule/order.py ScheduleWork): candidate_pairs, pairs_examined,
    # edges_visited, simulation_steps; tests check that it grows linearly with the graph
    schedule_work: Counter = field(default_factory=Counter)
    pass_rewrites: Counter = field(default_factory=Counter)  # FX pass name -> nodes it rewrote (ember/passes)
    kernel_searches: int = 0  # config.kernel_search: kernels whose choices were timed (runtime/search.py)
    search_candidates_timed: int = 0  # renderings timed by those searches
    search_winners_loaded: int = 0  # kernels that took a winner recorded on disk, with no search
    # config.matmul_timing: linear shapes timed with aten and oneDNN, and verdicts read from disk instead
    # (Note: timed matmul libraries, passes/matmul_timing.py)
    matmul_timings: int = 0
    matmul_timings_loaded: int = 0
    shape_specializations: int = 0  # static graphs compiled from a symbolic one (shape_specialization.py)
    symbolic_graphs: int = 0  # graphs with dynamic shapes compiled once (compile_symbolic.py)
    # graphs with dynamic shapes compiled per shape instead, by the reason the symbolic compile refused
    symbolic_fallbacks: Counter = field(default_factory=Counter)
    # guards on sizes that symbolic compiles added for dynamo to check, by guard (size_guards.py)
    size_guards: Counter = field(default_factory=Counter)
    verify_checks: int = 0  # EMBER_VERIFY: buffers compared with float64 eager (wrapper/verify.py)
    verify_mismatches: int = 0  # EMBER_VERIFY: calls in which a step differed
    cuda_graphs_recorded: int = 0  # config.cuda_graphs: recordings made (runtime/cuda_graphs.py)
    cuda_graph_replays: int = 0  # calls that replayed a recording
    cuda_graph_skips: int = 0  # calls that ran without one (no recording fit, and no more may be made)
    cuda_graph_refusals: int = 0  # graphs that run without CUDA graphs, each with a warning naming why
    cuda_graph_input_copies: int = 0  # device inputs copied into a recording's buffers, summed over replays
    cuda_graph_output_copies: int = 0  # output storages copied out of a recording, summed over replays
    cuda_graph_outputs_kept: int = 0  # lent outputs found held at a later call, copied from then on
    pooled_buffers_reused: int = 0  # large CPU buffers lent again from the pool (runtime/memory.py)
    # error flag sets Triton calls' threads made; later calls borrow them (Note: error flags lent per thread)
    gpu_error_flag_sets: int = 0
    # Triton on the GPU (Note: the compile pool, runtime/triton_pool.py; Note: bounded tuning, runtime/triton.py)
    triton_configs_precompiled: int = 0  # launch configurations handed to the compile pool when a wrapper loads
    triton_compiles_in_process: int = 0  # compiles the pool was not asked for (unaligned pointers, no signature)
    # precompiled kernels whose worker compiled them under another cache key than the launcher's, so the
    # launcher compiled them again (Note: the tools that key Triton's cache, runtime/triton_compile.py)
    triton_pool_key_mismatches: int = 0
    # interpreter launches of a symbolic kernel past its size cap, with 64-bit index math (Note: symbolic blocks)
    triton_wide_index_launches: int = 0
    triton_kernels_tuned: int = 0  # kernels whose candidate configurations were timed at their first call
    triton_configs_timed: int = 0  # candidate configurations those timings ran
    # size classes symbolic kernels' calls met, each given a configuration of its own, and those
    # configurations by variant (Note: size classes, runtime/triton_sized.py)
    triton_size_classes: int = 0
    triton_size_class_variants: Counter = field(default_factory=Counter)

    def add(self, **amounts: float) -> None:
        """Add to counters by name, e.g. `metrics.add(kernel_searches=1)`."""
        with _lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def raise_to(self, **values: float) -> None:
        """Raise counters by name to at least these values (the most of something over graphs)."""
        with _lock:
            for name, value in values.items():
                setattr(self, name, max(getattr(self, name), value))

    def tally(self, name: str, counts: Mapping[str, float]) -> None:
        """Add `counts` into the Counter field `name` (fallback_ops, compile_seconds, ...)."""
        with _lock:
            getattr(self, name).update(counts)

    def reset(self) -> None:
        with _lock:
            self.__dict__.update(Metrics().__dict__)

    def __str__(self) -> str:
        """One line per counter that is not zero, for `print(ember.metrics)`; `repr` has them all."""
        with _lock:
            values = dict(self.__dict__)
        lines = ["ember.metrics:"]
        for name, value in values.items():
            if isinstance(value, Counter):
                moved = [(str(key), n) for key, n in value.most_common() if n]
                if moved:
                    width = max(len(key) for key, _ in moved)
                    lines += [f"  {name}:", *(f"    {key:<{width}}  {_number(n)}" for key, n in moved)]
            elif value:
                lines.append(f"  {name}: {_number(value)}")
        return "\n".join(lines) if len(lines) > 1 else "ember.metrics: nothing compiled or run yet"


def _number(value: float) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


# The process-wide counters; owned by this module and only ever added to through `add` and
# `tally`, by compile_graph (and by the kernel search, runtime/search.py, which runs at a
# compiled graph's first call, and the buffer pool, runtime/memory.py, which counts at every call).
metrics = Metrics()
