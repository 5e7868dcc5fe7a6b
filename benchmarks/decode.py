"""Greedy decoding with a KV cache on the CPU: eager, inductor and ember in one process, per token.

    python -m benchmarks.decode [--models gpt2,llama] [--compilers inductor,ember] [--tokens 32]
                                [--rounds 3] [--quick]

Each model is built from a transformers config with random weights (nothing downloaded) at
real size: GPT-2 small (12 layers, 768 wide, vocab 50257) and a LLaMA-style model (12 layers,
1024 wide, 16 query heads sharing 4 key/value heads, SwiGLU 2816, vocab 32000). Batch 1, an
8-token prompt, then one token per call: the decode graph multiplies one row by every weight
(Note: a vector times a matrix, ember/passes/vector_matmul.py), so a token costs about one
read of the model's weights from memory. Each compiler gets `torch.compile(model, backend=...,
dynamic=True)`; the first loop (compile included) is timed once, then the loops of every
compiler and eager in turns (`--rounds`), wall time, all at torch's thread count. The printed
tokens must equal eager's. `--quick`: two-layer models of width 128 (the smoke test).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.dynamic_shapes import generate  # greedy, with transformers' DynamicCache

VOCAB = {"gpt2": 50257, "llama": 32000}


def build(name: str, quick: bool) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    layers, width = (2, 128) if quick else (12, 768 if name == "gpt2" else 1024)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(2, width // 64),
                                         vocab_size=VOCAB[name], n_positions=1024)  # fmt: skip
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=layers,
                                      num_attention_heads=width // 64, num_key_value_heads=max(1, width // 256),
                                      vocab_size=VOCAB[name], max_position_embeddings=1024)  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def run_model(name: str, compilers: list[str], args: argparse.Namespace) -> None:
    model = build(name, args.quick)
    prompt = torch.randint(0, VOCAB[name], (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=prompt)  # transformers' own first-call costs are no one's
    loops: dict[str, Callable[[], torch.Tensor]] = {"eager": lambda: generate(model, prompt, args.tokens)}
    want, _ = timed(loops["eager"])
    first: dict[str, float] = {}
    for compiler in compilers:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=compiler, dynamic=True)
        loops[compiler] = lambda compiled=compiled: generate(compiled, prompt, args.tokens)
        got, first[compiler] = timed(loops[compiler])
        if not torch.equal(got, want):
            print(f"{name}: {compiler}'s tokens differ from eager's")
    seconds: dict[str, list[float]] = {k: [] for k in loops}
    for _ in range(args.rounds):
        for k, loop in loops.items():
            seconds[k].append(timed(loop)[1])
    eager_ms = statistics.median(seconds["eager"]) / args.tokens * 1e3
    print(f"{name}: {args.tokens} tokens, batch 1, {torch.get_num_threads()} threads; ms per token (median of "
          f"{args.rounds} loops)")  # fmt: skip
    print(f"  eager     {eager_ms:8.2f}")
    for compiler in compilers:
        ms = statistics.median(seconds[compiler]) / args.tokens * 1e3
        speedup = eager_ms / ms
        print(f"  {compiler:9s} {ms:8.2f} ({speedup:.2f}x)   first loop, compile included: {first[compiler]:.1f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--compilers", default="inductor,ember")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    import ember  # noqa: F401 - registers the backend

    for name in args.models.split(","):
        run_model(name, args.compilers.split(","), args)


if __name__ == "__main__":
    main()
