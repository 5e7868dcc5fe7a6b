"""The OpInfo conformance sweep: every op of PyTorch's op database through ember, against eager.

    python -m tests.conformance --dtype float32 [--ops name1,name2] [--samples N] [--jobs J]
                                [--timeout S] [--json out.json] [--cache-dir DIR]

For each OpInfo entry of `torch.testing._internal.common_methods_invocations.op_db` that
supports the dtype on CPU, the first N sample inputs run eagerly and through
`torch.compile(fn, backend="ember", dynamic=False, fullgraph=False)` with EMBER_STRICT=1.
Each op is classified by its worst sample:

    crash     the worker process died or hung (timeout per op) on it
    error     ember (or dynamo) raised where eager did not
    mismatch  the values, shapes or dtypes differ from eager
    pass      every compared sample agrees
    no graph  every compared sample agrees, but no graph ever reached ember (dynamo ran it)
    skip      nothing to compare: no samples, eager raises on every sample, or outputs that
              are not comparable (sparse tensors, opaque objects)

Float outputs are compared with `torch.testing.assert_close`'s default tolerance for the
dtype (equal_nan=True, so NaN positions must agree) against eager on the same dtype; where
that fails, a second chance against eager on float64-upcast inputs (ember accumulates in
double, so it can be closer to the exact result than eager is), and a third against the
graph ember receives run eagerly (`aot_eager`: see below). Integers and bools must match
exactly. Random ops and ops returning uninitialized memory are compared on shapes and dtypes
only. Every sample also runs with its tensors in non-contiguous layouts (transposed, sliced,
expanded, storage offset, channels-last: tests/conformance_layouts.py, which also holds the
one table of deliberate skips).

Note: low-precision tolerance
    float16 and bfloat16 use the defaults torch's own OpInfo tests use (`assertEqual` and
    `assert_close`): rtol 1e-3, atol 1e-5 for float16 (1 to 2 ulps: eps is 2**-10) and rtol
    1.6e-2, atol 1e-5 for bfloat16 (2 to 4 ulps: eps is 2**-7); inductor's OpInfo test also
    compares its float16/bfloat16 results with these against a reference computed in higher
    precision, like the second chance here. Both sides compute in float32 and round to the
    dtype, so an exactly rounded op agrees bit for bit and a transcendental one to an ulp
    (tests/test_lowp.py asserts those tighter bounds; this sweep looks for wrong semantics).
    Where the graph ember receives rounds in more places than eager's single kernel (dynamo
    splits addcdiv(value=) into div, mul and add, each rounded), the third chance compares
    with that graph run eagerly: ember answers for the graph it is given. Per-op tolerances
    (`LOW_PRECISION_OVERRIDES`) remain possible, each with its reason; none is needed now.

Ops run in worker subprocesses (`--worker`), one op at a time from a shared queue, so a
segfault or a hang is recorded as a crash and the worker is restarted for the rest. The
same `run_op` runs in-process for the fast subset in tests/test_opinfo.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tests.conformance_layouts import VARIANTS, relayout, skip_reason

STATUSES = ("pass", "no graph", "mismatch", "error", "crash", "skip")
# worst first: an op's status is the worst of its samples' (a crash is recorded by the parent)
SEVERITY = {"crash": -1, "error": 0, "mismatch": 1, "pass": 2, "no graph": 3, "skip": 4}

RANDOM_WORDS = {"rand", "randn", "randint", "dropout", "dropout2d", "dropout3d", "bernoulli", "normal",
                "multinomial", "uniform", "exponential", "geometric", "cauchy"}  # fmt: skip
# names holding a random word that are deterministic all the same
NOT_RANDOM = {"__rand__", "signal.windows.exponential", "native_dropout_backward"}


@dataclass
class SampleResult:
    status: str
    reason: str = ""
    graphs: int = 0
    fallback_calls: int = 0
    fallback_ops: dict[str, int] = field(default_factory=dict)
    index: int = 0  # which of the op's samples
    variant: str = "contiguous"  # its layout (tests/conformance_layouts.py)


@dataclass
class OpResult:
    """One op in one layout variant (the unit a worker runs), or all of an op's variants merged."""

    op: str
    status: str
    reason: str = ""
    samples: list[SampleResult] = field(default_factory=list)
    seconds: float = 0.0
    variant: str = "contiguous"

    @property
    def graphs(self) -> int:
        return sum(s.graphs for s in self.samples)

    @property
    def fallback_ops(self) -> Counter:
        total: Counter = Counter()
        for s in self.samples:
            total.update(s.fallback_ops)
        return total


