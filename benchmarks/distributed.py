"""FSDP training step of a LLaMA-style model (or GPT-2) on N ranks: eager vs inductor vs ember step time.

    python -m benchmarks.distributed --nproc 4                      # 4 GPUs, NCCL, default sizes
    python -m benchmarks.distributed --device cpu --nproc 2 --tiny  # gloo on the CPU: a smoke test

Spawns `--nproc` ranks (one GPU each, or gloo processes on the CPU) that join one process group
through a file store. Each rank builds `transformers`' LlamaForCausalLM from a LlamaConfig with
random weights (nothing downloaded; `--model gpt2`: GPT2LMHeadModel with an untied head), shards
it, and for each backend trains `--steps` AdamW steps on random token ids, after `--warmup` steps
(the first compiles). A step's time is the slowest rank's (every rank waits for the others in the
collectives), median over the timed steps; the first step's time includes compiling. Losses are
checked against eager's (same weights, same data) so a wrong compiled step cannot pass as a fast one.

Sharding (`--fsdp`):
  fully_shard   FSDP2 `fully_shard` per decoder layer and on the whole model: the collectives run
                in FSDP2's hooks, between the compiled graphs (dynamo does not trace them)
  simple        parameters sharded as DTensors along dim 0 and gathered in the forward through a
                parametrization (as torchtitan's SimpleFSDP): the all-gathers are in the forward
                graph and the reduce-scatters of the gradients in the backward graph, where the
                compiler places them

A backend may carry ember settings for its run (`;` between several):
`--backends inductor,ember,ember@EMBER_COLLECTIVES_IN_FLIGHT=0` compares ember with and without a
bound on its collectives in flight.
Each row also gives the step's peak memory (the largest rank's, allocated by torch on the GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.run import environment
from benchmarks.suite import HuggingFaceLoss

BACKENDS = ("eager", "inductor", "ember")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.distributed", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2, help="ranks (default: the GPUs)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fsdp", choices=("fully_shard", "simple"), default="fully_shard")
    parser.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, of " + ", ".join(BACKENDS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    parser.add_argument("--tiny", action="store_true", help="2 layers of width 64, 32 tokens: a smoke test")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads = 2, 64, 128, 4, 2
        args.vocab, args.batch, args.seq, args.steps, args.warmup = 256, 2, 32, 3, 2
    return args


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if args.model == "gpt2":  # dropout off: eager and compiled steps see the same numbers
        config = GPT2Config(
            n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, n_inner=args.intermediate,
            vocab_size=args.vocab, n_positions=args.seq, tie_word_embeddings=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return GPT2LMHeadModel(config).to(device=device, dtype=getattr(torch, args.dtype)).train()
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=args.seq, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, args.dtype)).train()


def shard(model: nn.Module, how: str, mesh) -> nn.Module:
    if how == "fully_shard":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch before 2.6
            from torch.distributed._composable.fsdp import fully_shard
        for layer in model.model.layers if hasattr(model, "model") else model.transformer.h:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return simple_fsdp(model, mesh)


class GatherShards(nn.Module):
    """A parametrization: the full parameter, all-gathered from its dim-0 shards; its gradient,
    different on each rank (each its own batch), is summed and scattered back to the shards
    (`grad_placements=[Partial()]`: a reduce-scatter in the backward, as SimpleFSDP's)."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, sharded):
        from torch.distributed.tensor import Partial, Replicate

        return sharded.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def simple_fsdp(model: nn.Module, mesh) -> nn.Module:
    """Every parameter a DTensor sharded along dim 0, gathered in the forward by a parametrization."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn.utils import parametrize

    for module in list(model.modules()):
        for name, parameter in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(parameter.detach(), mesh, [Shard(0)]))
            delattr(module, name)
            module.register_parameter(name, sharded)
            parametrize.register_parametrization(module, name, GatherShards(mesh), unsafe=True)
    return model


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    torch.distributed.barrier()


def backend_settings(spec: str) -> tuple[str, dict[str, str]]:
    """`ember@EMBER_A=1;EMBER_B=2` -> ("ember", {"EMBER_A": "1", "EMBER_B": "2"})."""
    backend, _, settings = spec.partition("@")
    pairs = [item.split("=", 1) for item in settings.split(";") if item]
    if any(len(p) != 2 or not p[0].startswith("EMBER_") for p in pairs) or (pairs and backend != "ember"):
        raise SystemExit(f"bad backend {spec!r}: settings are ember@EMBER_NAME=value[;EMBER_NAME=value]")
    return backend, dict(pairs)


def run_backend(spec: str, args: argparse.Namespace, device: torch.device, mesh, data: list) -> dict:
    """Train with one backend: each step's loss and seconds, and the peak memory (this rank's)."""
    backend, settings = backend_settings(spec)
    with environment(**settings):
        return train(backend, args, device, mesh, data)


def train(backend: str, args: argparse.Namespace, device: torch.device, mesh, data: list) -> dict:
    import ember

    torch._dynamo.reset()
    ember.metrics.reset()
    before = 0
    if device.type == "cuda":  # the peak is counted above what earlier backends left allocated
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    model = shard(build_model(args, device), args.fsdp, mesh)
    step_fn = HuggingFaceLoss(model)
    if backend != "eager":
        step_fn = torch.compile(step_fn, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    losses, seconds = [], []
    for ids in data:
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = step_fn(ids)
        loss.backward()
        optimizer.step()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    del model, optimizer, step_fn
    m = ember.metrics
    counts = {
        "collectives": m.collective_calls,
        "overlapped_kernels": m.collective_overlap_kernels,
        "most_in_flight": m.collectives_most_in_flight,
    }
    return {"losses": losses, "seconds": seconds, "peak_bytes": peak, "ember": counts if backend == "ember" else None}


def rank_main(rank: int, args: argparse.Namespace, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.nproc))
    torch.distributed.init_process_group(
        "nccl" if args.device == "cuda" else "gloo", init_method=f"file://{folder}/store", rank=rank,
        world_size=args.nproc, timeout=datetime.timedelta(minutes=10),
    )  # fmt: skip
    mesh = init_device_mesh(device.type, (args.nproc,))
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
    shape = (args.batch, args.seq)
    count = args.warmup + args.steps
    data = [torch.randint(0, args.vocab, shape, generator=generator).to(device) for _ in range(count)]
    results = {b: run_backend(b, args, device, mesh, data) for b in args.backends.split(",")}
    gathered: list = [None] * args.nproc
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        report(args, gathered)
    torch.distributed.destroy_process_group()
    # Leave without the interpreter's teardown, as tests/distributed_harness.py does: there torch's
    # C++ objects (gloo's workers, groups the device mesh still references) are destroyed in no fixed
    # order, and 3 of 23 runs with the results printed aborted ("terminate called without an active
    # exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report(args: argparse.Namespace, per_rank: list[dict]) -> None:
    """One line per backend: median step time (slowest rank per step), first step, losses vs eager."""
    rows = []
    eager = per_rank[0].get("eager")
    for backend in per_rank[0]:
        steps = [max(r[backend]["seconds"][i] for r in per_rank) for i in range(len(per_rank[0][backend]["seconds"]))]
        timed = steps[args.warmup :]
        losses = [r[backend]["losses"] for r in per_rank]
        error = None
        if eager is not None:
            error = max(abs(a - b) for r, mine in zip(per_rank, losses) for a, b in zip(mine, r["eager"]["losses"]))
        rows.append({"backend": backend, "median_step_ms": 1e3 * statistics.median(timed), "first_step_s": steps[0],
                     "losses_rank0": losses[0], "max_loss_diff_vs_eager": error,
                     "peak_mib": peak_mib([r[backend]["peak_bytes"] for r in per_rank]),
                     "ember_graphs": per_rank[0][backend]["ember"]})  # fmt: skip
    print(f"FSDP ({args.fsdp}) {args.model} step, {args.nproc} x {args.device}, {args.layers} layers, "
          f"hidden {args.hidden}, batch {args.batch} x {args.seq} per rank, {args.dtype}")  # fmt: skip
    for row in rows:
        diff = row["max_loss_diff_vs_eager"]
        peak = "" if row["peak_mib"] is None else f"   peak {row['peak_mib']:8.0f} MiB"
        print(f"  {row['backend']:9s} median step {row['median_step_ms']:9.2f} ms"
              f"   first step {row['first_step_s']:7.2f} s{peak}"
              f"   max |loss - eager's| {'-' if diff is None else f'{diff:.2e}'}"
              + (f"   in ember's graphs: {row['ember_graphs']}" if row["ember_graphs"] else ""))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))


def peak_mib(per_rank: list) -> float | None:
    return None if None in per_rank else max(per_rank) / 2**20


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    specs = args.backends.split(",")
    if len(set(specs)) < len(specs):
        raise SystemExit(f"a backend is named twice in {args.backends!r}; each row is one backend")
    unknown = {backend_settings(spec)[0] for spec in specs} - set(BACKENDS)
    if unknown:
        raise SystemExit(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"--nproc {args.nproc} needs as many GPUs; {torch.cuda.device_count()} present")
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.spawn(rank_main, (args, folder), nprocs=args.nproc)


if __name__ == "__main__":
    main()
