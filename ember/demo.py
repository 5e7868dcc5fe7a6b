"""`make demo` / `ember demo`: compile a pointwise-heavy program, show what ember made of it,
check it against eager and time both."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

import ember


def program(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A GELU-ish activation, a normalization-free residual and a transposed slice."""
    h = torch.nn.functional.gelu(x * 1.702) * torch.sigmoid(y) + 0.5 * torch.tanh(x - y)
    h = torch.where(h > 0, h, h.exp() - 1) / (1 + x.abs())
    return (h + y.sin() * x.cos()).t()[::2]


def median_time(fn, *args, repeat: int = 30) -> float:
    for _ in range(3):
        fn(*args)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(2048, 2048), torch.randn(2048, 2048)
    debug_dir = Path(tempfile.mkdtemp(prefix="ember-demo-"))
    os.environ.setdefault("EMBER_DEBUG_DIR", str(debug_dir))
    ember.metrics.reset()

    start = time.perf_counter()
    compiled = ember.compile(program, debug=True, debug_dir=str(debug_dir))
    out = compiled(x, y)
    compile_seconds = time.perf_counter() - start

    (graph,) = list(debug_dir.iterdir())
    for kernel in sorted((graph / "kernels").glob("*.cpp")):
        source = kernel.read_text()
        print(f"==== generated kernel {kernel.name} ====")
        print(source[source.index('extern "C"') :])
    print("==== generated wrapper ====")
    print((graph / "wrapper.py").read_text())

    reference = program(x.double(), y.double())
    error = (out.double() - reference).abs().max().item()
    ok = torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-5)
    eager_s, ember_s = median_time(program, x, y), median_time(compiled, x, y)
    print("==== result ====")
    print(f"matches eager (float64 reference): {ok}  (max abs error {error:.2e})")
    print(f"kernels: {ember.metrics.kernels_generated}, fallbacks: {ember.metrics.fallback_calls}")
    print(f"compile time (dynamo + ember, incl. gcc unless cached): {compile_seconds:.2f} s")
    print(f"eager: {eager_s * 1e3:.2f} ms   ember: {ember_s * 1e3:.2f} ms   speedup: {eager_s / ember_s:.2f}x")
    if not ok:
        raise SystemExit("demo: ember's result does not match eager")


if __name__ == "__main__":
    main()