# (rtol, atol) by (OpInfo key, dtype): see Note: low-precision tolerance
LOW_PRECISION_OVERRIDES: dict[tuple[str, torch.dtype], tuple[float, float]] = {}


def tolerance(key: str, dtype: torch.dtype) -> tuple[float, float] | None:
    """(rtol, atol) for this op's outputs of `dtype`; None: assert_close's default."""
    return LOW_PRECISION_OVERRIDES.get((key, dtype))


# ---- the op database ------------------------------------------------------------------------


def op_key(opinfo) -> str:
    """`name` or `name.variant`: unique across op_db."""
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def load_ops(dtype: torch.dtype, names: list[str] | None = None) -> dict[str, Any]:
    """OpInfos supporting `dtype` on CPU, by key; `names` selects by key or by plain name."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = {op_key(o): o for o in op_db if o.supports_dtype(dtype, "cpu")}
    if names is None:
        return ops
    chosen = {k: o for k, o in ops.items() if k in names or o.name in names}
    unknown = set(names) - set(chosen) - {o.name for o in chosen.values()}
    if unknown:
        raise SystemExit(f"no OpInfo supporting {dtype} on cpu named {sorted(unknown)}")
    return chosen


def values_are_random(opinfo) -> bool:
    """Random ops and ops returning uninitialized memory: compare shapes and dtypes only."""
    key = op_key(opinfo)
    if key in NOT_RANDOM or opinfo.name in NOT_RANDOM:
        return False
    words = set(re.split(r"[._]", opinfo.name))
    return bool(words & RANDOM_WORDS) or "empty" in words


# ---- one op, in this process ----------------------------------------------------------------


def run_op(opinfo, dtype: torch.dtype, samples: int = 0, variant: str = "contiguous", first: int = 0,
           only: tuple[int, ...] | None = None, progress: Callable[[int], None] | None = None) -> OpResult:  # fmt: skip
    """The op's sample inputs from `first` on (at most `samples` of them, all when 0; or just the
    indices in `only`), in `variant`'s layout, eagerly and through ember. Samples are made
    from a fixed seed, so a sample's index names the same input in every process."""
    start = time.perf_counter()
    key = op_key(opinfo)
    skipped = skip_reason(key, dtype, variant)
    if skipped:
        return OpResult(key, "skip", f"SKIPS: {skipped}", variant=variant)
    torch.manual_seed(0)
    try:
        inputs = list(opinfo.sample_inputs("cpu", dtype, requires_grad=False))
    except Exception as e:
        return OpResult(key, "skip", f"sample_inputs raised {one_line(e)}", variant=variant)
    chosen = [i for i in (range(len(inputs)) if only is None else only) if first <= i < len(inputs)]
    chosen = chosen[:samples] if samples else chosen
    results = []
    for index in chosen:
        if progress is not None:
            progress(index)
        result = run_sample(opinfo, inputs[index], dtype, variant)
        if result is not None:  # None: the variant leaves this sample's layout as it was
            result.index, result.variant = index, variant
            results.append(result)
    status, reason = op_status(results)
    return OpResult(key, status, reason or ("" if inputs else "no samples"), results,
                    time.perf_counter() - start, variant)  # fmt: skip


def op_status(results: list[SampleResult]) -> tuple[str, str]:
    """The worst sample's status, with its reason and which sample (and layout) it was."""
    if not results:
        return "skip", "no samples in this layout"
    worst = min(results, key=lambda r: (SEVERITY[r.status], r.variant != "contiguous", r.index))
    if worst.status == "no graph" and any(r.status == "pass" for r in results):
        return "pass", ""
    if worst.status == "skip":
        return "skip", worst.reason
    where = f"sample {worst.index}" + ("" if worst.variant == "contiguous" else f" {worst.variant}")
    return worst.status, f"{where}: {worst.reason}" if worst.reason else ""


