"""Compile work grows linearly with the graph: the scheduler's work counters
(`ember.schedule.order.ScheduleWork`) on a chain of N and 2N transformer-like layers,
forward and backward, at most STEEPEST times more at 2N. Counts, never timings: a stage
that turns quadratic again (a whole-schedule simulation per candidate pair, an edge map
rebuilt per pair, a re-sort after every merge) doubles its growth and fails here."""

import pytest
import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_function, make_boxed_func

import ember
from ember import compile_cpp
from ember.lower import lower_graph
from ember.lower.decompositions import decomposition_table
from ember.schedule import schedule

WIDTH, TOKENS = 16, 8
STEEPEST = 2.5  # linear growth doubles; a quadratic stage quadruples


def layer(x, w1, w2, attention):
    h = F.layer_norm(x, (WIDTH,))
    scores = (h @ h.T / WIDTH**0.5).softmax(-1)  # a softmax row, read back by the matmul's epilogue
    h = h + attention * (scores @ h)
    return x + F.gelu(h @ w1) @ w2


def chain(layers):
    def loss(x, *weights):
        for i in range(layers):
            x = layer(x, weights[3 * i], weights[3 * i + 1], weights[3 * i + 2])
        return x.square().mean()

    torch.manual_seed(0)
    weights = []
    for _ in range(layers):
        weights += [torch.randn(WIDTH, 2 * WIDTH) / 4, torch.randn(2 * WIDTH, WIDTH) / 4, torch.rand(WIDTH)]
    return loss, [torch.randn(TOKENS, WIDTH, requires_grad=True)] + [w.requires_grad_() for w in weights]


def masked_chain(layers):
    """Inference through layers that each read one shared buffer (a mask, and the random seed
    through dropout): every layer's kernel shares a buffer with every other's, and depends on
    the earlier ones through their matmuls."""

    def forward(x, mask, *weights):
        for w in weights:
            x = F.dropout(torch.tanh(x @ w) * mask, 0.1, training=True)
        return x

    torch.manual_seed(0)
    weights = [torch.randn(WIDTH, WIDTH) / 4 for _ in range(layers)]
    return forward, [torch.randn(TOKENS, WIDTH), torch.rand(TOKENS, WIDTH)] + weights


def scheduler_work(layers: int, model=chain) -> dict[str, int]:
    """The scheduler's work on the forward and backward graphs of `layers` layers, summed."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return make_boxed_func(gm.forward)

    loss, inputs = model(layers)
    compiled = aot_function(loss, fw_compiler=capture, bw_compiler=capture, decompositions=decomposition_table())
    out = compiled(*inputs)
    if out.requires_grad:
        out.backward()
    work: dict[str, int] = {}
    for gm, example_inputs in graphs:
        lowered, _ = lower_graph(gm, example_inputs)
        for name, count in vars(schedule(lowered).work).items():
            work[name] = work.get(name, 0) + count
    return work


@pytest.fixture(scope="module")
def work_at_two_sizes():
    return scheduler_work(6), scheduler_work(12)


@pytest.mark.parametrize("counter", ["candidate_pairs", "pairs_examined", "edges_visited", "simulation_steps"])
def test_scheduler_work_grows_linearly_with_depth(work_at_two_sizes, counter):
    small, large = work_at_two_sizes
    assert small[counter] > 0
    assert large[counter] <= STEEPEST * small[counter], (counter, small[counter], large[counter])


def test_a_buffer_every_layer_reads_pairs_each_layer_with_few_others():
    """A pair of layers joined by a path through a matmul would close a cycle: only the nearest
    is examined, not every later layer (which made the pairs examined grow with the square of
    the depth). Listing them stays a few bit tests each, at most MAX_PAIRS_PER_USER a group."""
    small, large = scheduler_work(8, masked_chain), scheduler_work(16, masked_chain)
    assert 0 < large["pairs_examined"] <= STEEPEST * small["pairs_examined"], (small, large)


def ember_compile_work(layers: int) -> dict[str, int]:
    """ember's counters for the forward and backward compile of `layers` layers (one gcc worker,
    so each graph's batches are exactly its full ones and one rest)."""
    loss, inputs = chain(layers)
    torch._dynamo.reset()
    ember.metrics.reset()
    ember.compile(loss, dynamic=False, compile_threads=1)(*inputs).backward()
    m = ember.metrics
    return {"graphs": m.graphs_compiled, "kernels": m.kernels_generated, "codegen": m.kernels_codegen,
            "gcc_runs": m.gcc_runs, "misses": m.code_cache_misses}  # fmt: skip


def test_identical_layers_are_generated_and_compiled_once(tmp_path, monkeypatch):
    """Note: kernels generated once (compile_cpp.py) and Note: kernels compiled together
    (runtime/cpu.py): twice the layers give twice the kernels, but no new distinct kernel to
    generate, and gcc runs once per batch of distinct kernels, not once per kernel."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "a"))
    small = ember_compile_work(2)
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "b"))
    large = ember_compile_work(4)
    assert large["kernels"] >= small["kernels"] + 8, (small, large)
    # one distinct kernel a layer: its layer norm reads the residual sum of every layer before
    # it, which lowering inlines rather than realizes (a growing body; see the report of #17)
    assert large["codegen"] - small["codegen"] <= (large["kernels"] - small["kernels"]) // 4, (small, large)
    assert small["codegen"] < small["kernels"], small
    for work in (small, large):
        batches = -(-work["codegen"] // compile_cpp.BATCH_KERNELS) + work["graphs"]  # a rest per graph at most
        assert 0 < work["gcc_runs"] <= batches, work  # one more: a batch that failed and was split
        assert work["misses"] == work["kernels"]
