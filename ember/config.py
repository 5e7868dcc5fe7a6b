"""ember's configuration: a small, typed set of flags.

Each flag says whether it changes generated code (and so is part of the cache key).
Environment overrides (`EMBER_<NAME>`) are read when a compile starts, never at import;
`ember.compile(fn, **options)` overrides both. Every value is checked when it is read: a bad
one is an error naming the variable (or option) and the values it accepts, and an `EMBER_*`
variable ember does not know gets one warning per process (a typo like `EMBER_DEBGU=1` would
otherwise be ignored silently).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ember.errors import warn_at_user_code


def _flag(default, env: str, in_cache_key: bool, doc: str, choices: tuple = (), minimum: int | None = None):
    metadata = {"env": env, "in_cache_key": in_cache_key, "doc": doc, "choices": choices, "minimum": minimum}
    return field(default=default, metadata=metadata)


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
                                    "loop nests with fewer iterations run on one thread", minimum=0)  # fmt: skip
    huge_pages: bool = _flag(True, "EMBER_HUGE_PAGES", True,
                             "back large CPU buffers the wrapper allocates with transparent huge pages "
                             "(fewer page faults; Note: huge pages for fresh buffers)")  # fmt: skip
    buffer_pool_mb: int = _flag(1024, "EMBER_BUFFER_POOL_MB", True,
                                "MiB of large CPU buffers kept for reuse once free, so outputs skip fresh-page "
                                "faults (Note: pooled large buffers); 0: every buffer fresh", minimum=0)  # fmt: skip
    shape_specializations: int = _flag(8, "EMBER_SHAPE_SPECIALIZATIONS", False,
                                       "a graph with dynamic shapes is compiled for at most this many "
                                       "concrete shapes (Note: dynamic shapes by specialization); "
                                       "new ones past that run eagerly", minimum=0)  # fmt: skip
    # not in the cache key: it picks which graph reaches compile_graph (the symbolic one or a static one
    # per shape), and each graph is keyed by its own code and layouts (tests/test_symbolic_shapes.py)
    symbolic_shapes: bool = _flag(True, "EMBER_SYMBOLIC_SHAPES", False,
                                  "compile a graph with dynamic shapes once, its kernels taking sizes as "
                                  "arguments (Note: symbolic sizes); off, or where that fails, it is "
                                  "compiled per concrete shape")  # fmt: skip
    fusion: bool = _flag(True, "EMBER_FUSION", True, "let the scheduler fuse computed buffers into kernels")
    horizontal_fusion: bool = _flag(True, "EMBER_HORIZONTAL_FUSION", True,
                                    "launch independent small elementwise kernels (an optimizer's per-parameter "
                                    "updates) as one kernel (Note: horizontal fusion)")  # fmt: skip
    collective_overlap: bool = _flag(True, "EMBER_COLLECTIVE_OVERLAP", True,
                                     "issue each collective in a graph as early and wait for it as late as the "
                                     "data allows (Note: collectives in the graph); off: where the graph has "
                                     "them, as traced")  # fmt: skip
    collectives_in_flight: int = _flag(9, "EMBER_COLLECTIVES_IN_FLIGHT", True,
                                       "with collective_overlap, the most collectives of a graph issued and not yet "
                                       "waited for: an FSDP all-gather issued early holds a whole parameter until "
                                       "its use; 0: no bound; 1 on a gloo group, whatever this says (Note: gloo runs "
                                       "collectives one at a time)", minimum=0)  # fmt: skip
    graph_cache: bool = _flag(True, "EMBER_GRAPH_CACHE", False, "load graphs compiled before from the cache")
    explain_file: str = _flag("", "EMBER_EXPLAIN_FILE", False, "append each graph's explanation to this file")
    partitioner: str = _flag("min_cut", "EMBER_PARTITIONER", False,
                             "how AOTAutograd splits a training graph: min_cut saves fewer activations for the "
                             "backward, which recomputes cheap ones in its own kernels; default saves every value "
                             "the backward reads (Note: the partitioner, frontend.py)",
                             choices=("min_cut", "default"))  # fmt: skip
    fallback_random: bool = _flag(False, "EMBER_FALLBACK_RANDOM", True,
                                  "random ops call aten: eager's generator and values, no fusion")  # fmt: skip
    compile_threads: int = _flag(0, "EMBER_COMPILE_THREADS", False,
                                 "kernels compiled in parallel (gcc processes; Triton compile workers, fixed by the "
                                 "process's first GPU compile); 0: one per usable CPU core", minimum=0)  # fmt: skip
    backend: str = _flag("auto", "EMBER_BACKEND", True,
                         "auto (or cpp): C++ for CPU graphs, Triton for CUDA; triton: Triton for CPU graphs too "
                         "(under Triton's interpreter)", choices=("auto", "cpp", "triton"))  # fmt: skip
    cuda_graphs: bool = _flag(False, "EMBER_CUDA_GRAPHS", True,
                              "replay each CUDA graph's launches from a recorded CUDA graph (Note: CUDA graphs, "
                              "runtime/cuda_graphs.py); also torch.compile(mode=\"reduce-overhead\")")  # fmt: skip
    autotune: bool = _flag(True, "EMBER_AUTOTUNE", True, "time a few launch configurations per Triton kernel")
    tuning_candidates: int = _flag(8, "EMBER_TUNING_CANDIDATES", True,
                                   "the most launch configurations a Triton kernel's first call compiles and times "
                                   "(the best guesses first; fewer: a faster cold compile)", minimum=1)  # fmt: skip
    split_reductions: int = _flag(32768, "EMBER_SPLIT_REDUCTIONS", True,
                                  "Triton: reductions at least this long with few outputs are split over many "
                                  "programs (Note: split reductions); 0 never splits", minimum=0)  # fmt: skip
    online_softmax: str = _flag("row", "EMBER_ONLINE_SOFTMAX", True,
                                "Triton: a long row's sum of exp(x - max) is taken in its max's loop, relative to the "
                                "row's running max (row) or each lane's (lane), so the row is read once; off: two "
                                "passes (Note: a row's exponential sum in one pass)",
                                choices=("row", "lane", "off"))  # fmt: skip
    pointwise_rows: int = _flag(1024, "EMBER_POINTWISE_ROWS", True,
                                "Triton: a pointwise kernel whose innermost loop (not a power of two) and rows are "
                                "both at least this long, reading a value per row or per column, walks rows of "
                                "columns instead of its flattened elements (Note: pointwise kernels in rows); "
                                "0: never", minimum=0)  # fmt: skip
    # FX graph passes (ember/passes); with user hooks the graph cache is keyed by the graph after them
    passes: bool = _flag(True, "EMBER_PASSES", True, "run ember's FX graph passes (DCE, no-ops, conv rewrites)")
    conv_channels_last: bool = _flag(True, "EMBER_CONV_CHANNELS_LAST", True,
                                     "2-d convolutions read channels-last activations (oneDNN's layout), but for a "
                                     "graph's last weight-bound ones (Note: convolutions that stay NCHW)")  # fmt: skip
    vector_matmul: bool = _flag(True, "EMBER_VECTOR_MATMUL", True,
                                "CPU: a float32 linear of one static row (a decode step's) as an ember reduction "
                                "over the (out, in) weight (Note: a vector times a matrix)")  # fmt: skip
    mkldnn_fusion: bool = _flag(True, "EMBER_MKLDNN_FUSION", True,
                                "linear/conv + bias + activation as one oneDNN call (passes/mkldnn.py)")  # fmt: skip
    matmul_timing: bool = _flag(True, "EMBER_MATMUL_TIMING", True,
                                "time aten's matmul against oneDNN's linear once per machine and shape, and give "
                                "oneDNN the static linears it runs faster (Note: timed matmul libraries)")  # fmt: skip
    onednn_slack_kb: int = _flag(0, "EMBER_ONEDNN_SLACK_KB", True,
                                 "KiB of oneDNN scratchpad a linear may add above the peak eager reaches "
                                 "(Note: oneDNN's scratchpad): 0 keeps ember's memory at or below eager's; "
                                 "an LM head, the peak itself, goes to oneDNN only with some", minimum=0)  # fmt: skip
    mkldnn_relu: bool = _flag(False, "EMBER_MKLDNN_RELU", True,
                              "relu as a oneDNN post-op too: faster, but relu(NaN) gives 0, not NaN")  # fmt: skip
    pre_passes: tuple = _flag((), "", False, "callables f(graph: torch.fx.Graph) run before ember's passes")
    post_passes: tuple = _flag((), "", False, "callables f(graph: torch.fx.Graph) run after ember's passes")
    gpu_error_checks: str = _flag("deferred", "EMBER_GPU_ERROR_CHECKS", True,
                                  "when a call reads what its Triton kernels reported (a bad index): deferred, at "
                                  "the thread's next ember call on the GPU, without waiting for the GPU (as CUDA "
                                  "reports its own errors, late); sync, at the end of the call itself, waiting for "
                                  "the GPU each call (Note: deferred GPU error checks)",
                                  choices=("deferred", "sync"))  # fmt: skip
    verify: bool = _flag(False, "EMBER_VERIFY", False,
                         "run each compiled call also as the aten graph in float64 eager and warn (raise under "
                         "strict) naming the first kernel whose output differs, its aten nodes and source line "
                         "(Note: verifying a compiled graph); slow, for debugging; no graph cache")  # fmt: skip
    kernel_search: bool = _flag(False, "EMBER_KERNEL_SEARCH", True,
                                "time a few renderings of each C++ kernel (threads, collapse, vector width, "
                                "unrolling) at its first call and keep the fastest (cached on disk)")  # fmt: skip

    def cache_key(self) -> str:
        return repr([(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.metadata["in_cache_key"]])


_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off", "")

# EMBER_* variables read by ember's test suite and tools rather than by Config: not typos.
OTHER_VARIABLES = {
    "EMBER_TEST_DEVICE": "tests/helpers.py: cpu, or cuda to run the suite's checks on the GPU",
    "EMBER_TEST_CACHE_DIR": "tests/conftest.py: the kernel cache the test suite uses",
}


def _fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(Config)


def _accepted(f: dataclasses.Field) -> str:
    """The values `f` accepts, in words, for error messages."""
    if f.metadata["choices"]:
        return "one of " + ", ".join(f.metadata["choices"])
    if isinstance(f.default, bool):
        return "a boolean: " + ", ".join(_TRUE_WORDS) + " or " + ", ".join(w for w in _FALSE_WORDS if w)
    if isinstance(f.default, int):
        minimum = f.metadata["minimum"]
        return "an integer" + (f" >= {minimum}" if minimum is not None else "")
    return "a string"


def _parse_env(f: dataclasses.Field, text: str):
    """The value of environment variable `f.metadata["env"]` set to `text`; ValueError naming it."""
    name, word = f.metadata["env"], text.strip()
    if isinstance(f.default, bool):
        if word.lower() in _TRUE_WORDS or word.lower() in _FALSE_WORDS:
            return word.lower() in _TRUE_WORDS
        raise ValueError(f"{name}={text!r} is not {_accepted(f)}")
    if isinstance(f.default, int):
        minimum = f.metadata["minimum"]
        if not re.fullmatch(r"[+-]?\d+", word) or (minimum is not None and int(word) < minimum):
            raise ValueError(f"{name}={text!r} is not {_accepted(f)}")
        return int(word)
    return _checked(f, text, name)


def _checked(f: dataclasses.Field, value, where: str):
    """`value` for field `f` if it is of the field's kind and range; ValueError naming `where`."""
    default, minimum, choices = f.default, f.metadata["minimum"], f.metadata["choices"]
    if isinstance(default, bool):
        ok = isinstance(value, bool) or value in (0, 1)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)
    elif isinstance(default, str):
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
        ok = isinstance(value, str) and (not choices or value in choices)
    else:
        ok = True
    if not ok:
        raise ValueError(f"{where}={value!r} is not {_accepted(f)}")
    return bool(value) if isinstance(default, bool) else value