def run_sample(opinfo, sample, dtype: torch.dtype, variant: str = "contiguous") -> SampleResult | None:
    import ember

    (args, kwargs), changed = relayout(((sample.input, *sample.args), sample.kwargs), variant)
    if not changed:
        return None
    if skipped := skip_reason(op_key(opinfo), dtype, variant, sample):
        return SampleResult("skip", f"SKIPS: {skipped}")
    with sweep_environment():
        try:
            expected = opinfo.op(*clone(args), **clone(kwargs))
        except Exception as e:
            return SampleResult("skip", f"eager raises {one_line(e)}")
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        ember.metrics.reset()
        compiled = torch.compile(lambda *a, **k: opinfo.op(*a, **k), backend="ember", dynamic=False, fullgraph=False)
        try:
            actual = compiled(*clone(args), **clone(kwargs))
            error = None
        except Exception as e:
            error = describe_error(e)
    metrics = ember.metrics
    result = SampleResult("pass", "", metrics.graphs_compiled, metrics.fallback_calls, dict(metrics.fallback_ops))
    if error is not None:
        result.status, result.reason = "error", error
        return result
    references = [lambda: float64_reference(opinfo, args, kwargs, dtype),
                  lambda: graph_reference(opinfo, args, kwargs)]  # fmt: skip
    with sweep_environment():
        tol = tolerance(op_key(opinfo), dtype)
        result.status, result.reason = compare(actual, expected, references, values_are_random(opinfo), tol)
    if result.status == "pass" and result.graphs == 0:
        result.status, result.reason = "no graph", graph_break_reason()
    torch._dynamo.reset()
    return result


# Strict: a graph that fails to compile is an error, not a silent eager run. No whole-graph
# cache: a graph compiled by an older ember would hide a change to lowering (kernels, cached
# by their source, are safe to share). Random ops call aten, so their values are eager's.
# Every kernel is checked against the IR spec (uop/spec.py) after each codegen step, as in
# the test suite: a spec violation is an error of the op that produced it.
SWEEP_ENVIRONMENT = {"EMBER_STRICT": "1", "EMBER_GRAPH_CACHE": "0", "EMBER_FALLBACK_RANDOM": "1", "EMBER_CHECK_IR": "1"}


@contextlib.contextmanager
def sweep_environment():
    old = {name: os.environ.get(name) for name in SWEEP_ENVIRONMENT}
    os.environ.update(SWEEP_ENVIRONMENT)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def clone(tree):
    """A fresh copy of every tensor in its own layout (strides, storage offset, stride 0), so an
    op that writes its inputs cannot affect another run and the layout variant survives."""
    return tree_map(lambda x: clone_layout(x) if isinstance(x, torch.Tensor) and x.layout == torch.strided else x, tree)


def clone_layout(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        storage = x.untyped_storage().clone()
        copy = torch.empty(0, dtype=x.dtype, device=x.device).set_(storage, x.storage_offset(), x.shape, x.stride())
    return copy.requires_grad_(x.requires_grad) if x.requires_grad else copy


def float64_reference(opinfo, args, kwargs, dtype: torch.dtype):
    """Eager on inputs upcast to float64 (and `dtype=` arguments of `dtype` widened: linspace
    computes in the dtype it is asked for), cast back to `dtype`; None where that does not apply."""
    if not dtype.is_floating_point or dtype == torch.float64:
        return None

    def up(x):
        if isinstance(x, torch.Tensor) and x.dtype == dtype:
            return x.to(torch.float64)
        return torch.float64 if x is dtype else x

    try:
        result = opinfo.op(*tree_map(up, clone(args)), **tree_map(up, clone(kwargs)))
    except Exception:
        return None
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype == torch.float64 else x, result)


def graph_reference(opinfo, args, kwargs):
    """The aten graph that dynamo and AOTAutograd hand to ember, run eagerly op by op
    (`aot_eager`: no decompositions of ember's); None where that fails. Where dynamo splits
    an op (addcdiv(value=) is div, mul and add), each piece rounds to a low-precision dtype,
    where eager's one kernel rounds once: ember answers for the graph it gets, not for that
    (Note: low-precision tolerance)."""
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda *a, **k: opinfo.op(*a, **k), backend="aot_eager", dynamic=False)
        return compiled(*clone(args), **clone(kwargs))
    except Exception:
        return None
    finally:
        torch._dynamo.reset()


