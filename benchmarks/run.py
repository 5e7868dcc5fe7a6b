"""The side-by-side benchmark: eager vs inductor vs ember on every workload of `benchmarks.suite`.

    python -m benchmarks.run [--models a,b] [--compilers eager,ember] [--repeat N] [--json out.json]
                             [--quick] [--strict] [--no-warm] [--device cuda]

`--device cuda` runs every workload on the GPU at GPU sizes (batch x16, `on_device`), TF32
off for every compiler, synchronizing after each timed call; benchmarks/gpu.py adds the
per-kernel bandwidth and peak-memory reports.

For each workload, in one process:
    1. cold compile: each compiler's first call, timed, with empty caches (a fresh
       TORCHINDUCTOR_CACHE_DIR, EMBER_CACHE_DIR and TRITON_CACHE_DIR per workload, dynamo reset
       between workloads; on the GPU it includes compiling and tuning the Triton kernels);
       ember's metrics are reset first and read after, for kernel and fallback counts
    2. correctness: each compiled result against a float64-upcast eager reference (eager float32
       where float64 fails), within rtol = atol = 1e-3; the max abs error is kept
    3. timing: warm-up calls, then round-robin samples (eager, inductor, ember, in rotating
       order, so load on the machine hits all alike); the median is reported
    4. warm compile (ember): a fresh subprocess (`--compile-only`) compiles the same workload
       with the cache that step 1 filled
A failure of one compiler on one workload is recorded in its row; the run goes on.

Note: compile time
    Each process first compiles a trivial function with every compiler (into a throwaway
    cache), so that one-time costs (imports, starting compile workers) are not charged to
    whichever workload happens to come first. Cold compile time is the first call of the
    compiled model: dynamo tracing, AOTAutograd, codegen, the C++ compiler, and one run.
    Warm compile time is the same first call in a new process whose ember cache holds the
    workload (building the model and importing packages are not in it). The details split
    both by `ember.metrics.compile_seconds`: ember's own stages, AOTAutograd, and the rest
    (dynamo's tracing and guards, and the run), which no ember cache can skip.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

import ember
from benchmarks import real_models, suite
from ember.errors import EmberError

COMPILERS = ("eager", "inductor", "ember", "ember_dynamic", "inductor_dynamic")
DEFAULT_COMPILERS = ("eager", "inductor", "ember")


def compiled_with(compiler: str, fn: Callable, mode: str | None = None) -> Callable:
    """`fn` under torch.compile with `compiler`'s backend. `ember_dynamic` is ember with
    `dynamic=True`: its graphs are compiled once with symbolic sizes (Note: symbolic sizes), run
    here at the workload's one shape, so its time against ember's is the cost of symbolic kernels;
    `inductor_dynamic` is the same for inductor, the peer's cost of them."""
    dynamic = compiler.endswith("_dynamic")
    return torch.compile(fn, backend=compiler.removesuffix("_dynamic"), dynamic=dynamic, mode=mode)


# --suite: the registry of workloads (benchmarks/README.md)
SUITES: dict[str, dict[str, Callable[[bool], Any]]] = {"default": suite.WORKLOADS, "real": real_models.WORKLOADS}
RTOL = ATOL = 1e-3
MIN_ROUNDS = 5  # timing rounds always taken, whatever the time budget
COMPILE_ONLY_TAG = "compile-only-result: "
REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_CHANGED = "ember's source changed since the cold compile: no warm time"


@dataclass
class ModelResult:
    """One row of the table; every field is plain data so the row goes to JSON as it is."""

    name: str
    ms: dict[str, float] = field(default_factory=dict)  # compiler -> ms of one call (--statistic)
    median_ms: dict[str, float] = field(default_factory=dict)
    min_ms: dict[str, float] = field(default_factory=dict)
    samples: int = 0  # timing samples per compiler
    compile_s: dict[str, float] = field(default_factory=dict)  # cold: first call, empty caches
    warm_compile_s: float | None = None  # ember, new process, cache filled
    correct: dict[str, bool] = field(default_factory=dict)
    max_error: dict[str, float] = field(default_factory=dict)  # max abs error vs the reference
    reference: str = "float64"  # what results were compared with
    errors: dict[str, str] = field(default_factory=dict)  # compiler -> first line of its error
    ember_metrics: dict[str, Any] = field(default_factory=dict)
    ember_warnings: list[str] = field(default_factory=list)  # graphs ember ran eagerly, and why
    graph_breaks: int = 0
    dynamic_graphs: dict[str, Any] = field(default_factory=dict)  # ember_dynamic: how its graphs compiled
    dynamic_compile_seconds: dict[str, float] = field(default_factory=dict)  # ember_dynamic: its stages
    gb_per_s: dict[str, float] = field(default_factory=dict)  # only for memory-bound micro-benchmarks


