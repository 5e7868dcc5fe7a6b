"""`ember report`'s measurements: step times and measured peaks from a torch.profiler run, and the
machine's copy bandwidth. Takes the profiler's raw (kineto) events; gives per-label durations and
per-graph peaks. Labels are the report's (Note: report records, debug/record.py): each names one
step of one graph (`... [000_forward step 3]`).
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field

import torch

LABEL_GRAPH = re.compile(r"\[(\d{3}_\w+) step (\d+)\]$")


@dataclass
class Measured:
    """What one profiled run measured."""

    durations_us: dict[str, list[float]] = field(default_factory=dict)  # label -> each call's time
    peak_bytes: dict[str, int] = field(default_factory=dict)  # graph name -> most bytes allocated in a call
    on_device: bool = False  # times are the GPU's (its side of each range), not the CPU's

    def median_us(self, label: str) -> float | None:
        """The median of a step's calls after its first (which may pay for warming up: thread
        pools, a library's first-call setup), or the first when it ran once."""
        times = self.durations_us.get(label)
        if not times:
            return None
        return statistics.median(times[1:] if len(times) > 1 else times)


@dataclass(frozen=True)
class Span:
    label: str
    graph: str
    start_ns: int
    end_ns: int


def measure(prof: torch.profiler.profile) -> Measured:
    """Each labelled step's durations, and each graph's measured peak (Note: measured peak)."""
    events = list(prof.profiler.kineto_results.events()) if prof.profiler is not None else []
    spans, memory = [], []
    gpu = any(e.device_type() != torch.autograd.DeviceType.CPU and LABEL_GRAPH.search(e.name()) for e in events)
    for e in events:
        on_gpu = e.device_type() != torch.autograd.DeviceType.CPU
        if e.name() == "[memory]":
            memory.append((e.start_ns(), e.nbytes(), on_gpu))
        elif e.name().startswith("ember ") and (match := LABEL_GRAPH.search(e.name())) and on_gpu == gpu:
            spans.append(Span(e.name(), match.group(1), e.start_ns(), e.end_ns()))
    spans.sort(key=lambda s: s.start_ns)
    measured = Measured(on_device=gpu)
    for s in spans:
        measured.durations_us.setdefault(s.label, []).append((s.end_ns - s.start_ns) / 1e3)
    memory.sort()
    for graph, start, end in graph_calls(spans):
        peak = window_peak([(t, n) for t, n, on_gpu in memory if on_gpu == gpu], start, end)
        measured.peak_bytes[graph] = max(measured.peak_bytes.get(graph, 0), peak)
    return measured


def graph_calls(spans: list[Span]) -> list[tuple[str, int, int]]:
    """One (graph, start, end) per call of a graph: a run of consecutive spans of that graph."""
    calls: list[tuple[str, int, int]] = []
    for s in spans:
        if calls and calls[-1][0] == s.graph and s.start_ns >= calls[-1][1]:
            graph, start, end = calls[-1]
            calls[-1] = (graph, start, max(end, s.end_ns))
        else:
            calls.append((s.graph, s.start_ns, s.end_ns))
    return calls


def window_peak(memory: list[tuple[int, int]], start_ns: int, end_ns: int) -> int:
    """Note: measured peak. The most bytes allocated at once between `start_ns` and `end_ns`,
    counted from the level at `start_ns`: every allocation and free the profiler saw (torch's CPU
    and CUDA allocators report each one under profile_memory=True) from the graph's first step to
    the end of its last, so the wrapper's buffers, the externs' outputs and their workspaces.
    Storage the wrapper takes again from its pool of large buffers (runtime/memory.py) is not a
    new allocation and is not counted; nor is what the graph frees before its first step."""
    live = peak = 0
    for t, nbytes in memory:
        if start_ns <= t <= end_ns:
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