def graph_break_reason() -> str:
    """Why dynamo handed ember no graph: its first graph break, in the break's own words."""
    breaks = list(torch._dynamo.utils.counters["graph_break"])
    if not breaks:
        return "dynamo traced no op"
    lines = [line.strip() for line in breaks[0].splitlines() if line.strip()]
    explanation = next((line for line in lines if line.startswith("Explanation:")), "")
    return " ".join(f"{lines[0]}. {explanation}".split())[:200]


def one_line(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_error(e: BaseException) -> str:
    """The innermost ember error in the chain (else the root cause), on one line."""
    from ember.errors import EmberError

    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or getattr(e, "inner_exception", None) or e.__context__
    ember_errors = [x for x in chain if isinstance(x, EmberError)]
    innermost = ember_errors[-1] if ember_errors else chain[-1]
    compiler_error = re.search(r"error: .*", str(innermost))  # a gcc failure: its first error
    if compiler_error and "gcc failed" in str(innermost):
        return one_line(innermost, 120) + " " + compiler_error.group(0)[:150]
    return one_line(innermost, 300)


# ---- comparing outputs ----------------------------------------------------------------------


def compare(actual, expected, references: list[Callable[[], Any]], shapes_only: bool,
            tol: tuple[float, float] | None = None) -> tuple[str, str]:  # fmt: skip
    """("pass", "") or (status, a one-line reason); `tol`: (rtol, atol) instead of the default.
    A float output that differs from `expected` passes when it agrees with one of the
    `references` (each computed on first need)."""
    got, got_spec = tree_flatten(actual)
    want, want_spec = tree_flatten(expected)
    if len(got) != len(want):
        return "mismatch", f"{len(got)} outputs, eager gives {len(want)}"
    if any(isinstance(w, torch.Tensor) and w.layout != torch.strided for w in want):
        return "skip", "eager output is not a strided tensor"
    if not all(isinstance(w, (torch.Tensor, int, float, bool, complex, type(None), torch.dtype)) for w in want):
        return "skip", f"eager output holds a {type(next(w for w in want if not isinstance(w, torch.Tensor))).__name__}"
    computed: dict[int, list] = {}
    for i, (g, w) in enumerate(zip(got, want)):
        problem = compare_one(g, w, shapes_only, tol)
        for r, reference in enumerate(references if problem and isinstance(w, torch.Tensor) else []):
            if not w.is_floating_point():
                break
            if r not in computed:
                computed[r] = tree_flatten(reference())[0]
            other = computed[r]
            if len(other) == len(want) and not compare_one(g, other[i], shapes_only, tol):
                problem = ""  # closer to the float64 result, or to the graph's own roundings
                break
        if problem:
            return "mismatch", f"output {i}: {problem}"
    return "pass", ""


def compare_one(got, want, shapes_only: bool, tol: tuple[float, float] | None = None) -> str:
    if not isinstance(want, torch.Tensor):
        if isinstance(want, float) and isinstance(got, (int, float)):
            close = got == want or (got != got and want != want) or math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6)
            return "" if close else f"{got!r}, eager {want!r}"
        return "" if got == want or (want != want and got != got) else f"{got!r}, eager {want!r}"
    if not isinstance(got, torch.Tensor):
        return f"a {type(got).__name__}, eager gives a tensor"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, eager {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, eager {want.dtype}"
    if shapes_only or got.numel() == 0:
        return ""
    if want.is_floating_point() or want.is_complex():
        try:
            rtol, atol = tol if tol is not None and want.dtype in (torch.float16, torch.bfloat16) else (None, None)
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, check_device=False,
                                       check_stride=False)  # fmt: skip
        except AssertionError:
            return float_difference(got, want, rtol, atol)
        return ""
    if not torch.equal(got, want):
        return "values differ from eager " + first_difference(got != want, got, want)
    return ""


