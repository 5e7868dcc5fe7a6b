"""Accuracy and speed of ember's float32 vector math (renderer/vector_math.py) against float64
eager, eager float32 and glibc's libmvec.

    python -m benchmarks.vector_math            # every 2^32 float32 input, then the timings
    python -m benchmarks.vector_math --stride 997

Timings are one thread, 4M elements, the minimum of interleaved rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import time
from pathlib import Path

import torch

from ember.renderer.vector_math import ERF_SOURCE
from ember.runtime.cpu import compile_cpp, load_kernel

# name: (eager function, ember's expression, libmvec's expression) of x
FUNCTIONS = {
    "erf": (torch.erf, "ember_erff(x[i])", "erff(x[i])"),
    "gelu": (torch.nn.functional.gelu, "x[i] * 0.5f * (ember_erff(x[i] * 0.70710678f) + 1.0f)",
             "x[i] * 0.5f * (erff(x[i] * 0.70710678f) + 1.0f)"),
}  # fmt: skip

KERNEL = r"""#include <cstdint>
{source}
extern "C" {{ __attribute__((simd("notinbranch"))) float erff(float) noexcept; }}
extern "C" void ember_{name}(const float* __restrict__ x, float* __restrict__ y, int64_t n) {{
  #pragma omp simd
  for (int64_t i = 0; i < n; i++) y[i] = {inline};
}}
extern "C" void libmvec_{name}(const float* __restrict__ x, float* __restrict__ y, int64_t n) {{
  #pragma omp simd
  for (int64_t i = 0; i < n; i++) y[i] = {libm};
}}
"""


def compiled(name: str, variant: str):
    """`variant` ("ember" or "libmvec") of `name` as a function of two float32 tensors."""
    _, inline, libm = FUNCTIONS[name]
    source = KERNEL.format(source=ERF_SOURCE, name=name, inline=inline, libm=libm)
    cache = Path(os.environ.get("EMBER_CACHE_DIR", tempfile.gettempdir())) / "vector_math"
    kernel = compile_cpp(source, f"{variant}_{name}", cache, "g++", "vector_math")
    fn = load_kernel(str(kernel.path), kernel.symbol, 3)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def run(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        fn(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    return run


def ulp_error(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of the float32 ulp at `exact` (2^-149 below the normal range);
    0 where both are the same NaN/inf, inf where only one is."""
    _, exponent = torch.frexp(exact)
    ulp = torch.ldexp(torch.ones_like(exact), (exponent - 24).clamp(min=-149))
    err = (got.double() - exact).abs() / ulp
    same = (got.double() == exact) | (got.isnan() & exact.isnan())
    return torch.where(same, torch.zeros_like(err), torch.nan_to_num(err, nan=float("inf")))


def bit_patterns(start: int, stop: int, stride: int) -> torch.Tensor:
    bits = torch.arange(start, stop, stride, dtype=torch.int64)
    return (bits - (bits >= 2**31).long() * 2**32).int().view(torch.float32)


def max_ulp(name: str, stride: int = 1, chunk: int = 1 << 24) -> tuple[float, float]:
    """(max ulp error, the input where it occurs) over every `stride`-th float32 bit pattern."""
    reference, _, _ = FUNCTIONS[name]
    run = compiled(name, "ember")
    worst, where = 0.0, 0.0
    for start in range(0, 2**32, chunk * stride):
        x = bit_patterns(start, min(start + chunk * stride, 2**32), stride)
        err = ulp_error(run(x, torch.empty_like(x)), reference(x.double()))
        i = int(err.argmax())
        if float(err[i]) > worst:
            worst, where = float(err[i]), float(x[i])
    return worst, where


def timings(name: str, n: int = 1 << 22, rounds: int = 30) -> dict[str, float]:
    """Best ms per call; at 4M elements memory bandwidth bounds all three, at 16K the arithmetic."""
    reference, _, _ = FUNCTIONS[name]
    x = torch.randn(n) * 1.5
    out = torch.empty_like(x)
    ember, libmvec = compiled(name, "ember"), compiled(name, "libmvec")
    variants = {
        "eager": lambda: out.copy_(reference(x)) if name == "gelu" else reference(x, out=out),
        "ember": lambda: ember(x, out),
        "libmvec": lambda: libmvec(x, out),
    }
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for key, fn in variants.items():
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    return {k: v * 1e3 for k, v in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stride", type=int, default=1, help="check every STRIDE-th float32 bit pattern")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in FUNCTIONS:
        if name != "gelu":  # gelu's reference is eager's float32 erf, not an exact one
            worst, where = max_ulp(name, args.stride)
            print(f"{name}: max {worst:.3f} ulp (at {where!r})")
        for n in (1 << 22, 1 << 14):
            ms = timings(name, n, rounds=30 if n > 1 << 16 else 3000)
            print(f"  {n} elements, 1 thread, us: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ms.items()))


if __name__ == "__main__":
    main()