# ---------------------------------------------------------------------------------------------
# Running one workload


def make_step(model: Callable, workload: suite.Workload, inputs: tuple | None = None) -> Callable[[], Any]:
    """A no-argument call of `model` on the workload's inputs: under no_grad for inference; for
    training the whole step (zero grads, loss, backward), returning the loss and the gradients."""
    args = workload.inputs if inputs is None else inputs
    if not workload.is_training:

        def infer() -> Any:
            with torch.no_grad():
                return model(*args)

        return infer
    module = model if isinstance(model, torch.nn.Module) else workload.model
    params = [p for p in module.parameters() if p.requires_grad]

    def train_step() -> tuple[torch.Tensor, ...]:
        for p in params:
            p.grad = None
        loss = model(*args)
        loss.backward()
        return (loss.detach(), *(p.grad for p in params))

    return train_step


def optimizer_step(workload: suite.Workload, compiler: str, dtype: torch.dtype | None = None) -> Callable[[], Any]:
    """The whole training step of a workload with an optimizer (zero grads, loss, backward,
    `optimizer.step()`), on a fresh copy of its model and optimizer (in `dtype` if given), compiled
    as one function by `compiler`. Returns the loss; `step.state()` gives the parameters and their
    gradients."""
    module = copy.deepcopy(workload.model)
    module = module.to(dtype) if dtype is not None else module
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = workload.optimizer(params)  # type: ignore[misc]
    args = tree_map(upcast, workload.inputs) if dtype is torch.float64 else workload.inputs

    def whole_step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = module(*args)
        loss.backward()
        optimizer.step()
        return loss.detach()

    mode = COMPILE_MODE["mode"]
    step = whole_step if compiler == "eager" else compiled_with(compiler, whole_step, mode)

    def run() -> torch.Tensor:
        return step()

    # the gradients too: Adam's step is about lr whatever the gradient, so parameters after one step
    # hide a wrong gradient (a symbolic GPT-2 backward with gradients off by 5.6e3 moved no weight by
    # more than 2e-4, within the tolerance)
    def state() -> list[torch.Tensor]:
        return [p.detach().clone() for p in params] + [p.grad.clone() for p in params if p.grad is not None]

    run.state = state  # type: ignore[attr-defined]
    return run


def upcast(x: Any) -> Any:
    return x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def reference_outputs(workload: suite.Workload, eager_outputs: Any) -> tuple[Any, str]:
    """The workload run in float64 (a copy of the model), or eager float32 where that fails."""
    try:
        if workload.optimizer is not None:
            step = optimizer_step(workload, "eager", torch.float64)
            return (step(), *step.state()), "float64"  # type: ignore[attr-defined]
        model = workload.model
        if isinstance(model, torch.nn.Module):
            model = copy.deepcopy(model).double()
        return make_step(model, workload, tree_map(upcast, workload.inputs))(), "float64"
    except Exception as e:
        print(f"  note: float64 reference failed ({first_line(e)}); comparing with eager float32")
        return eager_outputs, "eager float32"


def compare(outputs: Any, reference: Any) -> tuple[bool, float]:
    """(all close within RTOL/ATOL, max abs error) over every tensor output."""
    got, _ = tree_flatten(outputs)
    want, _ = tree_flatten(reference)
    if len(got) != len(want):
        return False, math.inf
    ok, worst = True, 0.0
    for g, w in zip(got, want):
        if not isinstance(w, torch.Tensor):
            ok &= g == w
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape:
            return False, math.inf
        if not w.is_floating_point():
            ok &= bool(torch.equal(g, w))
            continue
        g64, w64 = g.detach().double(), w.detach().double()
        ok &= torch.allclose(g64, w64, rtol=RTOL, atol=ATOL, equal_nan=True)
        if g64.numel():
            difference = (g64 - w64).abs().masked_fill(g64.isnan() & w64.isnan(), 0.0)
            worst = max(worst, difference.nan_to_num(nan=math.inf).max().item())
    return bool(ok), worst


