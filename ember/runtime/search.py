"""Stage `runtime` (CPU): the kernel search, timing a kernel's renderings at its first call.

Note: kernel search
    With `config.kernel_search` (EMBER_KERNEL_SEARCH=1; off by default) each C++ kernel of
    enough work is also rendered with the alternative choices of renderer/choices.py
    (threads, collapse, vector width, unrolling; Note: kernel choices), and every distinct
    rendering is compiled, in parallel with the others (compile_search.py). The wrapper
    loads a `KernelSearch` in the kernel's place; at the first call it has the real
    arguments, and it
      1. copies every buffer the kernel writes into scratch memory (an in-place kernel
         reads what it writes, so the copies are refilled before every run that needs it);
         the candidates write only there, so the user's buffers see one run: the winner's;
      2. runs each candidate once and drops any whose result differs from the default's
         in one bit (correctness first);
      3. times the rest round-robin (load on the machine hits all alike), a few rounds
         within a small budget, and takes each one's median;
      4. keeps the fastest if it beats the default by SEARCH_MARGIN (else the default:
         noise must not pick), records it on disk, rebinds the wrapper's name to it (later
         calls go straight to the compiled function) and runs it on the real arguments.
    The record is keyed by the default source (shapes, dtypes and strides are in it), the
    machine (CPU model, OpenMP threads) and ember's version, and records its key and
    checksum (Note: cache safety); a record that is missing, damaged or names no candidate
    is ignored and rewritten by a new search. A compile that finds a record compiles the winner alone,
    and a wrapper loaded from the graph cache reads it when it loads: neither searches.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ember.metrics import metrics
from ember.runtime.cache import (
    content_hash,
    entry_path,
    read_entry_or_discard,
    resolve_in_root,
    write_entry,
)
from ember.runtime.cache_identity import cpu_info
from ember.runtime.cpu import float_lanes, load_cached_kernel

SEARCH_MARGIN = 0.03  # a candidate replaces the default when its median is this much lower
BUDGET_S = 0.25  # timing per kernel, about (at least MIN_ROUNDS rounds)
MIN_ROUNDS, MAX_ROUNDS = 3, 25


# ---- the machine a winner holds for ---------------------------------------------------------


def openmp_threads() -> int:
    """The threads a kernel's `parallel for` runs on: OMP_NUM_THREADS, else the usable CPUs."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        return int(first)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_identity() -> str:
    return f"{cpu_info()[0]} threads={openmp_threads()}"


def wide_default_vectors() -> bool:
    """Kernels vectorize at 512 bits on hosts with AVX-512 (cpu.py FLAGS: -mprefer-vector-width=512)."""
    return float_lanes() == 16


# ---- winner records -------------------------------------------------------------------------


def winner_record(cache_dir: Path, default_source: str, version: str) -> tuple[Path, str]:
    """Where the winner of a kernel's search on this machine is recorded, and its key."""
    key = content_hash(default_source, machine_identity(), version)
    return entry_path(cache_dir, "search", key, ".json"), key


def read_winner(path: Path, key: str, candidates: list[dict]) -> int | None:
    """The position of the recorded winner among `candidates` (choices as dicts), or None
    when there is no usable record (missing, damaged, another key's, or naming none of them:
    a damaged one is discarded, Note: cache safety)."""
    record = read_entry_or_discard(path, key)
    winner = record.get("winner") if isinstance(record, dict) else None
    return candidates.index(winner) if winner in candidates else None


def write_winner(path: Path, key: str, winner: dict, report: list[dict]) -> None:
    write_entry(path, key, {"winner": winner, "machine": machine_identity(), "candidates": report})


# ---- the search at the first call -----------------------------------------------------------


def search_cpu_kernel(namespace: dict, var: str, num_params: int, spec: dict) -> Callable:
    """What a wrapper binds to `var` for a searched kernel: the recorded winner's compiled
    function, or a `KernelSearch` that finds it at the first call (Note: kernel search)."""
    root = namespace["_cache_root"]  # paths in `spec` are relative to it (Note: cache safety)
    choices = [c for c, _, _, _ in spec["candidates"]]
    found = read_winner(resolve_in_root(root, spec["record"]), spec["record_key"], choices)
    if found is not None:
        metrics.add(search_winners_loaded=1)
        _, path, sha256, symbol = spec["candidates"][found]
        return load_cached_kernel(root, path, sha256, symbol, num_params)
    # loaded now: a candidate removed from the cache fails the wrapper's load (which the
    # graph cache handles by compiling again), not its first call
    functions = [load_cached_kernel(root, p, sha256, symbol, num_params) for _, p, sha256, symbol in spec["candidates"]]
    return KernelSearch(namespace, var, functions, spec)


