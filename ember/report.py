"""`ember.report(fn, *args)` and `ember report script.py`: one self-contained HTML page per run.

Records every graph compiled in the run (Note: report records, debug/record.py), profiles calls
of them with torch.profiler (each step is a named range: Note: profiler ranges,
wrapper/runtime.py), measures the machine's copy bandwidth, and writes the page
(debug/report_html.py): per graph its steps slowest first, with their aten ops, source lines,
time, achieved bandwidth, generated code and the refused fusions; fallbacks, graph breaks,
compile time per stage, and planned against measured peak memory.
"""

from __future__ import annotations

import runpy
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

DEFAULT_PATH = "ember_report.html"


def report(fn: Callable, *args, path: str = DEFAULT_PATH, calls: int = 3, **kwargs) -> Path:
    """Compile `fn` with ember, call it once to compile and warm up, then profile `calls` calls of
    `fn(*args, **kwargs)`; write the page to `path` and return its path. `fn` may run a whole
    training step (forward, backward, optimizer): each graph it compiles is in the page."""
    import torch  # here, not at module level: `import ember` stays free of torch

    from ember.frontend import compile as ember_compile

    torch._dynamo.reset()
    with _report_run(path, f"{calls} profiled call(s) of {getattr(fn, '__name__', 'fn')}") as profiled:
        compiled = ember_compile(fn)
        compiled(*args, **kwargs)
        with profiled():
            for _ in range(calls):
                compiled(*args, **kwargs)
    return Path(path)


def report_script(script: str, argv: list[str], path: str = DEFAULT_PATH) -> Path:
    """Run a script that uses ember (torch.compile(..., backend="ember")) under the profiler and
    write its page. Every call the script makes is profiled; each step's time is the median over
    its calls, so a first call's warm-up weighs little once the script calls a graph a few times.
    A script that fails or exits non-zero still gets the page of what ran before."""
    old_argv, exit_code = sys.argv, None
    sys.argv = [script, *argv]
    try:
        with _report_run(path, f"every call of {Path(script).name}") as profiled, profiled():
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                exit_code = e.code
    finally:
        sys.argv = old_argv
    if exit_code not in (None, 0):
        raise SystemExit(f"ember report: {script} exited with {exit_code}; the page of what ran: {path}")
    return Path(path)


@contextmanager
def _report_run(path: str, profiled_calls: str) -> Iterator[Callable]:
    """Records the graphs compiled inside; yields a context that profiles; writes the page at the end."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ember.debug.record import recording
    from ember.metrics import metrics

    breaks_before = Counter(torch._dynamo.utils.counters["graph_break"])
    compile_before = Counter(metrics.compile_seconds)
    fallbacks_before = Counter(metrics.fallback_ops)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities, profile_memory=True)
    with recording() as collector:
        try:
            yield lambda: profiler
        finally:  # a run that failed part way still gets the page of what ran
            _write_page(path, collector.graphs, profiler, profiled_calls, breaks_before, compile_before,
                        fallbacks_before)  # fmt: skip


def _write_page(path: str, graphs: list, profiler, profiled_calls: str, breaks_before: Counter,
                compile_before: Counter, fallbacks_before: Counter) -> None:  # fmt: skip
    import torch

    from ember.debug.report_html import PageFacts, render_page
    from ember.debug.report_profile import Measured, copy_bandwidth, measure
    from ember.metrics import metrics

    measured = measure(profiler) if profiler.profiler is not None else Measured()
    device = torch.device(next((g.device for g in graphs if g.device.startswith("cuda")), "cpu"))
    facts = PageFacts(
        title=f"ember report: {profiled_calls}",
        copy_bytes_per_s=copy_bandwidth(device),
        device=str(device) + ("" if device.type == "cuda" else f", {torch.get_num_threads()} thread(s)"),
        profiled_calls=profiled_calls,
        fallback_ops=dict(Counter(metrics.fallback_ops) - fallbacks_before),
        graph_breaks=list((Counter(torch._dynamo.utils.counters["graph_break"]) - breaks_before).items()),
        compile_seconds=dict(Counter(metrics.compile_seconds) - compile_before),
    )
    Path(path).write_text(render_page(graphs, measured, facts))
