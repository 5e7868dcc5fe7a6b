"""Compiled models under torch.distributed: DDP, FSDP2, DTensor tensor parallelism, on 2 ranks.

Each test spawns two ranks (tests/distributed_harness.py: gloo on the CPU, NCCL under
EMBER_TEST_DEVICE=cuda) that train a tiny model a few steps eagerly and through ember, from the
same initial weights and data, and hand back every step's loss and gradients; the test compares
them per rank. Both ranks compile into one fresh cache folder at the same time, and afterwards
every entry in it must pass the cache's own checks (harness `assert_cache_intact`).

Where the collectives are: DDP (dynamo's DDPOptimizer splits the graph at the gradient buckets)
and FSDP2's `fully_shard` run them in hooks between ember's graphs; tensor parallelism, FSDP with
DTensor parameters gathered in the forward (test_fsdp_collectives_in_the_graph) and functional
collectives called directly put them in the graphs, where ember schedules them (Note: collectives
in the graph, ember/schedule/collectives.py) and the tests also require `ember.metrics` to count
them. FSDP2 with its hooks traced (`skip_fsdp_hooks = False`) runs only on a torch that still has it.

Tolerance: float32 throughout. ember's kernels fuse and may sum in another order than eager's
(a different rounding of each of the at most 64-term sums here, about 64 * 2^-24 ~ 4e-6 relative
in the worst case); the collectives themselves are the same calls on both sides. Over three SGD
steps of these small models that stays below 1e-5 relative, so losses and gradients must agree
to rtol=1e-5, atol=1e-6 (a wrong collective, a missed or doubled reduction, or a buffer reused
while a collective still reads it, is off by O(1)).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed_harness import assert_cache_intact, distributed_device, run_ranks

STEPS = 3
RTOL, ATOL = 1e-5, 1e-6  # why: the module docstring
if distributed_device() == "cuda":  # cuBLAS and Triton's reductions round differently again: 4x
    RTOL, ATOL = 4e-5, 4e-6


# ---- models ---------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Blocks(nn.Module):
    """Residual MLP blocks: one FSDP2 unit per block, or DDP buckets split between them."""

    def __init__(self, depth: int = 2, dim: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(MLP(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


class Attention(nn.Module):
    """Causal self-attention with a residual; heads are split over ranks by tensor parallelism
    (the views infer the local head count)."""

    def __init__(self, dim: int = 16, head_dim: int = 4):
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, s, -1))


# ---- one rank's training run ----------------------------------------------------------------


def local(t: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a tensor (a DTensor's local shard), on the CPU."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().cpu().clone()


def train(model: nn.Module, batches: list) -> dict:
    """STEPS of SGD on `model`; each step's loss and gradients (this rank's part)."""
    # foreach=False: CUDA's default foreach update cannot mix DTensor and plain parameters
    # (tensor-parallel scenarios shard only some); one update per parameter is the same math.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    losses, grads = [], []
    for x, target in batches:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        losses.append(loss.item())
        grads.append([local(p.grad) for p in model.parameters()])
        optimizer.step()
    return {"losses": losses, "grads": grads}


def batches(device: torch.device, seed: int, shape: tuple[int, ...]) -> list:
    generator = torch.Generator().manual_seed(seed)
    data = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)) for _ in range(STEPS)]
    return [(x.to(device), y.to(device)) for x, y in data]


def eager_and_ember(make_model, data: list) -> dict:
    """Train two identical models from `make_model()`, one eagerly and one compiled by ember."""
    import ember

    eager = train(make_model(), data)
    torch._dynamo.reset()
    ember.metrics.reset()
    compiled = train(torch.compile(make_model(), backend="ember"), data)
    counts = ember.metrics
    metrics = {"graphs": counts.graphs_compiled, "kernels": counts.kernels_generated,
               "fallbacks": counts.fallback_calls, "fallback_ops": dict(counts.fallback_ops),
               "collectives": counts.collective_calls, "overlapped": counts.collective_overlap_kernels}  # fmt: skip
    return {"eager": eager, "ember": compiled, "metrics": metrics}


# ---- the scenarios, each run on every rank --------------------------------------------------


def ddp_scenario(rank: int, world_size: int, device: torch.device) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert torch._dynamo.config.optimize_ddp, "dynamo's DDP graph splitting is on by default"
    # DDP and DDPOptimizer make the first bucket 1 MiB and refuse smaller later ones: buckets of
    # 2 KiB (this model has 9 KiB of parameters) make DDPOptimizer split the graph in several
    torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 2048

    def make_model():
        torch.manual_seed(0)
        return DDP(
            Blocks().to(device), bucket_cap_mb=2048 / 2**20, device_ids=[device] if device.type == "cuda" else None
        )

    return eager_and_ember(make_model, batches(device, seed=rank, shape=(4, 16)))


def fsdp_scenario(rank: int, world_size: int, device: torch.device, per_block: bool) -> dict:
    fully_shard = fsdp_fully_shard()

    def make_model():
        torch.manual_seed(0)
        model = Blocks().to(device)
        if per_block:
            for block in model.blocks:
                fully_shard(block)
        return fully_shard(model)

    return eager_and_ember(make_model, batches(device, seed=rank, shape=(4, 16)))


def fsdp_fully_shard():
    """FSDP2's `fully_shard`: torch.distributed.fsdp since torch 2.6, _composable.fsdp before."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def tensor_parallel_scenario(rank: int, world_size: int, device: torch.device, kind: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (world_size,))
    if kind == "mlp":
        make, plan, shape = MLP, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, (4, 16)
    else:
        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
        make, shape = Attention, (2, 8, 16)

    def make_model():
        torch.manual_seed(0)
        return parallelize_module(make().to(device), mesh, plan)

    return eager_and_ember(make_model, batches(device, seed=0, shape=shape))  # every rank sees the same batch


