"""`ember report`'s measurements: step times and measured peaks from a torch.profiler run, and the
machine's copy bandwidth. Takes the profiler's raw (kineto) events; gives per-label durations and
per-graph peaks. Labels are the report's (Note: report records, debug/record.py): each names one
step of one graph (`... [000_forward step 3]`).
"""

from __future__ import annotations

import bisect
import re
import statistics
import time
from dataclasses import dataclass, field

import torch

from ember.debug.record import GRAPH_RANGE_PREFIX

LABEL_GRAPH = re.compile(r"\[(\d{3}_\w+) step (\d+)\]$")


@dataclass
class Measured:
    """What one profiled run measured."""

    durations_us: dict[str, list[float]] = field(default_factory=dict)  # label -> each call's time
    peak_bytes: dict[str, int] = field(default_factory=dict)  # graph name -> most bytes allocated in a call
    graph_us: dict[str, list[float]] = field(default_factory=dict)  # graph name -> each call's time (CPU side)
    on_device: bool = False  # times are the GPU's (its side of each range), not the CPU's

    def median_us(self, label: str) -> float | None:
        return median_after_first(self.durations_us.get(label, []))

    def fastest_us(self, label: str) -> float | None:
        """The fastest call: on a machine shared with other work, the closest to the step's own cost
        (a range's time is wall time, and includes any time the thread was not running)."""
        times = self.durations_us.get(label)
        return min(times) if times else None


def median_after_first(times: list[float]) -> float | None:
    """The median of the calls after the first (which may pay for warming up: thread pools, a
    library's first-call setup), or the first when there was one call; None for none."""
    if not times:
        return None
    return statistics.median(times[1:] if len(times) > 1 else times)


@dataclass(frozen=True)
class Span:
    label: str
    start_ns: int
    end_ns: int


def measure(prof: torch.profiler.profile) -> Measured:
    """Each labelled step's durations, and each graph's measured peak (Note: measured peak)."""
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    events = list(results.events()) if results is not None else []
    spans, memory, graphs = [], [], []
    gpu = any(e.device_type() != torch.autograd.DeviceType.CPU and LABEL_GRAPH.search(e.name()) for e in events)
    for e in events:
        on_gpu = e.device_type() != torch.autograd.DeviceType.CPU
        if e.name() == "[memory]":
            memory.append((e.start_ns(), e.nbytes(), on_gpu))  # type: ignore[attr-defined]  # (missing from torch's stubs)
        elif e.name().startswith(GRAPH_RANGE_PREFIX) and not on_gpu:
            graphs.append((e.name().removeprefix(GRAPH_RANGE_PREFIX), e.start_ns(), e.end_ns()))
        elif e.name().startswith("ember ") and LABEL_GRAPH.search(e.name()) and on_gpu == gpu:
            spans.append(Span(e.name(), e.start_ns(), e.end_ns()))
    spans.sort(key=lambda s: s.start_ns)
    measured = Measured(on_device=gpu)
    for s in spans:
        measured.durations_us.setdefault(s.label, []).append((s.end_ns - s.start_ns) / 1e3)
    allocations = sorted((t, n) for t, n, on_gpu in memory if on_gpu == gpu)
    for graph, start, end in sorted(graphs, key=lambda g: g[1]):
        measured.graph_us.setdefault(graph, []).append((end - start) / 1e3)
        peak = window_peak(allocations, start, end)
        measured.peak_bytes[graph] = max(measured.peak_bytes.get(graph, 0), peak)
    return measured


def window_peak(memory: list[tuple[int, int]], start_ns: int, end_ns: int) -> int:
    """Note: measured peak. The most bytes allocated at once between `start_ns` and `end_ns` (one
    call of a graph: its `ember graph` range), counted from the level at `start_ns`: every
    allocation and free the profiler saw (torch's CPU and CUDA allocators report each one under
    profile_memory=True), so the wrapper's buffers, the externs' outputs and their workspaces,
    less the inputs the call lets go of (Note: inputs die at their last use, wrapper/python.py).
    Storage the wrapper takes again from its pool of large buffers (runtime/memory.py) is not a
    new allocation and is not counted."""
    live = peak = 0
    for t, nbytes in memory[bisect.bisect_left(memory, (start_ns, -(2**62))) :]:
        if t > end_ns:
            break
        live += nbytes
        peak = max(peak, live)
    return peak


def copy_bandwidth(device: torch.device, nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes per second a large `copy_` moves (it reads and writes each byte: 2 * nbytes), the best
    of `repeats`: what a kernel that only streams memory can hope for on this machine."""
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy faults the target's pages in
        _synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
