"""GPU micro-benchmark of reductions with few outputs (Note: split reductions).

    python -m benchmarks.gpu_reductions [--json out.json] [--only sum_64M,var_mean_8x8M]

Each program is one reduction whose outputs are too few to fill the GPU (a full sum of 64M
elements, the column sums of a (4M, 16) tensor, var_mean over rows of 8M, a loss), timed
with CUDA events (triton.testing.do_bench, median) as the bytes it must read over time,
against a device-to-device copy measured in the same run. Compilers: eager, inductor, ember
(split reductions at the default threshold) and ember with splitting off
(`split_reductions=0`, every output reduced by one program), to show what the split buys.
The error column is the largest difference from eager on float64 copies of the inputs,
relative to that result's magnitude.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import ember

NUMEL = 64 * 1024 * 1024


def programs() -> dict:
    """name -> (fn, inputs, bytes a perfect kernel reads)."""
    torch.manual_seed(0)
    x = torch.randn(NUMEL, device="cuda")
    offset = x + 100  # var with a large mean: cancellation would show in the error column
    target = torch.randn(NUMEL, device="cuda")
    columns = torch.randn(NUMEL // 16, 16, device="cuda")
    rows = torch.randn(8, NUMEL // 8, device="cuda")
    integers = torch.randint(-1000, 1000, (NUMEL // 2,), device="cuda")
    logits = torch.randn(8192, 32000, device="cuda")  # a language model's loss (Note: nested reductions on the GPU)
    labels = torch.randint(0, 32000, (8192,), device="cuda")
    logits_bf16 = torch.randn(16384, 128256, device="cuda", dtype=torch.bfloat16)
    labels_bf16 = torch.randint(0, 128256, (16384,), device="cuda")
    f32 = NUMEL * 4
    return {
        "sum_64M": (lambda x: x.sum(), (x,), f32),
        "amax_64M": (lambda x: x.amax(), (x,), f32),
        "argmax_64M": (lambda x: x.argmax(), (x,), f32),
        "var_mean_64M": (lambda x: torch.var_mean(x), (offset,), f32),
        "column_sum_4Mx16": (lambda x: x.sum(0), (columns,), f32),
        "var_mean_rows_8x8M": (lambda x: torch.var_mean(x, 1), (rows,), f32),
        "mse_loss_64M": (lambda a, b: F.mse_loss(a, b), (x, target), 2 * f32),
        "int64_sum_32M": (lambda x: x.sum(), (integers,), NUMEL // 2 * 8),
        "cross_entropy_8192x32000": (F.cross_entropy, (logits, labels), logits.numel() * 4),
        "cross_entropy_bf16_16384x128256": (F.cross_entropy, (logits_bf16, labels_bf16), logits_bf16.numel() * 2),
    }


def time_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def compiled(compiler: str, fn):
    if compiler == "eager":
        return fn
    if compiler == "ember_unsplit":
        return ember.compile(fn, dynamic=False, split_reductions=0)
    return torch.compile(fn, backend=compiler, dynamic=False)


def relative_error(got, want) -> float:
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    worst = 0.0
    for g, w in zip(got, want):
        scale = max(w.abs().max().item(), 1e-30) if w.is_floating_point() else 1.0
        worst = max(worst, (g.double() - w.double()).abs().max().item() / scale)
    return worst


COMPILERS = ("eager", "inductor", "ember", "ember_unsplit")


def report(only: set[str] | None) -> list[dict]:
    source = torch.randn(NUMEL, device="cuda")
    destination = torch.empty_like(source)
    copy_ms = time_ms(lambda: destination.copy_(source))
    copy_gbs = 2 * source.numel() * 4 / copy_ms / 1e6
    rows = [{"name": "copy_ (device to device)", "gb_per_s": copy_gbs, "ms": copy_ms}]
    for name, (fn, inputs, moved) in programs().items():
        if only and name not in only:
            continue
        want = fn(*(x.double() if x.is_floating_point() else x for x in inputs))
        row = {"name": name, "bytes": moved}
        for compiler in COMPILERS:
            torch._dynamo.reset()
            ember.metrics.reset()
            run = compiled(compiler, fn)
            with torch.no_grad():
                row[f"{compiler}_error"] = relative_error(run(*inputs), want)
                ms = time_ms(lambda run=run: run(*inputs))
            row[f"{compiler}_ms"] = ms
            row[f"{compiler}_of_copy"] = moved / ms / 1e6 / copy_gbs
            if compiler.startswith("ember"):
                row[f"{compiler}_kernels"] = ember.metrics.kernels_generated
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_reductions", description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--only", help="comma-separated program names")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    rows = report(set(args.only.split(",")) if args.only else None)
    print(f"copy_: {rows[0]['gb_per_s']:.0f} GB/s ({rows[0]['ms']:.3f} ms)")
    for row in rows[1:]:
        cells = ", ".join(f"{c} {row[f'{c}_ms']:.3f} ms = {row[f'{c}_of_copy']:.2f}x copy" for c in COMPILERS)
        errors = ", ".join(f"{c} {row[f'{c}_error']:.1e}" for c in COMPILERS)
        print(f"{row['name']}: {cells}; ember kernels {row['ember_kernels']} (unsplit {row['ember_unsplit_kernels']}); "
              f"relative error vs float64: {errors}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