def functional_collectives_scenario(rank: int, world_size: int, device: torch.device) -> dict:
    """all_reduce, all_gather and reduce_scatter called directly, with work that needs none of them."""
    c10d, group = torch.ops._c10d_functional, torch.distributed.group.WORLD.group_name

    def step(x, w):
        summed = c10d.wait_tensor(c10d.all_reduce(torch.tanh(x) * 2, "sum", group))
        gathered = c10d.all_gather_into_tensor(x + 1, world_size, group)
        local = torch.sigmoid(x @ w) * x  # needs no collective: runs while they are in flight
        scattered = c10d.reduce_scatter_tensor(summed * w.sum(), "sum", world_size, group)
        return c10d.wait_tensor(scattered).sum() + c10d.wait_tensor(gathered).mean() + local.sum(), summed

    torch.manual_seed(rank)
    x, w = torch.randn(8, 8, device=device), torch.randn(8, 8, device=device)
    import ember

    ember.metrics.reset()
    got = torch.compile(step, backend="ember")(x, w)
    m = ember.metrics
    metrics = {"graphs": m.graphs_compiled, "kernels": m.kernels_generated, "fallbacks": m.fallback_calls,
               "fallback_ops": dict(m.fallback_ops), "collectives": m.collective_calls,
               "overlapped": m.collective_overlap_kernels}  # fmt: skip
    return {"eager": [t.cpu() for t in step(x, w)], "ember": [t.cpu() for t in got], "metrics": metrics}


def gathers_in_flight_scenario(rank: int, world_size: int, device: torch.device) -> dict:
    """Four all-gathers of weights, each gathered weight used by the next layer: with no bound on
    collectives in flight ember issues all four at the start (their inputs are the graph's)."""
    import logging

    import ember

    c10d, group = torch.ops._c10d_functional, torch.distributed.group.WORLD.group_name

    def layers(x, *shards):
        for shard in shards:
            x = torch.tanh(x @ c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world_size, group)))
        return x

    torch.manual_seed(rank)
    x = torch.randn(4, 8, device=device)
    shards = [torch.randn(8 // world_size, 8, device=device) for _ in range(4)]
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ember")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    ember.metrics.reset()
    got = torch.compile(layers, backend="ember")(x, *shards)
    m = ember.metrics
    return {"eager": layers(x, *shards).cpu(), "ember": got.cpu(), "collectives": m.collective_calls,
            "most_in_flight": m.collectives_most_in_flight, "overlapped": m.collective_overlap_kernels,
            "messages": [t for t in messages if "one at a time" in t]}  # fmt: skip


def simple_fsdp_scenario(rank: int, world_size: int, device: torch.device) -> dict:
    """FSDP with its collectives in the graph: parameters sharded as DTensors along dim 0 and
    gathered inside the module's forward (as torchtitan's SimpleFSDP does), so the forward graph
    holds the all-gathers and the backward graph the reduce-scatters of the gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (world_size,))

    class ShardedLinear(nn.Module):
        def __init__(self, linear: nn.Linear):
            super().__init__()
            self.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
            self.bias = nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [Shard(0)]))

        def forward(self, x):
            # each rank's gradient differs (its own batch): summed and scattered back (Partial)
            weight, bias = (p.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
                            for p in (self.weight, self.bias))  # fmt: skip
            return F.linear(x, weight, bias)

    def make_model():
        torch.manual_seed(0)
        model = Blocks().to(device)
        for block in model.blocks:
            block.fc1, block.fc2 = ShardedLinear(block.fc1), ShardedLinear(block.fc2)
        return model

    return eager_and_ember(make_model, batches(device, seed=rank, shape=(4, 16)))


def traced_fsdp2_scenario(rank: int, world_size: int, device: torch.device) -> dict:
    """FSDP2 with its hooks traced (torch versions that still have `skip_fsdp_hooks`)."""
    torch._dynamo.config.skip_fsdp_hooks = False
    return fsdp_scenario(rank, world_size, device, per_block=True)


# ---- the tests --------------------------------------------------------------------------------


def check_ranks(results: list[dict], collectives: bool = False) -> None:
    """Every rank's losses and gradients match eager's; ember compiled everything itself."""
    for rank, result in enumerate(results):
        m = result["metrics"]
        assert m["kernels"] > 0 and m["fallbacks"] == 0, f"rank {rank}: {m}"
        if collectives:
            assert m["collectives"] > 0, f"rank {rank}: no collective in ember's graphs: {m}"
        eager, ember = result["eager"], result["ember"]
        torch.testing.assert_close(ember["losses"], eager["losses"], rtol=RTOL, atol=ATOL, msg=f"rank {rank} losses")
        for step, (got, expected) in enumerate(zip(ember["grads"], eager["grads"])):
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL, msg=f"rank {rank} step {step} gradients")


def loss_table(results: list[dict]) -> str:
    """Each rank's loss per step, eager and ember (shown with `pytest -s`, and on a failure)."""
    lines = ["rank step        eager        ember    |diff|"]
    for rank, result in enumerate(results):
        for step, (e, g) in enumerate(zip(result["eager"]["losses"], result["ember"]["losses"])):
            lines.append(f"{rank:4d} {step:4d} {e:12.8f} {g:12.8f} {abs(e - g):9.2e}")
    return "\n".join(lines)


def run_and_check(scenario, tmp_path, collectives: bool = False) -> list[dict]:
    cache = tmp_path / "cache"
    results = run_ranks(scenario, tmp_path, cache)
    print(loss_table(results))
    check_ranks(results, collectives)
    assert_cache_intact(cache)
    return results


def test_ddp_graph_splitting(tmp_path):
    results = run_and_check(ddp_scenario, tmp_path)
    # DDPOptimizer split the forward at the buckets: several forward and backward graphs
    assert all(r["metrics"]["graphs"] >= 4 for r in results), [r["metrics"] for r in results]


@pytest.mark.parametrize("per_block", [True, False], ids=["per_block", "whole_model"])
def test_fsdp2(tmp_path, per_block):
    run_and_check(functools.partial(fsdp_scenario, per_block=per_block), tmp_path)


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_tensor_parallel(tmp_path, kind):
    run_and_check(functools.partial(tensor_parallel_scenario, kind=kind), tmp_path, collectives=True)


def test_fsdp_collectives_in_the_graph(tmp_path):
    run_and_check(simple_fsdp_scenario, tmp_path, collectives=True)


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "skip_fsdp_hooks"),
                    reason="this torch has no traceable FSDP2: torch._dynamo.config.skip_fsdp_hooks was removed "
                    "with it (pytorch/pytorch#174863, #179817); test_fsdp_collectives_in_the_graph puts FSDP's "
                    "collectives in the graph through DTensor instead")  # fmt: skip
