"""GPU micro-benchmark of a language model's loss, forward and backward (Note: a one-hot sum is a
select, lower/one_hot_sums.py; Note: pointwise kernels in rows, codegen/blocks.py).

    python -m benchmarks.gpu_loss_backward [--rows 8192] [--classes 32000] [--json out.json]

`F.cross_entropy(logits.float(), labels)` then `.backward()` on bfloat16 logits, as a causal LM's
loss under autocast, and the same on float32 logits, timed with CUDA events (do_bench, median) for
eager, inductor, ember, and ember with pointwise kernels kept flat (`pointwise_rows=0`) to show
what the rows plan buys. Also reported: the kernels ember generated (forward and backward), of them the ones
planned in rows, and the largest gradient difference from eager on float64 logits.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import ember

COMPILERS = ("eager", "inductor", "ember", "ember_flat")


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def compiled(compiler: str):
    if compiler == "eager":
        return loss_fn
    if compiler == "ember_flat":
        return ember.compile(loss_fn, dynamic=False, pointwise_rows=0)
    return torch.compile(loss_fn, backend=compiler, dynamic=False)


def step(fn, logits: torch.Tensor, labels: torch.Tensor) -> None:
    logits.grad = None
    fn(logits, labels).backward()


def measure(compiler: str, logits: torch.Tensor, labels: torch.Tensor, exact: torch.Tensor) -> dict:
    from triton.testing import do_bench

    torch._dynamo.reset()
    fn = compiled(compiler)
    ember.metrics.reset()
    step(fn, logits, labels)
    row = {"kernels": ember.metrics.kernels_generated, "row_kernels": ember.metrics.row_kernels}
    row["max_error"] = (logits.grad.double() - exact).abs().max().item()
    row["ms"] = do_bench(lambda: step(fn, logits, labels), warmup=25, rep=200, return_mode="median")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_loss_backward", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--classes", type=int, default=32000)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    torch.manual_seed(0)
    labels = torch.randint(0, args.classes, (args.rows,), device="cuda")
    labels[::97] = -100  # ignore_index, as padding
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(args.rows, args.classes, device="cuda").to(dtype).requires_grad_()
        reference = logits.detach().double().requires_grad_()
        loss_fn(reference, labels).backward()
        name = f"cross_entropy_{str(dtype).removeprefix('torch.')}_{args.rows}x{args.classes}"
        results[name] = {c: measure(c, logits, labels, reference.grad) for c in COMPILERS}
        cells = ", ".join(f"{c} {r['ms']:.3f} ms" for c, r in results[name].items())
        ours = results[name]["ember"]
        print(f"  {name} forward+backward: {cells}; ember kernels {ours['kernels']} "
              f"(in rows {ours['row_kernels']}), max gradient error {ours['max_error']:.1e}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
