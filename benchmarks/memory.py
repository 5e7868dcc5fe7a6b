"""Peak memory of a forward call, eager vs ember, measured the same way for both.

    python -m benchmarks.memory [--models mlp,encoder_layer_unfused]

The peak is the highest sum of live allocations during one call, from torch.profiler's
CPU memory events (inputs and weights exist before the call and are not counted).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.suite import WORKLOADS


def call_peak_bytes(fn, *args) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,encoder_layer_unfused")
    args = parser.parse_args()
    print(f"{'model':24s} {'eager MB':>10s} {'ember MB':>10s} {'ember/eager':>12s}")
    for name in args.models.split(","):
        workload = WORKLOADS[name](False)
        with torch.no_grad():
            compiled = torch.compile(workload.model, backend="ember")
            for _ in range(2):  # compile, and let both reach a steady state
                compiled(*workload.inputs)
                workload.model(*workload.inputs)
            eager = call_peak_bytes(workload.model, *workload.inputs)
            ember_peak = call_peak_bytes(compiled, *workload.inputs)
        print(f"{name:24s} {eager / 1e6:10.2f} {ember_peak / 1e6:10.2f} {ember_peak / max(eager, 1):12.2f}")


if __name__ == "__main__":
    main()