def compile_cold(workload: suite.Workload, compiler: str, result: ModelResult) -> tuple[Callable, Any] | None:
    """Compile and run once, timing it. Records the error and returns None when it fails."""
    if workload.optimizer is not None:  # each compiler steps its own copy of the model
        step = optimizer_step(workload, compiler)
    else:
        mode = COMPILE_MODE["mode"]
        model = workload.model if compiler == "eager" else compiled_with(compiler, workload.model, mode)
        step = make_step(model, workload)
    if compiler.startswith("ember"):
        ember.metrics.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        try:
            outputs = step()
        except Exception as e:
            result.errors[compiler] = describe_error(e)
            return None
        seconds = time.perf_counter() - start
        if workload.optimizer is not None:  # the loss, then the parameters after one update
            outputs = (outputs, *step.state())  # type: ignore[attr-defined]
    if compiler != "eager":
        result.compile_s[compiler] = seconds
    if compiler == "ember":
        result.ember_metrics = snapshot_ember_metrics()
        result.ember_warnings = [first_line(w.message) for w in caught if "ember" in str(w.message)]
    if compiler == "ember_dynamic":
        m = ember.metrics
        result.dynamic_graphs = {"symbolic": m.symbolic_graphs, "per shape": m.shape_specializations,
                                 "fallbacks": dict(m.symbolic_fallbacks),
                                 "guards added": len(m.size_guards)}  # fmt: skip
        result.dynamic_compile_seconds = dict(m.compile_seconds)
    return step, outputs


def snapshot_ember_metrics() -> dict[str, Any]:
    """Every counter of `ember.metrics`, as plain data (Counters become dicts)."""
    values = {f.name: getattr(ember.metrics, f.name) for f in fields(ember.metrics)}
    return {name: dict(value) if isinstance(value, dict) else value for name, value in values.items()}


