"""Transposed access on the CPU: eager vs inductor vs ember (Note: 2-D tiles, ember/codegen/tiling.py).

    OMP_NUM_THREADS=1 python -m benchmarks.transpose [--size 4096] [--rounds 15] [--compilers eager,inductor,ember]

Two float32 kernels over a size x size matrix: a transpose copy (`x.t().contiguous()`) and a
transpose plus a contiguous matrix. Timed as CPU time of the calling thread (steady on a busy
machine; run single-threaded), the compilers interleaved round by round, medians reported.
Also runs as a plain script (`python benchmarks/transpose.py`), so another checkout's ember
on PYTHONPATH can be timed for a before/after comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def transpose_copy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous()


def transpose_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.t() + y


def cpu_ms(fn: Callable[[], object]) -> float:
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * 1e3


def measure(size: int, rounds: int, compilers: list[str]) -> list[str]:
    x, y = torch.randn(size, size), torch.randn(size, size)
    lines = []
    for workload in (transpose_copy, transpose_add):
        calls = {}
        for compiler in compilers:
            torch._dynamo.reset()
            fn = workload if compiler == "eager" else torch.compile(workload, backend=compiler, dynamic=False)
            torch.testing.assert_close(fn(x, y), workload(x, y), rtol=0, atol=0)
            calls[compiler] = lambda fn=fn: fn(x, y)
        samples: dict[str, list[float]] = {c: [] for c in compilers}
        for _ in range(rounds):  # interleaved: load on the machine falls on every compiler alike
            for compiler in compilers:
                samples[compiler].append(cpu_ms(calls[compiler]))
        cells = "  ".join(f"{c} {statistics.median(s):8.2f}" for c, s in samples.items())
        lines.append(f"{workload.__name__:16s} {size}x{size} float32 (CPU ms, median)  {cells}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--compilers", default="eager,inductor,ember")
    args = parser.parse_args()
    import ember  # noqa: F401  (registers the backend)

    for line in measure(args.size, args.rounds, args.compilers.split(",")):
        print(line, flush=True)


if __name__ == "__main__":
    main()
