"""ember with and without the kernel search (config.kernel_search), side by side in one process.

    python -m benchmarks.kernel_search [--models mlp,reductions] [--budget 10]

For each workload, with a fresh EMBER_CACHE_DIR: compile and run once without the search, then
once with it (the first call searches; the difference of the two is the search's extra cold
compile time, with the first compile also paying dynamo's warm-up), check that the two results
are identical bit for bit, and time both interleaved (benchmarks.run's round-robin sampling).
Timings and winners depend on the load of the machine while the search runs: run it quiet.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time

import torch
from torch.utils._pytree import tree_flatten

import ember
from benchmarks import suite
from benchmarks.run import make_step, time_interleaved
from ember.frontend import ember_backend


def identical(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).logical_or(a.isnan() & b.isnan()).all())
    return a == b


def compare(name: str, budget: float) -> str:
    os.environ["EMBER_CACHE_DIR"] = tempfile.mkdtemp(prefix="ember_search_bench_")
    torch._dynamo.reset()
    workload = suite.build(name)
    if workload is None:
        return f"{name}: not available"
    steps, outputs, cold, searches, kernels = {}, {}, {}, 0, 0
    for label, search in (("off", False), ("on", True)):
        ember.metrics.reset()
        backend = functools.partial(ember_backend, kernel_search=search)
        steps[label] = make_step(torch.compile(workload.model, backend=backend, dynamic=False), workload)
        start = time.perf_counter()
        outputs[label] = steps[label]()
        cold[label] = time.perf_counter() - start
        searches += ember.metrics.kernel_searches
        kernels = ember.metrics.kernels_generated
    same = all(identical(a, b) for a, b in zip(tree_flatten(outputs["off"])[0], tree_flatten(outputs["on"])[0]))
    samples = time_interleaved(steps, 3, 1000, budget)
    off, on = (statistics.median(samples[k]) * 1e3 for k in ("off", "on"))
    extra = cold["on"] - cold["off"]
    return (f"{name:16s} identical={same} searched {searches} of {kernels} kernels  off {off:9.3f} ms  "
            f"on {on:9.3f} ms  speedup {off / on:5.2f}x  extra cold compile {extra:+6.2f} s  "
            f"({len(samples['on'])} samples, load {os.getloadavg()[0]:.1f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel_search", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,pointwise_chain,reductions,attention")
    parser.add_argument("--budget", type=float, default=10.0, help="seconds of timing per workload, at least")
    args = parser.parse_args()
    for name in args.models.split(","):
        print(compare(name, args.budget), flush=True)


if __name__ == "__main__":
    main()