def time_interleaved(steps: dict[str, Callable], warmup: int, repeat: int, budget_s: float) -> dict[str, list[float]]:
    """Seconds per call of each step, sampled round-robin in a rotating order. Stops after
    `repeat` rounds, or once `budget_s` has passed and MIN_ROUNDS are taken."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    names = list(steps)
    samples: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for round_index in range(repeat):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            begin = time.perf_counter()
            steps[name]()
            samples[name].append(time.perf_counter() - begin)
        if round_index + 1 >= MIN_ROUNDS and time.perf_counter() - start > budget_s:
            break
    return samples


def copy_step(workload: suite.Workload) -> Callable[[], Any]:
    """The bandwidth baseline: `copy_` of the first input into a preallocated tensor."""
    source = workload.inputs[0]
    destination = torch.empty_like(source)
    return lambda: destination.copy_(source)


GPU_BATCH_SCALE = 16
COMPILE_MODE = {"mode": None}  # --mode: torch.compile's mode for inductor and ember alike


def on_device(workload: suite.Workload, device: str, scale: int = GPU_BATCH_SCALE) -> suite.Workload:
    """The workload on `device`, every input repeated `scale` times along dim 0 (the batch; the
    element count of the 1-D micro-benchmarks)."""
    if device == "cpu":
        return workload
    model = workload.model.to(device) if isinstance(workload.model, torch.nn.Module) else workload.model
    inputs = tuple(
        x.repeat(scale, *[1] * (x.dim() - 1)).to(device) if isinstance(x, torch.Tensor) and x.dim() else x
        for x in workload.inputs
    )
    moved = workload.bytes_moved * scale if workload.bytes_moved is not None else None
    return workload._replace(model=model, inputs=inputs, bytes_moved=moved)


def synchronized(step: Callable[[], Any]) -> Callable[[], Any]:
    """A CUDA step that returns once the GPU finished it (so host timers time the GPU work)."""

    def run() -> Any:
        out = step()
        torch.cuda.synchronize()
        return out

    return run


def benchmark_workload(workload: suite.Workload, args: argparse.Namespace, cache_dir: Path) -> ModelResult:
    result = ModelResult(workload.name)
    steps: dict[str, Callable] = {}
    outputs: dict[str, Any] = {}
    for compiler in args.compilers:
        compiled = compile_cold(workload, compiler, result)
        if compiled is not None:
            steps[compiler], outputs[compiler] = compiled
            if args.device == "cuda":
                steps[compiler] = synchronized(steps[compiler])
    result.graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    if "eager" not in steps:
        return result
    reference, result.reference = reference_outputs(workload, outputs["eager"])
    for compiler, out in outputs.items():
        result.correct[compiler], result.max_error[compiler] = compare(out, reference)
    del outputs, reference
    if workload.bytes_moved is not None:
        steps["copy_"] = copy_step(workload) if args.device == "cpu" else synchronized(copy_step(workload))
    record_timings(result, steps, workload, args)
    if "ember" in steps and args.warm:
        result.warm_compile_s = warm_compile_seconds(workload.name, cache_dir / "ember", args, result)
    return result


def record_timings(result: ModelResult, steps: dict[str, Callable], workload: suite.Workload, args) -> None:
    try:
        samples = time_interleaved(steps, args.warmup, args.repeat, args.budget)
    except Exception as e:  # a compiled step that ran once but fails later: time the others
        failing = find_failing_step(steps)
        result.errors[failing] = f"while timing: {describe_error(e)}"
        del steps[failing]
        samples = time_interleaved(steps, args.warmup, args.repeat, args.budget)
    result.samples = min(len(s) for s in samples.values())
    for name, seconds in samples.items():
        result.median_ms[name] = statistics.median(seconds) * 1e3
        result.min_ms[name] = min(seconds) * 1e3
    result.ms = result.median_ms if args.statistic == "median" else result.min_ms
    if workload.bytes_moved is not None:
        copy_bytes = 2 * workload.inputs[0].numel() * workload.inputs[0].element_size()
        for name, ms in result.ms.items():
            moved = copy_bytes if name == "copy_" else workload.bytes_moved
            result.gb_per_s[name] = moved / (ms * 1e-3) / 1e9


def find_failing_step(steps: dict[str, Callable]) -> str:
    for name, step in steps.items():
        try:
            step()
        except Exception:
            return name
    return next(reversed(steps))


# ---------------------------------------------------------------------------------------------
# Caches and processes


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Sets environment variables for the block and restores them after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def fresh_compile_state(cache_dir: Path) -> None:
    """Empty caches for the next workload: new cache folders, dynamo and inductor in-memory state
    cleared. Triton's too: ember's Triton kernels compile into Triton's cache (and inductor's
    into this one when it is set), which would otherwise stay warm from earlier runs."""
    os.environ["EMBER_CACHE_DIR"] = str(cache_dir / "ember")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / "triton")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    inductor = sys.modules.get("torch._inductor.utils")  # nothing to clear if never imported
    if inductor is not None:
        inductor.clear_caches()


def warm_up_process(compilers: list[str], scratch: Path, device: str = "cpu") -> None:
    """Pays each compiler's one-time costs on a trivial function (Note: compile time)."""
    x = torch.randn(64, 64, device=device)
    for compiler in compilers:
        if compiler == "eager":
            continue
        fresh_compile_state(scratch / "warm-up")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                compiled_with(compiler, lambda t: torch.relu(t) * 2 + 1)(x)
            except Exception as e:
                print(f"note: warm-up compile with {compiler} failed: {first_line(e)}")
    torch._dynamo.reset()