def test_fsdp2_hooks_traced(tmp_path):
    results = run_and_check(traced_fsdp2_scenario, tmp_path)
    if not any(r["metrics"]["collectives"] for r in results):
        # torch kept the flag a while after FSDP2 wrapped its hooks in torch._dynamo.disable for good
        pytest.skip("trained correctly, but this torch does not trace FSDP2's hooks: no collective in the graphs")


def test_functional_collectives(tmp_path):
    cache = tmp_path / "cache"
    results = run_ranks(functional_collectives_scenario, tmp_path, cache)
    for rank, result in enumerate(results):
        m = result["metrics"]
        assert m["kernels"] > 0 and m["fallbacks"] == 0 and m["collectives"] == 3, f"rank {rank}: {m}"
        assert m["overlapped"] > 0, f"rank {rank}: no kernel ran while a collective was in flight: {m}"
        torch.testing.assert_close(result["ember"], result["eager"], rtol=RTOL, atol=ATOL, msg=f"rank {rank}")
    assert_cache_intact(cache)


def test_gloo_runs_collectives_one_at_a_time(tmp_path):
    """Note: gloo runs collectives one at a time (ember/lower/collectives.py): with no bound set
    (EMBER_COLLECTIVES_IN_FLIGHT=0), the four all-gathers would all be in flight at once; to a gloo
    group (two worker threads) ember issues them one at a time, and says so once; to NCCL all four."""
    cache = tmp_path / "cache"
    results = run_ranks(gathers_in_flight_scenario, tmp_path, cache, env={"EMBER_COLLECTIVES_IN_FLIGHT": "0"})
    on_gloo = distributed_device() == "cpu"
    for rank, result in enumerate(results):
        assert result["collectives"] == 4, f"rank {rank}: {result}"
        assert result["most_in_flight"] == (1 if on_gloo else 4), f"rank {rank}: {result}"
        assert result["overlapped"] > 0, f"rank {rank}: no kernel ran beside a collective: {result}"
        assert len(result["messages"]) == (1 if on_gloo else 0), f"rank {rank}: {result['messages']}"
        if on_gloo:
            assert "process group '0'" in result["messages"][0] and "gloo" in result["messages"][0]
        torch.testing.assert_close(result["ember"], result["eager"], rtol=RTOL, atol=ATOL, msg=f"rank {rank}")
    assert_cache_intact(cache)