# Owned by this module: the unknown EMBER_* names already warned about (one warning each).
_warned_unknown: set[str] = set()
_warned_lock = threading.Lock()


def _warn_unknown_variables(environ) -> None:
    known = {f.metadata["env"] for f in _fields() if f.metadata["env"]} | set(OTHER_VARIABLES)
    for name in sorted(n for n in environ if n.startswith("EMBER_") and n not in known):
        with _warned_lock:
            if name in _warned_unknown:
                continue
            _warned_unknown.add(name)
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else "; README.md's Configuration table lists them"
        warn_at_user_code(f"ember ignores unknown environment variable {name}{hint}")


def load(**options) -> Config:
    """The config for one compile: defaults, then environment, then `options`."""
    fields = {f.name: f for f in _fields()}
    unknown = set(options) - set(fields)
    if unknown:
        raise TypeError(f"unknown ember option(s) {sorted(unknown)}; known options: {', '.join(fields)}")
    _warn_unknown_variables(os.environ)
    values = {}
    for f in fields.values():
        env = os.environ.get(f.metadata["env"]) if f.metadata["env"] else None
        if env is not None:
            values[f.name] = _parse_env(f, env)
    for name, value in options.items():
        values[name] = value if name in ("pre_passes", "post_passes") else _checked(fields[name], value, name)
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