def warm_compile_seconds(name: str, ember_cache: Path, args, result: ModelResult) -> float | None:
    """Ember's compile time in a new process whose cache already holds this workload's kernels."""
    command = [sys.executable, "-m", "benchmarks.run", "--suite", args.suite, "--models", name, "--compile-only"]
    command += ["--quick"] if args.quick else []
    command += ["--strict"] if args.strict else []
    command += ["--device", args.device, "--batch-scale", str(args.batch_scale), "--mode", args.mode]
    env = {**os.environ, "EMBER_CACHE_DIR": str(ember_cache)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    try:
        done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        result.errors["ember warm"] = "warm compile subprocess timed out after 900 s"
        return None
    for line in done.stdout.splitlines():
        if line.startswith(COMPILE_ONLY_TAG):
            report = json.loads(line[len(COMPILE_ONLY_TAG) :])
            if report["ember_source_hash"] != args.ember_source_hash:
                result.errors["ember warm"] = SOURCE_CHANGED
                return None
            result.ember_metrics["warm_code_cache_hits"] = report["code_cache_hits"]
            result.ember_metrics["warm_code_cache_misses"] = report["code_cache_misses"]
            result.ember_metrics["warm_compile_seconds"] = report["compile_seconds"]
            return report["seconds"]
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    result.errors["ember warm"] = f"warm compile subprocess failed (exit {done.returncode}): {tail}"
    return None


def compile_only(args: argparse.Namespace) -> None:
    """`--compile-only`: compile each workload with ember once, using the cache as it is, and
    print the first call's time as one JSON line (read by warm_compile_seconds)."""
    caches = {name: os.environ.get(name) for name in ("EMBER_CACHE_DIR", "TRITON_CACHE_DIR")}
    with tempfile.TemporaryDirectory(prefix="ember-bench-warm-up-") as scratch:
        warm_up_process(["ember"], Path(scratch), args.device)
    os.environ.update({name: value for name, value in caches.items() if value is not None})
    for name in args.models:
        workload = SUITES[args.suite][name](args.quick)
        if workload is None:
            continue
        workload = on_device(workload, args.device, args.batch_scale)
        result = ModelResult(name)
        if compile_cold(workload, "ember", result) is None:
            raise SystemExit(f"ember failed on {name}: {result.errors['ember']}")
        report = {"model": name, "seconds": result.compile_s["ember"], "ember_source_hash": ember_source_hash()}
        report.update(result.ember_metrics)
        print(COMPILE_ONLY_TAG + json.dumps(report), flush=True)


# ---------------------------------------------------------------------------------------------
# The whole run


def run_suite(args: argparse.Namespace) -> list[ModelResult]:
    results = []
    strict = "1" if args.strict else "0"
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ember-bench-")))
        # The cache folders set per workload do not outlive the run.
        stack.enter_context(environment(EMBER_STRICT=strict, EMBER_CACHE_DIR="", TORCHINDUCTOR_CACHE_DIR="",
                                        TRITON_CACHE_DIR=""))  # fmt: skip
        warm_up_process(args.compilers, root, args.device)
        for name in args.models:
            workload = SUITES[args.suite][name](args.quick)
            workload = on_device(workload, args.device, args.batch_scale) if workload is not None else None
            if workload is None:
                print(f"skipping {name}: `transformers` is not installed (pip install transformers)")
                continue
            print(f"== {name}", flush=True)
            fresh_compile_state(root / name)
            result = benchmark_workload(workload, args, root / name)
            print_progress(result)
            results.append(result)
            del workload
            gc.collect()
        torch._dynamo.reset()
    return results


def print_progress(result: ModelResult) -> None:
    timings = ", ".join(f"{name} {ms:.2f} ms" for name, ms in result.ms.items())
    compiles = ", ".join(f"{name} {s:.1f} s" for name, s in result.compile_s.items())
    print(f"  time: {timings or '-'}   cold compile: {compiles or '-'}", flush=True)
    for compiler, error in result.errors.items():
        print(f"  {compiler} error: {error}", flush=True)


# ---------------------------------------------------------------------------------------------
# Reporting


def speedups(results: list[ModelResult], compiler: str) -> list[float]:
    """Speedups over eager of the workloads where `compiler` ran correctly and compiled every graph
    (micro-benchmarks excluded)."""
    return [
        r.ms["eager"] / r.ms[compiler]
        for r in results
        if compiler in r.ms and "eager" in r.ms and r.correct.get(compiler) and not r.gb_per_s
        if not (compiler == "ember" and r.ember_metrics.get("graphs_failed"))
    ]


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def time_cell(result: ModelResult, compiler: str) -> str:
    if compiler in result.errors:
        return "ERROR"
    if compiler not in result.ms:
        return "-"
    ms = result.ms[compiler]
    cell = f"{ms:.2f}" if compiler == "eager" else f"{ms:.2f} ({result.ms['eager'] / ms:.2f}x)"
    partial = compiler == "ember" and result.ember_metrics.get("graphs_failed")
    return cell + (" *" if partial else "")


def correct_cell(result: ModelResult, compilers: list[str]) -> str:
    marks = []
    for compiler in compilers:
        if compiler == "eager":
            continue
        if compiler in result.errors:
            marks.append("error")
        elif compiler in result.correct:
            marks.append("ok" if result.correct[compiler] else f"FAIL({result.max_error[compiler]:.1e})")
        else:
            marks.append("-")
    return "/".join(marks)


def table_rows(results: list[ModelResult], compilers: list[str]) -> list[list[str]]:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    names = "/".join(c for c in compilers if c != "eager")
    dynamic = [c for c in compilers if c.endswith("_dynamic")]
    header = ["model", "eager ms", "inductor ms (speedup)", "ember ms (speedup)"]
    header += [f"{c.replace('_', ' ')} ms (speedup)" for c in dynamic]
    header += ["compile s inductor", "compile s ember", *(f"compile s {c.replace('_', ' ')}" for c in dynamic)]
    header += ["warm s ember", "kernels", "fallbacks", f"correct {names}"]
    rows = [header]
    for r in results:
        metrics = r.ember_metrics
        rows.append([
            r.name,
            time_cell(r, "eager"),
            time_cell(r, "inductor"),
            time_cell(r, "ember"),
            *(time_cell(r, c) for c in dynamic),
            seconds(r.compile_s.get("inductor")),
            seconds(r.compile_s.get("ember")),
            *(seconds(r.compile_s.get(c)) for c in dynamic),
            seconds(r.warm_compile_s),
            str(metrics.get("kernels_generated", "-")),
            str(metrics.get("fallback_calls", "-")),
            correct_cell(r, compilers),
        ])  # fmt: skip
    return rows


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)


