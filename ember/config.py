"""ember's configuration: a small, typed set of flags.

Each flag says whether it changes generated code (and so is part of the cache key).
Environment overrides (`EMBER_<NAME>`) are read when a compile starts, never at import;
`ember.compile(fn, **options)` overrides both.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path


def _flag(default, env: str, in_cache_key: bool, doc: str):
    return field(default=default, metadata={"env": env, "in_cache_key": in_cache_key, "doc": doc})


@dataclass(frozen=True)
class Config:
    strict: bool = _flag(False, "EMBER_STRICT", False, "raise instead of falling back to eager when a graph fails")
    debug: bool = _flag(False, "EMBER_DEBUG", False, "dump every stage of every graph into debug_dir")
    debug_dir: str = _flag("ember_debug", "EMBER_DEBUG_DIR", False, "where EMBER_DEBUG dumps go")
    check_ir: bool = _flag(False, "EMBER_CHECK_IR", False,
                           "verify each kernel against the IR spec (uop/spec.py) after every codegen step; "
                           "on under EMBER_DEBUG and in the test suite")  # fmt: skip
    cache_dir: str = _flag(str(Path.home() / ".cache" / "ember"), "EMBER_CACHE_DIR", False, "on-disk cache")
    cxx: str = _flag("g++", "EMBER_CXX", True, "the C++ compiler for CPU kernels")
    parallel_threshold: int = _flag(32768, "EMBER_PARALLEL_THRESHOLD", True,
                                    "loop nests with fewer iterations run on one thread")  # fmt: skip
    huge_pages: bool = _flag(True, "EMBER_HUGE_PAGES", True,
                             "back large CPU buffers the wrapper allocates with transparent huge pages "
                             "(fewer page faults; Note: huge pages for fresh buffers)")  # fmt: skip
    buffer_pool_mb: int = _flag(1024, "EMBER_BUFFER_POOL_MB", True,
                                "MiB of large CPU buffers kept for reuse once free, so outputs skip "
                                "fresh-page faults (Note: pooled large buffers); 0: every buffer fresh")  # fmt: skip
    shape_specializations: int = _flag(8, "EMBER_SHAPE_SPECIALIZATIONS", False,
                                       "a graph with dynamic shapes is compiled for at most this many "
                                       "concrete shapes (Note: dynamic shapes by specialization); "
                                       "new ones past that run eagerly")  # fmt: skip
    fusion: bool = _flag(True, "EMBER_FUSION", True, "let the scheduler fuse computed buffers into kernels")
    graph_cache: bool = _flag(True, "EMBER_GRAPH_CACHE", False, "load graphs compiled before from the cache")
    explain_file: str = _flag("", "EMBER_EXPLAIN_FILE", False, "append each graph's explanation to this file")
    fallback_random: bool = _flag(False, "EMBER_FALLBACK_RANDOM", True,
                                  "random ops call aten: eager's generator and values, no fusion")  # fmt: skip
    compile_threads: int = _flag(0, "EMBER_COMPILE_THREADS", False,
                                 "kernels compiled in parallel; 0: one per usable CPU core")  # fmt: skip
    backend: str = _flag("auto", "EMBER_BACKEND", True,
                         "auto: C++ for CPU graphs, Triton for CUDA; triton: Triton for CPU graphs too "
                         "(under Triton's interpreter)")  # fmt: skip
    autotune: bool = _flag(True, "EMBER_AUTOTUNE", True, "time a few launch configurations per Triton kernel")
    split_reductions: int = _flag(32768, "EMBER_SPLIT_REDUCTIONS", True,
                                  "Triton: reductions at least this long with few outputs are split over many "
                                  "programs (Note: split reductions); 0 never splits")  # fmt: skip
    # FX graph passes (ember/passes); with user hooks the graph cache is keyed by the graph after them
    passes: bool = _flag(True, "EMBER_PASSES", True, "run ember's FX graph passes (DCE, no-ops, conv rewrites)")
    conv_channels_last: bool = _flag(True, "EMBER_CONV_CHANNELS_LAST", True,
                                     "2-d convolutions read channels-last activations (oneDNN's layout)")  # fmt: skip
    mkldnn_fusion: bool = _flag(True, "EMBER_MKLDNN_FUSION", True,
                                "linear/conv + bias + activation as one oneDNN call (passes/mkldnn.py)")  # fmt: skip
    mkldnn_relu: bool = _flag(False, "EMBER_MKLDNN_RELU", True,
                              "relu as a oneDNN post-op too: faster, but relu(NaN) gives 0, not NaN")  # fmt: skip
    pre_passes: tuple = _flag((), "", False, "callables f(graph: torch.fx.Graph) run before ember's passes")
    post_passes: tuple = _flag((), "", False, "callables f(graph: torch.fx.Graph) run after ember's passes")
    verify: bool = _flag(False, "EMBER_VERIFY", False,
                         "run each compiled call also as the aten graph in float64 eager and warn (raise under "
                         "strict) naming the first kernel whose output differs, its aten nodes and source line "
                         "(Note: verifying a compiled graph); slow, for debugging; no graph cache")  # fmt: skip
    kernel_search: bool = _flag(False, "EMBER_KERNEL_SEARCH", True,
                                "time a few renderings of each C++ kernel (threads, collapse, vector width, "
                                "unrolling) at its first call and keep the fastest (cached on disk)")  # fmt: skip

    def cache_key(self) -> str:
        return repr([(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.metadata["in_cache_key"]])


def _parse(text: str, like):
    if isinstance(like, bool):
        return text.strip().lower() not in ("", "0", "false", "no", "off")
    return type(like)(text)


def load(**options) -> Config:
    """The config for one compile: defaults, then environment, then `options`."""
    values = {}
    for f in dataclasses.fields(Config):
        env = os.environ.get(f.metadata["env"]) if f.metadata["env"] else None
        if env is not None:
            values[f.name] = _parse(env, f.default)
    unknown = set(options) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(Config))
        raise TypeError(f"unknown ember option(s) {sorted(unknown)}; known options: {known}")
    values.update(options)
    if values.get("debug"):
        values.setdefault("check_ir", True)
    for hooks in ("pre_passes", "post_passes"):
        if hooks in values:
            values[hooks] = _pass_hooks(hooks, values[hooks])
    return Config(**values)


def _pass_hooks(name: str, hooks) -> tuple:
    """One callable or a sequence of them, each taking the aten torch.fx.Graph."""
    hooks = (hooks,) if callable(hooks) else tuple(hooks or ())
    for hook in hooks:
        if not callable(hook):
            raise TypeError(f"ember option {name} takes callables f(graph: torch.fx.Graph); got {hook!r}")
    return hooks
