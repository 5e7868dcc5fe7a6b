"""Peak memory of one call, eager vs inductor vs ember, for every workload of `benchmarks.suite`.

    python -m benchmarks.memory [--models mlp,convnet] [--compilers eager,inductor,ember]
                                [--modes inference,training] [--quick]

Modes: `inference` runs each inference workload under no_grad, as benchmarks.run does;
`training` runs a training step (forward with grad, backward) of each workload that has
parameters: the suite's training workloads as they are, and the inference models with the
sum of their floating outputs as the loss (their modules stay in eval mode, so BatchNorm and
dropout behave as in inference; what changes is that the forward saves tensors for the backward).

Note: how peak memory is measured
    The peak is the highest sum of live bytes that torch's CPU allocator handed out during one
    call, from torch.profiler's memory events (`profile_memory=True`): every allocation and free
    through c10's allocator, which eager's ops, inductor's `empty_strided`, ember's buffers, oneDNN's
    scratchpads (ideep allocates them through c10) and autograd's saved tensors and gradients all
    go through. What exists before the call (inputs, weights, gradients of an earlier step: they
    are dropped before the measured step) is not counted.
    - ember's pool of large buffers (runtime/memory.py, Note: pooled large buffers) holds storages
      between calls, which the profiler would not see being reused: it is emptied before the
      measured call, so each storage the call takes is a fresh allocation, and it stays counted
      until the end of the call (the pool keeps it).
    - Not seen by either measure: memory that a library allocates with its own malloc, such as
      MKL's packing buffers behind eager's and inductor's matmuls (kept by MKL between calls).
      oneDNN's per-call scratchpad is seen; so this measure is, if anything, unfair to ember.
    Each compiler is warmed up (compiled, two calls) before it is measured.
"""

from __future__ import annotations

import argparse
import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_flatten

from benchmarks import suite
from benchmarks.run import make_step
from ember.runtime.memory import release_pooled_buffers

COMPILERS = ("eager", "inductor", "ember")
MODES = ("inference", "training")


def call_peak_bytes(fn: Callable, *args: Any) -> int:
    """The highest sum of live torch-allocator bytes during `fn(*args)` (Note: how peak memory is measured)."""
    release_pooled_buffers()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


class SumOfOutputs(torch.nn.Module):
    """An inference model as a training workload: its floating outputs summed into one loss."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs: Any) -> torch.Tensor:
        outputs, _ = tree_flatten(self.model(*inputs))
        return sum(out.float().mean() for out in outputs if isinstance(out, torch.Tensor) and out.is_floating_point())


def workload_for(name: str, mode: str, quick: bool) -> suite.Workload | None:
    """`name`'s workload in `mode`, or None where the suite has no such step."""
    workload = suite.build(name, quick)
    if workload is None or workload.is_training == (mode == "training"):
        return workload
    if mode == "inference" or not isinstance(workload.model, torch.nn.Module):
        return None
    if not any(p.requires_grad for p in workload.model.parameters()):
        return None
    return workload._replace(model=SumOfOutputs(workload.model), is_training=True)


def measure(workload: suite.Workload, compiler: str) -> int:
    """Peak bytes of one warm step of `workload` run by `compiler`."""
    torch._dynamo.reset()
    model = workload.model if compiler == "eager" else torch.compile(workload.model, backend=compiler, dynamic=False)
    step = make_step(model, workload)
    module = workload.model if isinstance(workload.model, torch.nn.Module) else None
    for _ in range(3):  # compile, then steady state
        step()
    if module is not None:
        for p in module.parameters():
            p.grad = None  # the measured step allocates its gradients afresh, for every compiler
    return call_peak_bytes(step)


def row(name: str, mode: str, compilers: list[str], quick: bool) -> list[str] | None:
    workload = workload_for(name, mode, quick)
    if workload is None:
        return None
    cells = [name, mode]
    peaks: dict[str, int] = {}
    for compiler in compilers:
        try:
            peaks[compiler] = measure(workload, compiler)
            cells.append(f"{peaks[compiler] / 2**20:.2f}")
        except Exception as e:  # one compiler failing on one model is a row entry, not the end
            cells.append(f"error: {type(e).__name__}")
    for compiler in compilers:
        if compiler != "eager":
            ratio = peaks[compiler] / max(peaks["eager"], 1) if compiler in peaks and "eager" in peaks else None
            above = ratio is not None and peaks[compiler] > peaks["eager"]  # (a ratio of 1.0002 prints as 1.000)
            cells.append("-" if ratio is None else f"{ratio:.3f}" + (" (above)" if above else ""))
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(suite.WORKLOADS))
    parser.add_argument("--compilers", default=",".join(COMPILERS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for the smoke test)")
    args = parser.parse_args()
    compilers = args.compilers.split(",")
    others = [c for c in compilers if c != "eager"]
    header = ["model", "mode", *(f"{c} MiB" for c in compilers), *(f"{c}/eager" for c in others)]
    print("peak of one warm call, torch.profiler memory events (Note: how peak memory is measured)")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    warnings.simplefilter("ignore")
    for mode in args.modes.split(","):
        for name in args.models.split(","):
            cells = row(name, mode, compilers, args.quick)
            if cells is not None:
                print(" | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