def details(results: list[ModelResult]) -> list[str]:
    lines = []
    for r in results:
        metrics = r.ember_metrics
        errors = ", ".join(f"{c} {e:.1e}" for c, e in r.max_error.items())
        line = f"{r.name}: max abs error vs {r.reference}: {errors or '-'}; dynamo graph breaks: {r.graph_breaks}"
        if metrics:
            ops = ", ".join(f"{op} x{n}" for op, n in sorted(metrics["fallback_ops"].items())) or "none"
            line += f"; ember graphs {metrics['graphs_compiled']}, fallback ops: {ops}"
        lines.append(line)
        lines += [f"    ember ran a graph eagerly: {w}" for w in r.ember_warnings]
        if "ember" in r.compile_s and "compile_seconds" in metrics:
            lines.append(f"    cold compile {compile_breakdown(r.compile_s['ember'], metrics['compile_seconds'])}")
        if r.warm_compile_s is not None and "warm_compile_seconds" in metrics:
            lines.append(f"    warm compile {compile_breakdown(r.warm_compile_s, metrics['warm_compile_seconds'])}")
        if metrics.get("triton_configs_precompiled") or metrics.get("triton_compiles_in_process"):
            lines.append(  # Note: the compile pool and Note: bounded tuning (ember/runtime/triton*.py)
                f"    triton: {metrics['triton_configs_precompiled']} configurations compiled ahead by the pool, "
                f"{metrics['triton_compiles_in_process']} compiled at a call, {metrics['triton_kernels_tuned']} "
                f"kernels tuned ({metrics['triton_configs_timed']} configurations timed)"
            )
        if metrics.get("warm_code_cache_misses"):
            lines.append(
                f"    warm compile missed the code cache for {metrics['warm_code_cache_misses']} kernels: "
                "codegen differs between processes, or ember's source changed during the run"
            )
        if r.dynamic_graphs:
            lines.append(f"    ember dynamic graphs: {r.dynamic_graphs}")
        if "ember_dynamic" in r.compile_s and r.dynamic_compile_seconds:
            breakdown = compile_breakdown(r.compile_s["ember_dynamic"], r.dynamic_compile_seconds)
            lines.append(f"    ember dynamic cold compile {breakdown}")
        lines += [f"    {compiler} error: {error}" for compiler, error in r.errors.items()]
    return lines


