"""Single-thread CPU-time profile of the suite's workloads: steady on a busy machine.

    OMP_NUM_THREADS=1 python -m benchmarks.cpu_profile [--suite default|real] [--models a,b]
                                                       [--compilers eager,inductor,ember] [--kernels N] [--rounds N]

Wall time on a shared machine measures the other users as much as the code: an OpenMP
region whose second thread is descheduled waits a whole time slice. The CPU time of the one
thread that does all the work (`time.thread_time`, with OMP_NUM_THREADS=1) is not charged
for waiting, so it compares kernel quality (ember vs inductor vs eager, before vs after a
change) even under load. It says nothing about how well the work is split over threads:
`benchmarks.run` measures that, on a quiet machine. `--kernels N` lists ember's N costliest
kernels (CPU ms per call), timed around each ctypes call. A compiler `ember-dynamic` (or
`inductor-dynamic`) compiles with `dynamic=True`, every size symbolic: against `ember` it shows
what symbolic kernels cost over static ones at the same shapes.
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import time
from collections.abc import Callable

import torch

import ember.wrapper.runtime as wrapper_runtime
from benchmarks import run, suite

kernel_ns: collections.Counter[str] = collections.Counter()
kernel_calls: collections.Counter[str] = collections.Counter()


def timed_load_kernel(load: Callable) -> Callable:
    """`load_kernel` whose kernels add their CPU time to `kernel_ns` (wrappers import it when loaded)."""

    def load_kernel(root: str, relative: str, sha256: str, symbol: str, num_params: int):
        fn = load(root, relative, sha256, symbol, num_params)

        def call(*args):
            start = time.thread_time_ns()
            fn(*args)
            kernel_ns[symbol] += time.thread_time_ns() - start
            kernel_calls[symbol] += 1

        return call

    return load_kernel


def cpu_ms(step: Callable[[], object], rounds: int) -> float:
    for _ in range(3):
        step()
    samples = []
    for _ in range(rounds):
        start = time.thread_time()
        step()
        samples.append(time.thread_time() - start)
    return min(samples) * 1e3


def benchmarked_step(workload: suite.Workload, compiler: str) -> Callable[[], object]:
    if workload.optimizer is not None:
        return run.optimizer_step(workload, compiler)
    model = workload.model
    if isinstance(model, torch.nn.Module):
        model = copy.deepcopy(model)
    if compiler != "eager":
        backend, _, dynamic = compiler.partition("-")  # ember-dynamic: sizes symbolic (Note: symbolic sizes)
        model = torch.compile(model, backend=backend, dynamic=True if dynamic == "dynamic" else None)
    return run.make_step(model, workload)


def profile(name: str, compilers: list[str], rounds: int, kernels: int, suite_name: str = "default") -> str:
    workload = run.SUITES[suite_name][name](False)
    if workload is None:
        return f"{name:22s} skipped (a package it needs is missing)"
    cells = []
    for compiler in compilers:
        if workload.optimizer is not None and compiler.endswith("-dynamic"):
            cells.append(f"{compiler} (static only)")
            continue
        torch._dynamo.reset()
        kernel_ns.clear()
        kernel_calls.clear()
        # the step the benchmark times: for training, forward and backward (run.make_step), and the
        # optimizer's update when the workload has one (run.optimizer_step)
        cells.append(f"{compiler} {cpu_ms(benchmarked_step(workload, compiler), rounds):8.2f}")
        steps = rounds + 3  # warm-up included: the counters ran through it
        for symbol, ns in kernel_ns.most_common(kernels if compiler.startswith("ember") else 0):
            calls = kernel_calls[symbol] // steps
            cells.append(f"\n    {symbol} {ns / steps / 1e6:8.3f} ms per step ({calls} call(s))")
    return f"{name:22s} " + "  ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=sorted(run.SUITES), default="default")
    parser.add_argument("--models", default=None, help="comma-separated workloads (default: all of the suite)")
    parser.add_argument("--compilers", default="eager,inductor,ember")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--kernels", type=int, default=0)
    args = parser.parse_args()
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: set OMP_NUM_THREADS=1, or kernels' worker threads are not counted")
    torch.set_num_threads(1)
    wrapper_runtime.load_kernel = timed_load_kernel(wrapper_runtime.load_kernel)
    print("CPU ms per call, one thread, minimum over the rounds")
    for name in (args.models or ",".join(run.SUITES[args.suite])).split(","):
        print(profile(name, args.compilers.split(","), args.rounds, args.kernels, args.suite), flush=True)


if __name__ == "__main__":
    main()
