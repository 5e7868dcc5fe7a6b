"""GPU reports for ember's Triton backend: per-kernel bandwidth and peak memory.

    python -m benchmarks.gpu [--json out.json]

Bandwidth: memory-bound programs that ember compiles to one kernel each (a cheap-op chain
over 64M elements, softmax and layer norm over 8192x8192), timed with CUDA events
(triton.testing.do_bench, median), as the least bytes they must move over time, against
a device-to-device copy measured in the same run. Eager and inductor are timed alongside.

Peak memory: torch.cuda.max_memory_allocated() over one forward of the MLP and encoder
layer benchmarks at GPU sizes (benchmarks.run.on_device), eager against ember and inductor,
counting only what the forward allocates beyond the model and its inputs.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import ember
from benchmarks import suite
from benchmarks.run import on_device

NUMEL = 64 * 1024 * 1024
ROWS = COLS = 8192


def bandwidth_programs() -> dict:
    """name -> (fn, inputs, bytes a perfect kernel moves)."""
    torch.manual_seed(0)
    a, b, c = (torch.randn(NUMEL, device="cuda") for _ in range(3))
    x = torch.randn(ROWS, COLS, device="cuda")
    w, bias = torch.randn(COLS, device="cuda"), torch.randn(COLS, device="cuda")
    matrix = ROWS * COLS * 4
    return {
        "cheap_op_chain_64M": (suite.bandwidth_chain, (a, b, c), 4 * NUMEL * 4),
        "softmax_8192x8192": (lambda x: torch.softmax(x, -1), (x,), 2 * matrix),
        "layer_norm_8192x8192": (lambda x, w, b: F.layer_norm(x, (COLS,), w, b), (x, w, bias), 2 * matrix + 8 * COLS),
    }


def time_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def bandwidth_report() -> list[dict]:
    rows = []
    source = torch.randn(NUMEL, device="cuda")
    target = torch.empty_like(source)
    copy_ms = time_ms(lambda: target.copy_(source))
    copy_gbs = 2 * source.numel() * 4 / copy_ms / 1e6
    rows.append({"name": "copy_ (device to device)", "gb_per_s": copy_gbs, "ms": copy_ms})
    for name, (fn, inputs, moved) in bandwidth_programs().items():
        row = {"name": name, "bytes": moved}
        for compiler in ("eager", "inductor", "ember"):
            torch._dynamo.reset()
            ember.metrics.reset()
            run = fn if compiler == "eager" else torch.compile(fn, backend=compiler, dynamic=False)
            with torch.no_grad():
                out = run(*inputs)
                want = fn(*inputs)
                row[f"{compiler}_max_error"] = (out - want).abs().max().item()
                ms = time_ms(lambda run=run: run(*inputs))
            row[f"{compiler}_ms"] = ms
            row[f"{compiler}_gb_per_s"] = moved / ms / 1e6
            row[f"{compiler}_of_copy"] = row[f"{compiler}_gb_per_s"] / copy_gbs
            if compiler == "ember":
                row["ember_kernels"] = ember.metrics.kernels_generated
        rows.append(row)
    return rows


def peak_memory_report() -> list[dict]:
    rows = []
    for name in ("mlp", "encoder_layer", "encoder_layer_unfused"):
        workload = on_device(suite.build(name), "cuda")
        row = {"name": name}
        for compiler in ("eager", "inductor", "ember"):
            torch._dynamo.reset()
            model = workload.model if compiler == "eager" else torch.compile(workload.model, backend=compiler)
            with torch.no_grad():
                model(*workload.inputs)  # compile and warm up outside the measurement
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                out = model(*workload.inputs)
                torch.cuda.synchronize()
                row[f"{compiler}_peak_bytes"] = torch.cuda.max_memory_allocated() - before
                del out
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}")
    bandwidth = bandwidth_report()
    print("bandwidth (least bytes moved / median time):")
    for row in bandwidth:
        if "bytes" not in row:
            print(f"  {row['name']}: {row['gb_per_s']:.0f} GB/s ({row['ms']:.3f} ms)")
            continue
        cells = ", ".join(
            f"{c} {row[f'{c}_gb_per_s']:.0f} GB/s = {row[f'{c}_of_copy']:.2f}x copy ({row[f'{c}_ms']:.3f} ms)"
            for c in ("eager", "inductor", "ember")
        )
        print(f"  {row['name']}: {cells}; ember kernels {row['ember_kernels']}, "
              f"max error ember {row['ember_max_error']:.1e}")  # fmt: skip
    memory = peak_memory_report()
    print("peak memory of one forward (bytes allocated beyond model and inputs):")
    for row in memory:
        cells = ", ".join(f"{c} {row[f'{c}_peak_bytes'] / 2**20:.1f} MiB" for c in ("eager", "inductor", "ember"))
        print(f"  {row['name']}: {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "peak_memory": memory}, f, indent=2)


if __name__ == "__main__":
    main()