def compile_breakdown(total: float, stages: dict[str, float]) -> str:
    """Where one first call's seconds went: ember's stages (`ember.metrics.compile_seconds`),
    AOTAutograd, and the rest (dynamo's tracing and guards, and the call itself)."""
    aot = stages.get("aot_autograd", 0.0)
    ember_s = sum(v for k, v in stages.items() if k not in ("aot_autograd", "render"))  # render is in codegen
    biggest = sorted(((v, k) for k, v in stages.items() if k != "aot_autograd"), reverse=True)[:3]
    top = ", ".join(f"{k} {v:.2f}" for v, k in biggest)
    rest = total - ember_s - aot
    return f"{total:.2f} s: ember {ember_s:.2f} s ({top}), AOTAutograd {aot:.2f} s, dynamo and the run {rest:.2f} s"


def bandwidth_lines(results: list[ModelResult]) -> list[str]:
    lines = []
    for r in results:
        if not r.gb_per_s:
            continue
        rates = ", ".join(f"{name} {rate:.1f} GB/s" for name, rate in r.gb_per_s.items())
        lines.append(f"{r.name}: {rates}")
        if "ember" in r.gb_per_s and "copy_" in r.gb_per_s:
            lines.append(f"    ember achieves {r.gb_per_s['ember'] / r.gb_per_s['copy_']:.2f}x of copy_'s bandwidth")
    return lines


def total_compile_line(results: list[ModelResult], compilers: list[str]) -> str:
    """Cold compile summed over the workloads every compiler compiled (the suite-wide comparison)."""
    both = [r for r in results if all(c in r.compile_s for c in compilers)]
    totals = {c: sum(r.compile_s[c] for r in both) for c in compilers}
    text = ", ".join(f"{c} {s:.1f} s" for c, s in totals.items())
    ratio = ""
    if totals.get("inductor") and "ember" in totals:
        ratio = f" (ember/inductor {totals['ember'] / totals['inductor']:.2f})"
    return f"cold compile, total over the {len(both)} workloads every compiler compiled: {text or '-'}{ratio}"


def dynamic_ratio_line(results: list[ModelResult], compiler: str = "ember") -> str:
    """`compiler` with dynamic=True against itself static: the geomean and the worst of the time ratios."""
    dynamic = f"{compiler}_dynamic"
    ratios = {r.name: r.ms[dynamic] / r.ms[compiler] for r in results
              if compiler in r.ms and dynamic in r.ms and not r.gb_per_s}  # fmt: skip
    if not ratios:
        return f"{compiler} dynamic / static: -"
    worst = max(ratios, key=ratios.__getitem__)
    return (f"{compiler} dynamic / static time: geomean {geomean(list(ratios.values())):.3f} over {len(ratios)} "
            f"workloads, worst {ratios[worst]:.3f} ({worst})")  # fmt: skip


def report(results: list[ModelResult], compilers: list[str], statistic: str) -> str:
    out = [f"times: {statistic} of the timing samples", format_table(table_rows(results, compilers)), ""]
    for compiler in compilers:
        if compiler != "eager":
            values = speedups(results, compiler)
            mean = geomean(values)
            text = "-" if mean is None else f"{mean:.2f}x over {len(values)} workloads"
            out.append(f"geomean speedup over eager, {compiler}: {text}")
    out.append("(* = ember ran some graphs eagerly; the geomean counts only correct, fully compiled workloads)")
    for compiler in ("ember", "inductor"):
        if f"{compiler}_dynamic" in compilers:
            out.append(dynamic_ratio_line(results, compiler))
    out.append(total_compile_line(results, [c for c in compilers if c != "eager"]))
    out += ["", f"bandwidth (bytes a fused kernel must move / {statistic} time):", *bandwidth_lines(results)]
    out += ["", "details:", *details(results)]
    return "\n".join(out)