def float_difference(got: torch.Tensor, want: torch.Tensor, rtol: float | None, atol: float | None) -> str:
    """The element furthest beyond `assert_close`'s tolerance (not the largest difference, which
    may be within it), and how many are beyond."""
    g, w = got.detach().double(), want.detach().double()
    nan_differs = g.isnan() != w.isnan()
    if nan_differs.any():
        return "NaN where eager is not, or the reverse " + first_difference(nan_differs, g, w)
    if rtol is None or atol is None:
        from torch.testing._comparison import default_tolerances

        rtol, atol = default_tolerances(want)
    diff = (g - w).abs().nan_to_num(nan=0.0, posinf=math.inf)
    diff[(g == w) | (g.isnan() & w.isnan())] = 0  # equal infinities, NaN in both
    excess = diff / (atol + rtol * w.abs().nan_to_num(nan=0.0, posinf=0.0))
    where = divmod_index(int(excess.argmax()), g.shape)
    beyond = int((excess > 1).sum())
    return (f"{beyond} of {g.numel()} beyond tolerance; worst at {where}: {g[where].item():.7g}, eager "
            f"{w[where].item():.7g} (max abs diff {diff.max().item():.3g})")  # fmt: skip


def first_difference(differs: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> str:
    where = tuple(differs.nonzero()[0].tolist())
    return f"(first at {list(where)}: {got[where].item()}, eager {want[where].item()})"


def divmod_index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


# ---- workers --------------------------------------------------------------------------------


def worker_main(dtype: torch.dtype, samples: int) -> None:
    """Reads units `key<TAB>variant<TAB>first sample` from stdin, one per line; writes one JSON
    result per line to the real stdout. Anything else printed (also by C code) goes to stderr,
    i.e. the worker's log, where `=== key variant sample N` marks each sample as it starts (so
    the parent can name the sample that killed a worker)."""
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    ops = load_ops(dtype)
    print("ready", file=results, flush=True)
    for line in sys.stdin:
        key, variant, first = line.rstrip("\n").split("\t")
        print(f"=== {key} {variant}", file=sys.stderr, flush=True)
        log = lambda i: print(f"=== {key} {variant} sample {i}", file=sys.stderr, flush=True)  # noqa: E731
        result = run_op(ops[key], dtype, samples, variant, first=int(first), progress=log)
        print(json.dumps(asdict(result)), file=results, flush=True)


class Worker:
    """One worker subprocess; `run(unit)` gives its result or raises `WorkerDied`."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], log_path: str):
        self.log_path = log_path
        self.log = open(log_path, "a")
        command = [sys.executable, "-m", "tests.conformance", "--worker", "--dtype", args.dtype,
                   "--samples", str(args.samples)]  # fmt: skip
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        env=env, text=True, start_new_session=True)  # fmt: skip
        self.read_line(timeout=300)  # "ready" once op_db is imported

    def run(self, unit: tuple[str, str, int], timeout: float) -> OpResult:
        try:
            self.process.stdin.write("\t".join(map(str, unit)) + "\n")
            self.process.stdin.flush()
        except OSError as e:  # it died after its last op
            raise WorkerDied(f"worker gone before the op started ({e})", None) from e
        record = json.loads(self.read_line(timeout))
        record["samples"] = [SampleResult(**s) for s in record["samples"]]
        return OpResult(**record)

    def read_line(self, timeout: float) -> str:
        """The worker's next line; it dies when `timeout` passes with no new sample started
        (the timeout is per sample: an op may have hundreds)."""
        sample = self.last_sample() if self.process.poll() is None else None
        while True:
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if ready:
                break
            now = self.last_sample()
            if now == sample or now is None:
                self.stop()
                raise WorkerDied(f"timed out after {timeout:g} s on one sample", now)
            sample = now
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise WorkerDied(f"worker died ({signal_name(code)}){self.last_log_line()}", self.last_sample())
        return line

    def log_lines(self) -> list[str]:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return [x.strip() for x in f.readlines()[-200:] if x.strip()]

    def last_log_line(self) -> str:
        lines = [x for x in self.log_lines() if not x.startswith("===")]
        return f": {lines[-1][:200]}" if lines else ""

    def last_sample(self) -> int | None:
        """The sample the worker was running when it died (from its log's markers)."""
        marks = [x for x in self.log_lines() if x.startswith("===")]
        found = re.search(r" sample (\d+)$", marks[-1]) if marks else None
        return int(found.group(1)) if found else None

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: it and the compilers it started
            self.process.wait()
        self.log.close()


class WorkerDied(Exception):
    def __init__(self, message: str, sample: int | None):
        super().__init__(message)
        self.sample = sample  # the sample it died on, when known


def signal_name(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def worker_env(cache_dir: str) -> dict[str, str]:
    env = dict(os.environ, EMBER_CACHE_DIR=cache_dir, **SWEEP_ENVIRONMENT)
    # the machine is shared: one thread per worker for kernels, aten and gcc
    for name in ("OMP_NUM_THREADS", "EMBER_COMPILE_THREADS"):
        env.setdefault(name, "1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


Unit = tuple[str, str, int]  # (op key, variant, first sample)


def sweep(units: list[tuple[str, str]], args: argparse.Namespace, cache_dir: str, log_dir: str,
          record: Callable[[OpResult], None]) -> list[OpResult]:  # fmt: skip
    """J threads, each feeding one worker process from a shared queue of (op, variant) units.
    A worker that dies on a sample is replaced, and the unit goes on from the next sample."""
    todo: queue.Queue[Unit] = queue.Queue()
    for key, variant in units:
        todo.put((key, variant, 0))
    parts: dict[tuple[str, str], list[OpResult]] = {}
    results: list[OpResult] = []
    lock = threading.Lock()
    env = worker_env(cache_dir)

    def feed(index: int) -> None:
        worker = None
        while True:
            try:
                unit = todo.get_nowait()
            except queue.Empty:
                break
            start = time.perf_counter()
            try:
                worker = worker or Worker(args, env, os.path.join(log_dir, f"worker{index}.log"))
                part, resume = worker.run(unit, args.timeout), None
            except Exception as e:  # WorkerDied, or anything that breaks the pipe to it
                if not isinstance(e, WorkerDied):
                    if worker is not None:
                        worker.stop()
                    e = WorkerDied(f"worker lost: {one_line(e)}", None)
                part, resume, worker = crashed(unit, e, time.perf_counter() - start), None, None
                if e.sample is not None:
                    resume = (unit[0], unit[1], e.sample + 1)
            with lock:
                parts.setdefault(unit[:2], []).append(part)
                if resume is not None:
                    todo.put(resume)
                    continue
                result = merge_parts(parts.pop(unit[:2]))
                results.append(result)
                record(result)
                report_progress(result, len(results), len(units), args.verbose)
        if worker is not None:
            worker.stop()

    threads = [threading.Thread(target=feed, args=(i,)) for i in range(max(1, args.jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def crashed(unit: Unit, e: WorkerDied, seconds: float) -> OpResult:
    key, variant, _ = unit
    sample = [SampleResult("crash", str(e), index=e.sample, variant=variant)] if e.sample is not None else []
    return OpResult(key, "crash", str(e), sample, seconds, variant)


def merge_parts(parts: list[OpResult]) -> OpResult:
    """One unit's result from the parts a crash split it into."""
    if len(parts) == 1:
        return parts[0]
    samples = sorted((s for p in parts for s in p.samples), key=lambda s: s.index)
    status, reason = op_status(samples) if samples else ("crash", parts[0].reason)
    return OpResult(parts[0].op, status, reason, samples, sum(p.seconds for p in parts), parts[0].variant)


def report_progress(result: OpResult, done: int, total: int, verbose: bool) -> None:
    name = result.op + ("" if result.variant == "contiguous" else f" [{result.variant}]")
    if verbose or result.status in ("mismatch", "error", "crash"):
        reason = f"  {result.reason}" if result.reason and result.status != "pass" else ""
        print(f"[{done}/{total}] {name}: {result.status} ({result.seconds:.1f}s){reason}", flush=True)
    elif done % 25 == 0:
        print(f"[{done}/{total}] ...", flush=True)


# ---- the report -----------------------------------------------------------------------------


def print_report(units: list[OpResult], dtype: torch.dtype) -> None:
    results = merge_by_op(units)
    by_status = {s: [r for r in results if r.status == s] for s in STATUSES}
    print(f"\n==== OpInfo conformance, {dtype}, {len(results)} ops")
    print_fallbacks(results)
    for status in ("mismatch", "error", "crash"):
        failing = [u for u in units if u.status == status]
        if failing:
            print(f"\n-- {status}: {len({u.op for u in failing})} ops, {len(failing)} (op, layout) pairs")
            for u in failing:
                print(f"  {u.op} [{u.variant}]: {u.reason}")
    if by_status["no graph"]:
        print(f"\n-- no graph reached ember ({len(by_status['no graph'])}), by dynamo's reason")
        reasons: dict[str, list[str]] = {}
        for r in by_status["no graph"]:
            reasons.setdefault(r.reason.partition(": ")[2] or r.reason, []).append(r.op)
        for reason, ops in sorted(reasons.items(), key=lambda item: -len(item[1])):
            print(f"  {reason}: {', '.join(ops)}")
    skips = Counter(skip_family(r.reason) for r in by_status["skip"])
    if skips:
        print(f"\n-- skip ({len(by_status['skip'])}): " + "; ".join(f"{why} x{n}" for why, n in skips.most_common()))
    deliberate = [(u, "", u.reason) for u in units if u.reason.startswith("SKIPS: ")]
    for u in units:  # skips of some samples only (a SKIPS entry with `when`)
        if skipped := [r for r in u.samples if r.reason.startswith("SKIPS: ")]:
            deliberate.append((u, " samples " + ", ".join(str(r.index) for r in skipped), skipped[0].reason))
    if deliberate:
        print(f"\n-- deliberate skips ({len(deliberate)}), from SKIPS in tests/conformance_layouts.py")
        for u, which, reason in deliberate:
            print(f"  {u.op} [{u.variant}]{which}: {reason.removeprefix('SKIPS: ')}")
    print_layout_table(units)
    print_totals(results, by_status)


def merge_by_op(units: list[OpResult]) -> list[OpResult]:
    """One result per op over all its layouts: the worst sample of any layout decides."""
    by_op: dict[str, list[OpResult]] = {}
    for u in units:
        by_op.setdefault(u.op, []).append(u)
    merged = []
    for op, parts in by_op.items():
        samples = [s for p in parts for s in p.samples]
        first = min(parts, key=lambda p: VARIANTS.index(p.variant) if p.variant in VARIANTS else 0)
        status, reason = op_status(samples) if samples else (first.status, first.reason)
        if status == "skip" and not samples:
            status, reason = first.status, first.reason
        merged.append(OpResult(op, status, reason, samples, sum(p.seconds for p in parts), "all"))
    return merged


def print_layout_table(units: list[OpResult]) -> None:
    """Sample runs by layout and status: what the sweep covered."""
    counts: dict[str, Counter] = {}
    for u in units:
        counts.setdefault(u.variant, Counter()).update(s.status for s in u.samples)
    print("\n-- sample runs by layout")
    print(f"  {'layout':14s}" + "".join(f"{s:>10s}" for s in STATUSES) + f"{'total':>10s}")
    for variant in sorted(counts, key=lambda v: VARIANTS.index(v) if v in VARIANTS else 99):
        row = counts[variant]
        print(f"  {variant:14s}" + "".join(f"{row[s]:10d}" for s in STATUSES) + f"{sum(row.values()):10d}")


def print_fallbacks(results: list[OpResult]) -> None:
    on_fallback = [r for r in results if r.fallback_ops and r.status not in ("skip", "crash")]
    print(f"\n-- ops still on fallback externs ({len(on_fallback)})")
    for r in on_fallback:
        print(f"  {r.op} [{r.status}]: {', '.join(sorted(r.fallback_ops))}")
    by_aten: dict[str, list[str]] = {}
    for r in on_fallback:
        for aten_op in r.fallback_ops:
            by_aten.setdefault(aten_op, []).append(r.op)
    print(f"\n-- fallback aten ops ({len(by_aten)}), by the number of OpInfo ops hitting them")
    for aten_op, ops in sorted(by_aten.items(), key=lambda item: (-len(item[1]), item[0])):
        print(f"  {aten_op} ({len(ops)}): {', '.join(ops)}")


def skip_family(reason: str) -> str:
    """A skip reason without its details, to count skips by kind."""
    return reason.split(":")[0].split("(")[0].strip() or "skip"


def print_totals(results: list[OpResult], by_status: dict[str, list[OpResult]]) -> None:
    print("\n==== totals")
    for status in STATUSES:
        print(f"  {status:9s} {len(by_status[status]):5d}")
    tested = [r for r in results if r.status != "skip"]
    compiled = [r for r in tested if r.graphs > 0 and r.status in ("pass", "mismatch")]
    clean = [r for r in compiled if r.status == "pass" and not r.fallback_ops]
    print(f"  ops tested (not skipped): {len(tested)}")
    samples = {(r.op, s.index) for r in results for s in r.samples}
    runs = sum(len(r.samples) for r in results)
    print(f"  samples: {len(samples)}; sample runs over all layouts: {runs}")
    if tested:
        print(f"  passed with no fallback extern at all: {len(clean)} of {len(tested)} tested "
              f"({100 * len(clean) / len(tested):.1f}%)")  # fmt: skip
    if compiled:
        share = 100 * sum(1 for r in compiled if not r.fallback_ops) / len(compiled)
        print(f"  of the {len(compiled)} ops whose graphs compiled and ran, {share:.1f}% used no fallback extern")


# ---- entry point ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32",
                        help="torch dtype names, comma-separated: float32,bfloat16,float16,int64,bool")  # fmt: skip
    parser.add_argument("--ops", help="comma-separated OpInfo names (name or name.variant); default: all")
    parser.add_argument("--slice", default="0/1", help="I/N: only the I-th of N equal slices of the ops (0-based)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated layouts, of: {', '.join(VARIANTS)}")  # fmt: skip
    parser.add_argument("--samples", type=int, default=0, help="at most N sample inputs per op; 0: all")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds one sample may take before it counts as a crash")  # fmt: skip
    parser.add_argument("--results", help="a JSON-lines file: each (op, layout) result is appended as it comes, "
                        "and those already there are not run again (resume a sweep, run it in slices)")  # fmt: skip
    parser.add_argument("--json", help="write every (op, layout) result here at the end")
    parser.add_argument("--cache-dir", help="ember's kernel cache for the workers (default: a fresh temp dir)")
    parser.add_argument("--verbose", action="store_true", help="print every op's result as it comes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.strip(), None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"--dtype {name!r} is not a torch dtype")
    return dtype


def parse_variants(text: str) -> list[str]:
    variants = [v.strip() for v in text.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown layout(s) {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    return variants


def op_slice(keys: list[str], text: str) -> list[str]:
    index, count = (int(x) for x in text.split("/"))
    return keys[index::count]


def load_results(path: str | None, dtype: torch.dtype) -> dict[tuple[str, str], OpResult]:
    """The (op, layout) results a `--results` file already holds for `dtype`."""
    done: dict[tuple[str, str], OpResult] = {}
    if not path or not os.path.exists(path):
        return done
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.pop("dtype") == str(dtype):
                record["samples"] = [SampleResult(**s) for s in record["samples"]]
                result = OpResult(**record)
                done[(result.op, result.variant)] = result
    return done


def run_dtype(dtype: torch.dtype, args: argparse.Namespace, scratch: str) -> list[OpResult]:
    keys = op_slice(list(load_ops(dtype, args.ops.split(",") if args.ops else None)), args.slice)
    variants = parse_variants(args.variants)
    done = load_results(args.results, dtype)
    units = [(k, v) for k in keys for v in variants]
    todo = [u for u in units if u not in done]
    print(f"{len(keys)} OpInfo ops support {dtype} on cpu; {len(units)} (op, layout) pairs, {len(todo)} to run; "
          f"{args.jobs} workers; worker logs in {scratch}", flush=True)  # fmt: skip
    lock = threading.Lock()

    def record(result: OpResult) -> None:
        if args.results:
            with lock, open(args.results, "a") as f:
                f.write(json.dumps({"dtype": str(dtype), **asdict(result)}) + "\n")

    args.dtype = str(dtype).removeprefix("torch.")
    cache_dir = args.cache_dir or os.path.join(scratch, "cache")
    fresh = sweep(todo, args, cache_dir, scratch, record) if todo else []
    by_unit = {**done, **{(r.op, r.variant): r for r in fresh}}
    return [by_unit[u] for u in units if u in by_unit]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtypes = [parse_dtype(name) for name in args.dtype.split(",")]
    if args.worker:
        worker_main(dtypes[0], args.samples)
        return 0
    scratch = tempfile.mkdtemp(prefix="ember-conformance-")
    start = time.perf_counter()
    everything = []
    for dtype in dtypes:
        results = run_dtype(dtype, args, scratch)
        print_report(results, dtype)
        everything += [{"dtype": str(dtype), **asdict(r)} for r in results]
    print(f"  wall time: {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)
    if not any(r["status"] == "crash" for r in everything):
        shutil.rmtree(scratch, ignore_errors=True)  # keep the logs of crashed workers
    return 0


if __name__ == "__main__":
    sys.exit(main())
