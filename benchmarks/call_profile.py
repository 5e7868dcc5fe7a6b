"""Where a compiled call's host time goes: a model compiled by ember with static and with symbolic
sizes, the host and wall time of a call of each, and cProfile's top functions over many calls.

    python -m benchmarks.call_profile [--case llama] [--shape 2,50] [--device cuda] [--calls 100] [--top 25]

Cases are benchmarks/dynamic_shapes.py's. On a GPU, small models are bound by the host (the
Python of dynamo's guards, AOTAutograd's wrappers and ember's wrapper and launchers), so the
profile is where their time goes. On an H100 it showed, for instance, that a symbolic LLaMA's
wrapper moved six 0-d CPU inputs to the GPU each call, each a copy the host waits for.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import time
from collections.abc import Callable

import torch

from benchmarks.dynamic_shapes import CASES, _static_call, _symbolic_call


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_ms(fn: Callable[[], object], device: str, rounds: int, wait: bool) -> float:
    """The least milliseconds of a call: to a synchronized device (`wait`), or of the host alone."""
    best = float("inf")
    for _ in range(rounds):
        synchronize(device)
        start = time.perf_counter()
        fn()
        if wait:
            synchronize(device)
        best = min(best, time.perf_counter() - start)
        synchronize(device)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.call_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="llama", choices=sorted(CASES))
    parser.add_argument("--shape", default="2,50", help="batch,sequence")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    case = CASES[args.case]()
    if case.module is not None:
        case.module.to(args.device)
    shape = tuple(int(n) for n in args.shape.split(","))
    compiled = {
        "static": torch.compile(functools.partial(_static_call, case.model), backend="ember", dynamic=False),
        "symbolic": torch.compile(functools.partial(_symbolic_call, case.model), backend="ember", dynamic=True),
    }
    inputs = tuple(x.to(args.device) for x in case.make_inputs(*shape))
    with torch.no_grad():
        for fn in compiled.values():  # compile, then warm up
            for _ in range(3):
                fn(*inputs)
        for name, fn in compiled.items():
            call = functools.partial(fn, *inputs)
            wall = best_ms(call, args.device, 50, wait=True)
            host = best_ms(call, args.device, 50, wait=False)
            print(f"{args.case} {shape} {name}: wall {wall:.3f} ms a call, host {host:.3f} ms", flush=True)
        for name, fn in compiled.items():
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                fn(*inputs)
            profile.disable()
            synchronize(args.device)
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
            print(f"===== {name}: {args.calls} calls, by own time\n{out.getvalue()}", flush=True)


if __name__ == "__main__":
    main()