def ember_source_hash() -> str:
    """A hash of ember's Python source: tells whether ember changed while the run went on."""
    package = Path(ember.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def git_revision() -> str | None:
    """The commit of the checkout, with `+dirty` when ember has uncommitted changes (read-only git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "ember"], cwd=REPO_ROOT, capture_output=True, text=True
        )
    except OSError:
        return None
    if commit.returncode != 0:
        return None
    return commit.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def machine_info() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "ember": ember.__version__,
        "ember_revision": git_revision(),
        "ember_source_hash": ember_source_hash(),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def write_json(path: str, results: list[ModelResult], args: argparse.Namespace) -> None:
    payload = {
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "geomean_speedup": {c: geomean(speedups(results, c)) for c in args.compilers if c != "eager"},
        "results": [asdict(r) for r in results],
    }
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------
# Command line


def describe_error(error: BaseException) -> str:
    """`Type: first line` of the error that says most: the first EmberError in the chain of causes
    (dynamo wraps a backend's error in BackendCompilerFailed), else the root cause."""
    chain = [error]
    while (inner := getattr(chain[-1], "inner_exception", None) or chain[-1].__cause__) is not None:
        chain.append(inner)
    cause = next((e for e in chain if isinstance(e, EmberError)), chain[-1])
    text = f"{type(cause).__name__}: {first_line(cause)}"
    return text if cause is error else f"{type(error).__name__} <- {text}"


def first_line(error: Any) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite",
        choices=sorted(SUITES),
        default="default",
        help="default: benchmarks/suite.py; real: real models, real sizes (benchmarks/real_models.py)",
    )
    parser.add_argument("--models", help="comma-separated workloads (default: all of the suite)")
    parser.add_argument("--compilers", default=",".join(DEFAULT_COMPILERS),
                        help="among eager,inductor,ember,ember_dynamic (ember with dynamic=True)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=30, help="timing rounds (at most)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls of each compiler before timing")
    parser.add_argument("--budget", type=float, default=30.0, help="seconds of timing per workload, at least")
    parser.add_argument("--statistic", choices=["median", "min"], default="median", help="of the timing samples")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for the smoke test)")
    parser.add_argument("--strict", action="store_true", help="EMBER_STRICT=1: a failing graph fails the model")
    parser.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True, help="measure warm compile")
    parser.add_argument("--compile-only", action="store_true", help="internal: ember cold compile of --models")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: GPU sizes (batch x16)")
    parser.add_argument("--batch-scale", type=int, default=GPU_BATCH_SCALE,
                        help="cuda: the batch multiple (1: the CPU sizes)")  # fmt: skip
    parser.add_argument(
        "--mode",
        choices=["default", "reduce-overhead"],
        default="default",
        help="torch.compile's mode for inductor and ember (reduce-overhead: CUDA graphs)",
    )
    args = parser.parse_args(argv)
    COMPILE_MODE["mode"] = None if args.mode == "default" else args.mode
    if args.device == "cuda":  # fp32 means fp32 for every compiler: no TF32 in cuBLAS or cuDNN
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    workloads = SUITES[args.suite]
    args.models = [m.strip() for m in (args.models or ",".join(workloads)).split(",") if m.strip()]
    unknown = [m for m in args.models if m not in workloads]
    if unknown:
        parser.error(f"unknown workloads {unknown} in suite {args.suite}; known: {', '.join(workloads)}")
    compilers = {c.strip() for c in args.compilers.split(",")} | {"eager"}  # eager is the baseline
    if compilers - set(COMPILERS):
        parser.error(f"unknown compilers {sorted(compilers - set(COMPILERS))}; known: {', '.join(COMPILERS)}")
    args.compilers = [c for c in COMPILERS if c in compilers]
    return args


def main(argv: list[str] | None = None) -> list[ModelResult]:
    args = parse_args(argv)
    if args.compile_only:
        compile_only(args)
        return []
    info = machine_info()
    args.ember_source_hash = info["ember_source_hash"]
    load = info["load_average"]
    print(f"torch {info['torch']}, ember {info['ember']} at {info['ember_revision']}, {info['threads']} threads")
    print(f"load average {load}")
    if load and load[0] > (info["cpu_count"] or 1):
        print("warning: the machine is busy (load average above the CPU count): timings will be noisy")
    results = run_suite(args)
    print()
    print(report(results, args.compilers, args.statistic))
    if ember_source_hash() != info["ember_source_hash"]:
        print("warning: ember's source changed during the run: rows measured different versions of ember")
    if args.json:
        write_json(args.json, results, args)
    return results


if __name__ == "__main__":
    main()
