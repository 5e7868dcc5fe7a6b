"""Stage `passes` (CPU): whether oneDNN's linear multiplies faster than aten's mm on this machine,
at one shape, timed once per machine and recorded on disk.

Note: timed matmul libraries
    aten's mm and addmm call MKL's sgemm; oneDNN's linear (`mkldnn._linear_pointwise`) runs its
    own generated code. Which one is faster depends on the machine more than on the shape:
      - on Intel's Sapphire Rapids MKL was 3-10% faster at every real model's shape (Note:
        which library multiplies, mkldnn.py);
      - on an AMD EPYC with AVX-512 (MKL takes a slower path on AMD processors), 2 threads,
        oneDNN took 0.44-0.48 of MKL's time from 128 x 768 x 768 up (0.34 against 0.72 ms;
        1024 x 768 x 2304: 8.1 against 17.1 ms), whether the weight is (out, in) or GPT-2's
        (in, out), and lost below about a million multiply-adds (64 x 64 x 64: 21 against 9 us).
    No fixed rule serves both, so under `config.matmul_timing` a static linear that oneDNN would
    take only for speed (no epilogue to fuse) is timed both ways on this machine, on random
    inputs of its shape, cut so one product costs little: rows cut to TIMED_ROWS where the product
    would pass TIMED_MACS multiply-adds, and output
    features cut to about TIMED_MACS multiply-adds but no fewer than TIMED_COLUMNS (the depth and
    the row count, which decide how each library blocks the product, stay; a few hundred
    columns already show the ratio of thousands), and goes to oneDNN only where oneDNN
    takes at most 1 - MARGIN of aten's time: a margin for noise, and for oneDNN's scratchpad
    (Note: oneDNN's scratchpad).

    A product of one row (a decode step's) reads each weight element once, and in a model larger
    than the caches the weight comes from memory: timed on a warm cache, GPT-2's 768 x 768 one-row
    product showed the two libraries alike, where from memory oneDNN took half of MKL's time. So
    a one-row product is timed over copies of its weight (`cold_copies`) that together hold
    twice the last-level cache, each call reading the copy least recently read.

    The verdict is recorded in the cache (`matmul/`), keyed by the shape, the layout, the
    machine (CPU model, threads) and torch's version, with its key and checksum (Note: cache
    safety): a later compile, in this process or another, reads it instead of timing; a
    damaged record is discarded and timed again. Within a process, verdicts are kept in a
    dict under a lock, and one thread times at a time (two timings at once would slow each
    other). Both libraries compute the same float32 product up to rounding order; the tests
    compare either against float64 eager.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from dataclasses import astuple, dataclass
from pathlib import Path

import torch

from ember.metrics import metrics
from ember.runtime.cache import content_hash, entry_path, read_entry_or_discard, write_entry
from ember.runtime.search import machine_identity

MARGIN = 0.1
TIMED_MACS = 1 << 26  # about 0.7 ms of one aten product on 2 threads of an AMD EPYC, 0.3 of oneDNN's
TIMED_ROWS, TIMED_COLUMNS = 256, 256
MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 3, 5, 0.03  # a shape costs a compile about 5-15 ms, once per machine
RECORD_VERSION = "2"  # 2: one-row products timed with their weights from memory
MAX_COLD_COPIES = 64
DEFAULT_LAST_LEVEL_CACHE = 32 << 20

log = logging.getLogger("ember.passes")


@dataclass(frozen=True)
class LinearShape:
    rows: int
    in_features: int
    out_features: int
    bias: bool
    weight_in_out: bool  # the weight is stored (in, out) row-major, GPT-2's Conv1D; else (out, in) row-major


_lock = threading.Lock()
_verdicts: dict[str, bool] = {}  # key (content_hash of shape, machine, torch) -> verdict


def onednn_is_faster(shape: LinearShape, cache_dir: str | Path) -> bool:
    """Whether oneDNN's linear takes at most 1 - MARGIN of aten's time at `shape` on this machine."""
    # machine_identity: the CPU and OpenMP's threads; torch's own count may differ (torch.set_num_threads)
    threads = f"torch_threads={torch.get_num_threads()}"
    key = content_hash(repr(astuple(shape)), machine_identity(), threads, torch.__version__, RECORD_VERSION)
    with _lock:
        if key not in _verdicts:
            _verdicts[key] = _recorded_or_timed(shape, Path(cache_dir), key)
        return _verdicts[key]


def _recorded_or_timed(shape: LinearShape, cache_dir: Path, key: str) -> bool:
    path = entry_path(cache_dir, "matmul", key, ".json")
    record = read_entry_or_discard(path, key)  # a damaged record: timed again
    if isinstance(record, dict) and isinstance(record.get("onednn_faster"), bool):
        metrics.add(matmul_timings_loaded=1)
        return record["onednn_faster"]
    aten_ms, onednn_ms = time_both(shape)
    faster = onednn_ms <= (1 - MARGIN) * aten_ms
    metrics.add(matmul_timings=1)
    log.debug("linear %s x %s -> %s%s: aten %.3f ms, oneDNN %.3f ms: %s", shape.rows, shape.in_features,
             shape.out_features, " (weight stored in x out)" if shape.weight_in_out else "", aten_ms, onednn_ms,
             "oneDNN" if faster else "aten")  # fmt: skip
    write_entry(path, key, {"onednn_faster": faster, "aten_ms": aten_ms, "onednn_ms": onednn_ms,
                            "machine": machine_identity(), "torch_threads": torch.get_num_threads(),
                            "shape": repr(shape)})  # fmt: skip
    return faster


def time_both(shape: LinearShape) -> tuple[float, float]:
    """The least milliseconds of aten's and oneDNN's product at `shape`, cut (Note: timed matmul
    libraries), timed in turns so that load on the machine hits both alike."""
    k = shape.in_features
    rows = min(shape.rows, max(TIMED_ROWS, TIMED_MACS // max(1, k * shape.out_features)))
    n = min(shape.out_features, max(TIMED_COLUMNS, TIMED_MACS // max(1, rows * k)))
    # compiles run under fake mode, and may run inside the caller's autocast: time plain float32
    with (
        torch._subclasses.fake_tensor.unset_fake_temporarily(),
        torch.autocast("cpu", enabled=False),
        torch.no_grad(),
    ):
        # float32 on the CPU whatever torch's defaults (set_default_dtype, set_default_device) say
        made = {"dtype": torch.float32, "device": "cpu"}
        x = torch.randn(rows, k, **made)
        copies = cold_copies(rows, n * k * 4)
        first = torch.randn(k, n, **made) if shape.weight_in_out else torch.randn(n, k, **made)
        stored = [first] + [first.clone() for _ in range(copies - 1)]  # (cloning costs a copy, randn much more)
        weights = [w.t() if shape.weight_in_out else w for w in stored]  # (out, in), as the linear reads it
        bias = torch.randn(n, **made) if shape.bias else None
        rotation = itertools.cycle(weights)  # each call reads the copy least recently read
        weight = functools.partial(next, rotation)

        runs = [
            (lambda: torch.mm(x, weight().t())) if bias is None else (lambda: torch.addmm(bias, x, weight().t())),
            lambda: torch.ops.mkldnn._linear_pointwise(x, weight(), bias, "none", [], ""),
        ]
        best = [float("inf")] * 2
        for run in runs:  # the first call of each allocates and packs
            run()
        start, rounds = time.perf_counter(), 0
        while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and time.perf_counter() - start < BUDGET_S):
            for i, run in enumerate(runs):
                began = time.perf_counter()
                run()
                best[i] = min(best[i], time.perf_counter() - began)
            rounds += 1
    return best[0] * 1e3, best[1] * 1e3


def cold_copies(rows: int, weight_bytes: int) -> int:
    """How many copies of the weight a timing reads in turn: for one row, enough to hold twice the
    last-level cache (at most MAX_COLD_COPIES), so each call streams its weight from memory."""
    if rows != 1:
        return 1
    return max(1, min(MAX_COLD_COPIES, -(-2 * last_level_cache_bytes() // max(1, weight_bytes))))


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux's sysfs), or DEFAULT_LAST_LEVEL_CACHE."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG" else int(text))
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes, default=DEFAULT_LAST_LEVEL_CACHE)


def forget_verdicts() -> None:
    """Drop this process's verdicts (tests: the next question reads the record or times again)."""
    with _lock:
        _verdicts.clear()
