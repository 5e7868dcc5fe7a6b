"""A LLaMA-style training step on the GPU under bf16 autocast: eager, inductor and ember in one process.

    python -m benchmarks.llama_train [--steps 10] [--compilers eager,inductor,ember] [--mode reduce-overhead]
                                     [--layers 4] [--hidden 1024] [--batch 8] [--seq 512] [--fp32] [--quick]

The model is transformers' LlamaForCausalLM from a config (random weights, nothing downloaded):
hidden 1024, 4 layers, 16 heads, 4 KV heads, intermediate 2816, vocab 32000, sdpa attention. Each
compiler trains its own copy from the same initial weights on the same batches with AdamW under
`torch.autocast("cuda", dtype=torch.bfloat16)` (in float32 throughout with `--fp32`); the compiled
step is forward + loss + backward (the optimizer step runs eagerly for all). Reported per
compiler: the loss at every step (bf16 noise between compilers is expected, a drift is not), the
median step time over the steps after the first two, the first step's time (compile included)
and the peak memory of the timed steps.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import traceback

import torch


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, 128), attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).cuda()


def train(model: torch.nn.Module, compiler: str, batches: list, mode: str | None, fp32: bool = False) -> dict:
    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not fp32):
            return model(input_ids=ids, labels=ids).loss

    step = loss_of if compiler == "eager" else torch.compile(loss_of, backend=compiler, mode=mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, times = [], []
    for i, ids in enumerate(batches):
        if i == 2:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    return {"losses": losses, "first_s": times[0], "step_ms": statistics.median(times[2:]) * 1e3,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compilers", default="eager,inductor,ember")
    parser.add_argument("--mode", default=None, help="torch.compile mode for inductor and ember")
    parser.add_argument("--steps", type=int, default=10)
    for name, default in (("layers", 4), ("hidden", 1024), ("heads", 16), ("kv-heads", 4), ("intermediate", 2816),
                          ("vocab", 32000), ("batch", 8), ("seq", 512)):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--fp32", action="store_true", help="float32 throughout (no bf16 autocast)")
    parser.add_argument("--quick", action="store_true", help="a tiny model (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate = 2, 128, 4, 2, 256
        args.vocab, args.batch, args.seq, args.steps = 1000, 2, 64, 4
    torch.backends.cuda.matmul.allow_tf32 = False
    base = build(args)
    generator = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=generator)
               for _ in range(args.steps)]  # fmt: skip
    results = {}
    for compiler in args.compilers.split(","):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        try:
            results[compiler] = train(model, compiler, batches, args.mode, args.fp32)
            if compiler == "ember":  # what ember wrote in place (Note: in-place kernels, codegen/kernel.py)
                from ember.metrics import metrics

                written, donated = metrics.inplace_writes, metrics.donated_inputs_overwritten
                results[compiler]["in_place"] = f"{written} in-place writes, {donated} over donated inputs"
        except Exception as e:  # one compiler's failure is a row, not the end of the run
            traceback.print_exc()
            results[compiler] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        del model
        torch.cuda.empty_cache()
    precision = "float32" if args.fp32 else "bf16 autocast"
    print(f"LLaMA-style training step, {args.layers} layers, hidden {args.hidden}, batch {args.batch}x{args.seq}, "
          f"{precision}, AdamW, mode {args.mode}, {torch.cuda.get_device_name()}")  # fmt: skip
    for compiler, r in results.items():
        if "error" in r:
            print(f"{compiler:9s} ERROR {r['error']}")
            continue
        eager = results.get("eager", {}).get("step_ms")
        ratio = f" ({eager / r['step_ms']:.2f}x eager)" if eager else ""
        print(f"{compiler:9s} step {r['step_ms']:.1f} ms{ratio}, first step {r['first_s']:.1f} s, "
              f"peak {r['peak_gib']:.3f} GiB")  # fmt: skip
        print(f"{'':9s} losses {' '.join(f'{x:.4f}' for x in r['losses'])}")
        if "in_place" in r:
            print(f"{'':9s} {r['in_place']}")


if __name__ == "__main__":
    main()
