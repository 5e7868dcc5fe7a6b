"""`make demo` / `ember demo`: compile a pointwise-heavy program, show what ember made of it,
check it against eager and time both, saying where the difference comes from."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import ember

SIZE = 2048
ROUNDS = 25  # timed calls of each, alternating, after WARMUP untimed ones
WARMUP = 3


def program(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A GELU-ish activation, a normalization-free residual and a transposed slice."""
    h = torch.nn.functional.gelu(x * 1.702) * torch.sigmoid(y) + 0.5 * torch.tanh(x - y)
    h = torch.where(h > 0, h, h.exp() - 1) / (1 + x.abs())
    return (h + y.sin() * x.cos()).t()[::2]


def eager_passes(x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """(ops that eager runs as separate passes over memory, bytes they read and write): every aten
    op of the program that computes (views compute nothing)."""
    graph = make_fx(program)(x, y).graph
    ops = moved = 0
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op != "call_function" or not isinstance(value, torch.Tensor) or _is_view(node):
            continue
        inputs = [a.meta["val"] for a in node.args if isinstance(a, torch.fx.Node)]
        ops += 1
        moved += sum(t.numel() * t.element_size() for t in (*inputs, value))
    return ops, moved


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def interleaved_medians(steps: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Seconds per call of each step: WARMUP calls each, then ROUNDS rounds taking one sample of
    each in alternating order (so a busy machine slows both alike); the median of each."""
    for step in steps.values():
        for _ in range(WARMUP):
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_index in range(ROUNDS):
        for name in names if round_index % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            steps[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def show_generated_code(debug_dir: Path) -> None:
    (graph,) = list(debug_dir.iterdir())
    for kernel in sorted((graph / "kernels").glob("*.cpp")):
        source = kernel.read_text()
        print(f"==== generated kernel {kernel.name} ====")
        print(source[source.index('extern "C"') :])
    print("==== generated wrapper ====")
    print((graph / "wrapper.py").read_text())


def explain(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
    ops, eager_bytes = eager_passes(x, y)
    ember_bytes = x.nbytes + y.nbytes + out.nbytes
    print("==== what it computes ====")
    print(f"x, y: {SIZE}x{SIZE} float32. {ops} elementwise ops (gelu, sigmoid, tanh, exp, sin, cos, where, ...),")
    print(f"then the result transposed and every other row of that kept: {tuple(out.shape)}, strides {out.stride()}.")
    print("==== why ember is faster ====")
    print(f"eager runs the {ops} ops one at a time: each is a pass over memory with a full-size result")
    print(f"({eager_bytes / 2**20:.0f} MiB read and written in all), and it computes all {SIZE * SIZE} elements")
    print("of which the slice returns half.")
    print(f"ember fused the {ops} ops into {ember.metrics.kernels_generated} kernel: one pass that reads x and y")
    print(f"and writes the result once ({ember_bytes / 2**20:.0f} MiB), computing only the {out.numel()} elements")
    print("returned, in the order eager lays them out (column-major, so both inputs are read along")
    print("their rows), vectorized with the loop (erf inline, exp/sin/cos/tanh from libmvec), on every core.")


def main() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(SIZE, SIZE), torch.randn(SIZE, SIZE)
    debug_dir = Path(tempfile.mkdtemp(prefix="ember-demo-"))
    os.environ.setdefault("EMBER_DEBUG_DIR", str(debug_dir))
    ember.metrics.reset()

    start = time.perf_counter()
    compiled = ember.compile(program, debug=True, debug_dir=str(debug_dir))
    out = compiled(x, y)
    compile_seconds = time.perf_counter() - start
    show_generated_code(debug_dir)

    reference = program(x.double(), y.double())
    error = (out.double() - reference).abs().max().item()
    ok = torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-5)
    explain(x, y, out)
    seconds = interleaved_medians({"eager": lambda: program(x, y), "ember": lambda: compiled(x, y)})
    print("==== result ====")
    print(f"matches eager (float64 reference): {ok}  (max abs error {error:.2e})")
    print(f"kernels: {ember.metrics.kernels_generated}, fallbacks: {ember.metrics.fallback_calls}")
    print(f"compile time (dynamo + ember, incl. gcc unless cached): {compile_seconds:.2f} s")
    threads = torch.get_num_threads()
    print(f"median of {ROUNDS} alternating calls each, after {WARMUP} warm-up calls, {threads} threads:")
    eager_s, ember_s = seconds["eager"], seconds["ember"]
    print(f"eager: {eager_s * 1e3:.2f} ms   ember: {ember_s * 1e3:.2f} ms   speedup: {eager_s / ember_s:.2f}x")
    if not ok:
        raise SystemExit("demo: ember's result does not match eager")


if __name__ == "__main__":
    main()
