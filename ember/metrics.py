"""Counters of what ember did, for tests and for users asking "what happened?".

import ember
ember.metrics.reset()
...compile and run...
ember.metrics.kernels_generated, ember.metrics.fallback_ops
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Metrics:
    graphs_compiled: int = 0
    graphs_failed: int = 0  # fell back to eager
    kernels_generated: int = 0
    tiled_kernels: int = 0  # C++ kernels whose loops are 2-D tiles for transposed access (codegen/tiling.py)
    fusions: int = 0  # pairs of groups merged by the scheduler
    fusion_refusals: int = 0
    reduce_loops: int = 0  # loops C++ kernels walk to reduce (Note: shared reduce loops, codegen/shared_loops.py)
    extern_calls: int = 0  # all aten calls in wrappers (fallbacks included)
    fallback_calls: int = 0  # aten calls for ops ember has no lowering for
    fallback_ops: Counter = field(default_factory=Counter)
    graph_cache_hits: int = 0  # graphs loaded whole from the cache (no lowering, no gcc)
    code_cache_hits: int = 0
    code_cache_misses: int = 0
    # seconds per compile stage, summed over graphs (graph_key, graph_cache_load, lower, schedule,
    # codegen (render is its share), runtime (waiting for gcc), wrapper, graph_cache_store), and
    # aot_autograd: the frontend's tracing outside ember's stages
    compile_seconds: Counter = field(default_factory=Counter)
    pass_rewrites: Counter = field(default_factory=Counter)  # FX pass name -> nodes it rewrote (ember/passes)
    kernel_searches: int = 0  # config.kernel_search: kernels whose choices were timed (runtime/search.py)
    search_candidates_timed: int = 0  # renderings timed by those searches
    search_winners_loaded: int = 0  # kernels that took a winner recorded on disk, with no search
    shape_specializations: int = 0  # static graphs compiled from a symbolic one (shape_specialization.py)
    verify_checks: int = 0  # EMBER_VERIFY: buffers compared with float64 eager (wrapper/verify.py)
    verify_mismatches: int = 0  # EMBER_VERIFY: calls in which a step differed
    pooled_buffers_reused: int = 0  # large CPU buffers lent again from the pool (runtime/memory.py)

    def reset(self) -> None:
        fresh = Metrics()
        self.__dict__.update(fresh.__dict__)


# The process-wide counters; owned by this module and only ever added to by compile_graph (and
# by the kernel search, runtime/search.py, which runs at a compiled graph's first call, and the
# buffer pool, runtime/memory.py, which counts at every call).
metrics = Metrics()
