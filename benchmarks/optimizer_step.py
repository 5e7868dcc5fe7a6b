"""`optimizer.step()` alone, compiled, on a GPT-2's parameters: eager vs inductor vs ember.

    OMP_NUM_THREADS=1 python -m benchmarks.optimizer_step [--optimizer adamw|adam|sgd] [--layers 4]
                                                         [--width 256] [--compilers eager,inductor,ember]
                                                         [--device cpu|cuda]

Each parameter gets a fixed random gradient; every compiler steps its own copy of the parameters and
optimizer (one eager step first, so the states exist and one graph is compiled). The step is timed
interleaved over the compilers, in the CPU time of the calling thread (`time.thread_time`: steady
on a busy machine; with OMP_NUM_THREADS=1 that thread does all the work), as `eager` (the for-loop
path torch picks on the CPU), `eager_foreach`, and each compiler (`ember_one_per_parameter`: ember
with horizontal fusion off, a kernel per parameter; Note: horizontal fusion, ember/schedule/horizontal.py).
For ember it also prints the kernels and the inputs stored in place (Note: inputs written in place,
ember/lower/mutation.py) and checks the parameters against eager's after the timed steps. The whole
training step with AdamW is `python -m benchmarks.run --models gpt2_adamw`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import ember

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda params, foreach: torch.optim.AdamW(params, lr=1e-4, foreach=foreach),
    "adam": lambda params, foreach: torch.optim.Adam(params, lr=1e-4, foreach=foreach),
    "sgd": lambda params, foreach: torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=foreach),
}


def gpt2_parameters(layers: int, width: int, device: str = "cpu") -> list[torch.nn.Parameter]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=1000, n_positions=256))
    model = model.to(device)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def prepared_step(params: list[torch.nn.Parameter], optimizer: str, compiler: str) -> tuple[Callable, list]:
    """A step of `optimizer` over a copy of `params`, compiled by `compiler`; the copy."""
    mine = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(mine, params):
        p.grad = q.grad.clone()  # type: ignore[union-attr]
    opt = OPTIMIZERS[optimizer](mine, compiler == "eager_foreach")
    opt.step()  # eagerly: the states exist before the compile
    if compiler.startswith("eager"):
        step = opt.step
    elif compiler == "ember_one_per_parameter":  # horizontal fusion off (Note: horizontal fusion)
        step = ember.compile(opt.step, horizontal_fusion=False)
    else:
        step = torch.compile(opt.step, backend=compiler)
    return step, mine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--compilers", default="eager,eager_foreach,inductor,ember")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: each step's wall time, synchronized")  # fmt: skip
    args = parser.parse_args()
    params = gpt2_parameters(args.layers, args.width, args.device)
    clock = time.thread_time if args.device == "cpu" else time.perf_counter
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"{args.optimizer} over {sum(p.numel() for p in params)} parameters in {len(params)} tensors")
    steps, copies = {}, {}
    for compiler in args.compilers.split(","):
        ember.metrics.reset()
        steps[compiler], copies[compiler] = prepared_step(params, args.optimizer, compiler)
        start = time.perf_counter()
        steps[compiler]()
        note = f"first call {time.perf_counter() - start:.2f} s"
        if compiler.startswith("ember"):
            m = ember.metrics
            note += f", {m.kernels_generated} kernels, {m.inputs_written_in_place} inputs stored in place"
            note += f", {m.fallback_calls} fallbacks"
        print(f"{compiler}: {note}", flush=True)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            sync()
            start = clock()
            step()
            sync()
            samples[name].append(clock() - start)
    unit = "CPU" if args.device == "cpu" else "wall"
    for name, seconds in samples.items():
        print(f"{name:14s} median {statistics.median(seconds) * 1e3:7.2f} ms, min {min(seconds) * 1e3:7.2f} ms {unit}")
    if "ember" in copies and "eager" in copies:
        error = max((a - b).abs().max().item() for a, b in zip(copies["ember"], copies["eager"]))
        print(f"ember's parameters after {args.rounds + 2} steps: max abs difference from eager {error:.1e}")


if __name__ == "__main__":
    main()
