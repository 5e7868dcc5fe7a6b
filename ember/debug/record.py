"""Report records: what `ember report` needs from each compile, kept only while a report is made.

compile_graph asks `new_graph_record(role, key)` for a record; it is None unless a report is
being made (`recording()` is active), so a compile without a report records nothing and pays
one check of a module-level value.

Note: report records
    A record holds, per compiled graph, what only the compile knows: the aten graph, each step's
    aten ops, source lines, kernel code, the bytes its buffers hold (for achieved bandwidth),
    the refused fusions, the planned peak and the seconds per stage. While recording, each
    step's profiler label (Note: profiler ranges, wrapper/runtime.py) also names its graph and
    step (`ember kernel_ab12: add, mul [000_forward step 3]`), so a profiled run's time goes to
    exactly one step even when two steps (or two graphs) run the same kernel or extern. For the
    same reason the graph cache is neither read (a cached graph keeps none of this) nor written
    (its wrapper would carry these labels into later runs) while recording.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.ir import LoweredGraph
from ember.schedule import KernelStep, Schedule, reads_of, writes_of


@dataclass
class StepRecord:
    """One step of a graph as the report shows it."""

    index: int
    kind: str  # "kernel" | "extern" | "fallback"
    name: str  # the kernel's name, or the aten op an extern calls
    label: str  # its range under torch.profiler
    aten_ops: tuple[str, ...]
    sources: tuple[str, ...]
    more_sources: int
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    bytes_moved: int  # bytes of the buffers it reads and writes, each once
    code: str = ""  # a kernel's generated source


@dataclass
class GraphRecord:
    """One compiled graph; `timings` is the compile's StageTimes, complete once compile_graph returns."""

    number: int
    role: str
    key: str
    device: str = "cpu"
    aten_graph: str = ""
    steps: list[StepRecord] = field(default_factory=list)
    fusions: int = 0
    refusals: list[str] = field(default_factory=list)
    fallback_ops: list[str] = field(default_factory=list)
    planned_peak_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """As the graph's debug dump is named (debug/log.py DebugDump), without the hash."""
        return f"{self.number:03d}_{self.role}"

    def record_steps(self, graph: LoweredGraph, scheduled: Schedule, origins: list, binaries: dict,
                     labels: dict[int, str], kernel_sources: dict[str, str]) -> dict[int, str]:  # fmt: skip
        """Records every step; returns the profiler labels made unique to this graph and step."""
        unique = {}
        code_of: dict[str, str] = {}  # kernel name -> its source (`kernels/<name>.cpp`, before any candidates)
        for path, text in kernel_sources.items():
            if path.startswith("kernels/"):
                code_of.setdefault(path.removeprefix("kernels/").split(".")[0], text)
        for i, step in enumerate(scheduled.steps):
            if isinstance(step, KernelStep):
                kind, name = "kernel", binaries[i].var if i in binaries else "(empty: nothing to compute)"
            else:
                kind, name = ("fallback" if step.is_fallback else "extern"), str(step.op).removeprefix("aten.")
            label = f"{labels[i]} [{self.name} step {i}]" if i in labels else ""
            unique.update({i: label} if label else {})
            reads, writes = tuple(reads_of(step)), tuple(writes_of(step))
            code = code_of.get(binaries[i].var, "") if i in binaries else ""
            self.steps.append(StepRecord(
                i, kind, name, label, origins[i].aten_ops, origins[i].sources, origins[i].more_sources,
                reads, writes, buffer_bytes(graph, (*reads, *writes)), code,
            ))  # fmt: skip
        self.fusions = scheduled.fusions
        self.refusals = [str(r) for r in scheduled.refusals]
        return unique

    def in_profiler_range(self, call: Callable) -> Callable:
        """`call` inside a profiler range `ember graph <name>`, whose span is one call of the graph
        (for its measured peak, debug/report_profile.py). A graph that compiled while recording
        is only ever called from the report's run, so wrapping costs no other run anything."""
        label = f"{GRAPH_RANGE_PREFIX}{self.name}"

        def call_in_range(args: list) -> Any:
            with torch.profiler.record_function(label):
                return call(args)

        return call_in_range


GRAPH_RANGE_PREFIX = "ember graph "


def buffer_bytes(graph: LoweredGraph, names: tuple[str, ...]) -> int:
    """Bytes of the named buffers, each counted once (a buffer read and written in place moves
    its bytes twice; counting it once keeps the estimate a lower bound)."""
    total = 0
    for name in dict.fromkeys(names):
        buffer = graph.buffers.get(name)
        if buffer is not None:
            total += buffer.layout.storage_size * buffer.dtype.itemsize
    return total


class ReportCollector:
    """The graph records of one report, in compile order; compiles on several threads each add theirs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self.graphs: list[GraphRecord] = []

    def new_graph(self, role: str, key: str) -> GraphRecord:
        with self._lock:
            record = GraphRecord(next(self._numbers), role, key)
            self.graphs.append(record)
            return record


# Owned by this module: the collector of the report being made, or None (no report, no records).
_active: ReportCollector | None = None
_active_lock = threading.Lock()


@contextmanager
def recording() -> Iterator[ReportCollector]:
    """Records every graph compiled inside the block (on any thread); one report at a time."""
    global _active
    collector = ReportCollector()
    with _active_lock:
        if _active is not None:
            raise RuntimeError("ember: a report is already being made in this process; make one at a time")
        _active = collector
    try:
        yield collector
    finally:
        with _active_lock:
            _active = None


def is_recording() -> bool:
    return _active is not None


def new_graph_record(role: str, key: str) -> GraphRecord | None:
    """A record for the graph being compiled, or None when no report is being made."""
    collector = _active
    return collector.new_graph(role, key) if collector is not None else None