class KernelSearch:
    """A kernel's candidates, searched at the first call; later calls never come here (the
    wrapper's name is rebound to the winner)."""

    def __init__(self, namespace: dict, var: str, functions: list[Callable], spec: dict) -> None:
        self.namespace, self.var, self.functions, self.spec = namespace, var, functions, spec
        self.winner: Callable | None = None
        self.lock = threading.Lock()

    def __call__(self, *pointers: int) -> None:
        with self.lock:
            if self.winner is None:
                self.winner = self.search(pointers)
                self.namespace[self.var] = self.winner
        self.winner(*pointers)

    def search(self, pointers: tuple[int, ...]) -> Callable:
        candidates, functions = self.spec["candidates"], self.functions
        scratch = Scratch(pointers, self.spec["extents"], self.spec["errors"])
        verified = scratch.verify(functions)
        times = time_round_robin(functions, verified, scratch, self.spec["rereads"])
        medians = {i: statistics.median(t) for i, t in times.items()}
        best = min(medians, key=medians.__getitem__)
        winner = best if medians[best] < (1 - SEARCH_MARGIN) * medians[0] else 0
        metrics.add(kernel_searches=1, search_candidates_timed=len(times))
        report = [{"choices": c, "verified": i in verified, "median_us": medians.get(i, 0.0) * 1e6,
                   "samples": len(times.get(i, []))} for i, (c, _, _, _) in enumerate(candidates)]  # fmt: skip
        record = resolve_in_root(self.namespace["_cache_root"], self.spec["record"])
        write_winner(record, self.spec["record_key"], candidates[winner][0], report)
        if self.spec.get("debug_file"):
            _dump(Path(self.spec["debug_file"]), self.var, report, winner)
        return functions[winner]


class Scratch:
    """Private copies of the buffers a kernel writes, and an error flag of its own, so that
    candidates run on the real inputs without touching the real outputs."""

    def __init__(self, pointers: tuple[int, ...], extents: list[int], errors: bool) -> None:
        self.real = pointers
        self.copies = {i: torch.empty(n, dtype=torch.uint8) for i, n in enumerate(extents) if n > 0}
        self.flag = ctypes.c_int32(0)
        args = list(pointers)
        for i, copy in self.copies.items():
            args[i] = copy.data_ptr()
        if errors:
            args[-1] = ctypes.addressof(self.flag)
        self.args = tuple(args)

    def refill(self) -> None:
        for i, copy in self.copies.items():
            ctypes.memmove(copy.data_ptr(), self.real[i], copy.numel())

    def verify(self, functions: list[Callable]) -> list[int]:
        """The candidates whose outputs from the real inputs equal the default's (the first)
        bit for bit; each runs once (its warm-up)."""
        verified, reference = [], None
        for i, fn in enumerate(functions):
            self.refill()
            fn(*self.args)
            outputs = [c.clone() for c in self.copies.values()] if reference is None else list(self.copies.values())
            if reference is None:
                reference = outputs
            if all(a.equal(b) for a, b in zip(outputs, reference)):
                verified.append(i)
        return verified


def time_round_robin(functions: list[Callable], chosen: list[int], scratch: Scratch, rereads: bool) -> dict:
    """Seconds per run of each chosen candidate: rounds of one run each, in turn."""
    times: dict[int, list[float]] = {i: [] for i in chosen}
    rounds, spent = 0, 0.0
    while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and spent * (rounds + 1) / rounds < BUDGET_S):
        for i in chosen:
            if rereads:
                scratch.refill()
            start = time.perf_counter()
            functions[i](*scratch.args)
            elapsed = time.perf_counter() - start
            times[i].append(elapsed)
            spent += elapsed
        rounds += 1
    return times


def _dump(path: Path, var: str, report: list[dict[str, Any]], winner: int) -> None:
    """EMBER_DEBUG: the candidates of one search, their times, and the winner."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"kernel search for {var}: winner candidate {winner}"]
    for i, row in enumerate(report):
        state = f"{row['median_us']:10.1f} us median of {row['samples']}" if row["verified"] else "result differs"
        lines.append(f"  candidate {i}: {state}  {row['choices']}")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
