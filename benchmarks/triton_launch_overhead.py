"""The CPU cost of one Triton kernel launch as the wrapper makes it (Note: the fast launch,
ember/runtime/triton.py; Note: size classes, ember/runtime/triton_sized.py), without a GPU.

    python -m benchmarks.triton_launch_overhead [--against REV] [--calls 200000] [--rounds 7] [--only NAME]

Launchers of a static kernel and of a symbolic one (three buffers; the symbolic one also two
sizes, a grid computed per call and a size cap) are built as the wrapper builds them, with the
launch itself a Python no-op and no CUDA: what is timed is ember's Python per call, on the
thread that feeds the GPU. With `--against REV` the launchers of ember/runtime/triton.py at git
revision REV (loaded from `git show`, beside this checkout's) are timed too, interleaved with
this checkout's in one process, minimum over rounds. Prints nanoseconds per call and the load
average. On a busy machine count instructions instead: run `valgrind --tool=cachegrind
--cache-sim=no python -m benchmarks.triton_launch_overhead --against REV --rounds 1 --only NAME`
with `--calls 0` and `--calls N`; the difference of the two totals over N is the count per call.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

TARGET = ("cuda", 90, 32)
BUFFERS = ["*float32"] * 3
SIZES = (2, 37)  # (batch, tokens) of a decoding-sized call


class StandInModule:
    _sha256 = "0" * 64
    __file__ = str(Path(tempfile.gettempdir()) / "ember-launch-overhead.py")


def noop_launch(*args: Any) -> None:
    pass


def without_cuda(module: types.ModuleType) -> None:
    """Patches a runtime/triton module so that a launcher's first call compiles nothing and
    its launches call `noop_launch`."""
    module.stream_getter = lambda: lambda device: 0  # type: ignore[attr-defined]
    module.raw_stream = lambda device: 0  # type: ignore[attr-defined]
    module.torch_cuda_current_device = lambda: 0  # type: ignore[attr-defined]
    module.device_facts = lambda device: (TARGET, "stand-in")  # type: ignore[attr-defined]
    module.direct_launch = lambda kernel: (noop_launch, None, ())  # type: ignore[attr-defined]


def old_runtime(revision: str) -> types.ModuleType:
    """ember/runtime/triton.py at `revision`, imported under another name."""
    source = subprocess.run(["git", "show", f"{revision}:ember/runtime/triton.py"], capture_output=True, text=True,
                            check=True).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "ember_triton_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("ember_triton_old", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ember_triton_old"] = module
    spec.loader.exec_module(module)
    return module


def static_launcher(runtime: types.ModuleType) -> Any:
    launcher = runtime.TritonLauncher(StandInModule(), "k", ["pointwise"], SIZES[0] * SIZES[1] * 768, 0, [0],
                                      interpret=False, autotune=False, arguments=BUFFERS)  # fmt: skip
    launcher.compiled_kernel = lambda *args, **kwargs: None
    return launcher


def symbolic_launcher(runtime: types.ModuleType, sized: bool) -> Any:
    facts = {"variables": ["s0", "s1"], "variables_at": 3, "grid_numel": "s0*s1*768", "size_cap": 512}
    kind = runtime.TritonLauncher
    if sized:
        from ember.runtime.triton_sized import SizedTritonLauncher as kind
    launcher = kind(StandInModule(), "k", ["pointwise"], 2**62, 0, [0], interpret=False, autotune=False,
                    arguments=BUFFERS + ["int64", "int64"], **facts)  # fmt: skip
    launcher.compiled_kernel = lambda *args, **kwargs: None
    return launcher


def per_call_ns(launcher: Any, args: tuple, calls: int) -> float:
    launcher(*args)  # the first call configures and "compiles"
    start = time.perf_counter_ns()
    for _ in range(calls):
        launcher(*args)
    return (time.perf_counter_ns() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="", help="a git revision whose launchers are timed too")
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", default="", help="time only this launcher (for instruction counts under valgrind)")
    args = parser.parse_args()
    from ember.runtime import triton as runtime

    without_cuda(runtime)
    buffers = tuple(torch.empty(64) for _ in range(3))
    launchers = {"static": (static_launcher(runtime), buffers),
                 "symbolic": (symbolic_launcher(runtime, sized=True), (*buffers, *SIZES))}  # fmt: skip
    if args.against:
        old = old_runtime(args.against)
        without_cuda(old)
        launchers[f"static@{args.against}"] = (static_launcher(old), buffers)
        launchers[f"symbolic@{args.against}"] = (symbolic_launcher(old, sized=False), (*buffers, *SIZES))
    if args.only:
        launchers = {args.only: launchers[args.only]}
    best = {name: float("inf") for name in launchers}
    for _ in range(args.rounds):
        for name, (launcher, call_args) in launchers.items():
            best[name] = min(best[name], per_call_ns(launcher, call_args, args.calls))
    print(f"ns per launch (Python only, minimum of {args.rounds} rounds of {args.calls}); load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))  # fmt: skip
    for name, ns in best.items():
        print(f"  {name:24s} {ns:8.0f}")


if __name__ == "__main__":
    main()
