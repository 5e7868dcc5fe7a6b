"""Random ops in ember's kernels (Note: counter-based random numbers, ember/lower/random.py).

Ember's random numbers are not eager's, so values are checked by what must hold: the same
seed gives the same values (across calls, processes and thread counts), Triton's Philox
gives the same bits, the statistics are right, dropout's mask is consistent between forward
and backward, and with EMBER_FALLBACK_RANDOM=1 everything equals eager bit for bit.
"""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import ember
from ember import config as config_module
from ember.renderer.cpp import PHILOX
from ember.runtime.cpu import compile_cpp, load_library
from ember.wrapper.runtime import random_seed
from tests.helpers import compile_fn, test_device

# Note: every compiled graph here runs on `test_device()` (EMBER_TEST_DEVICE=cuda: Triton on the
# GPU); tests/test_triton.py runs a subset through the Triton renderer under the interpreter.

REPO_ROOT = Path(__file__).resolve().parent.parent


def seed_of_next_call(manual_seed: int) -> int:
    """The seed a compiled graph's next call draws after torch.manual_seed(manual_seed)."""
    torch.manual_seed(manual_seed)
    return int(random_seed().item())


# ---- same bits as Triton ------------------------------------------------------------------

TRITON_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, triton, triton.language as tl

    @triton.jit
    def philox_kernel(seed, offsets, w0, w1, w2, w3, uniform, normal, N: tl.constexpr):
        i = tl.arange(0, N)
        offset = tl.load(offsets + i)
        a, b, c, d = tl.randint4x(seed, offset)
        tl.store(w0 + i, a)
        tl.store(w1 + i, b)
        tl.store(w2 + i, c)
        tl.store(w3 + i, d)
        tl.store(uniform + i, tl.rand(seed, offset))
        tl.store(normal + i, tl.randn(seed, offset))

    seeds, offsets = torch.load(sys.argv[1])
    results = []
    for seed in seeds:
        n = offsets.numel()
        outs = [torch.empty(n, dtype=torch.int32) for _ in range(4)] + [torch.empty(n), torch.empty(n)]
        philox_kernel[(1,)](seed, offsets, *outs, N=n)
        results.append(outs)
    torch.save(results, sys.argv[2])
""")


def triton_philox(seeds: list[int], offsets: torch.Tensor, tmp_path: Path) -> list[list[torch.Tensor]]:
    """Per seed: tl.randint4x's four words, tl.rand and tl.randn at `offsets`, from Triton's
    own implementation run by its interpreter."""
    pytest.importorskip("triton")
    inputs, outputs = tmp_path / "triton_in.pt", tmp_path / "triton_out.pt"
    n = offsets.numel()
    padded = torch.cat([offsets, offsets.new_zeros(triton_block(n) - n)])  # tl.arange wants a power of 2
    torch.save((seeds, padded), inputs)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(inputs), str(outputs)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [[t[:n] for t in per_seed] for per_seed in torch.load(outputs)]


def triton_block(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


PHILOX_WORDS = PHILOX + textwrap.dedent("""
    extern "C" void philox_words(const int64_t* seed, const int64_t* offsets, uint32_t* out, int64_t n) {
      for (int64_t i = 0; i < n; i++) {
        out[4 * i] = ember_philox<0>(seed[0], offsets[i]);
        out[4 * i + 1] = ember_philox<1>(seed[0], offsets[i]);
        out[4 * i + 2] = ember_philox<2>(seed[0], offsets[i]);
        out[4 * i + 3] = ember_philox<3>(seed[0], offsets[i]);
      }
    }
""")


def cpp_philox_words(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """The renderer's C++ Philox, (n, 4) words as int32 (Triton's randint dtype)."""
    config = config_module.load()
    compiled = compile_cpp("#include <cstdint>\n" + PHILOX_WORDS, "philox_words", Path(config.cache_dir), "g++",
                           ember.__version__)  # fmt: skip
    function = load_library(str(compiled.path)).philox_words
    out = torch.empty(offsets.numel(), 4, dtype=torch.int32)
    seed_tensor = torch.tensor([seed], dtype=torch.int64)
    function(*(ctypes.c_void_p(t.data_ptr()) for t in (seed_tensor, offsets, out)), ctypes.c_int64(offsets.numel()))
    return out


SEEDS = [0, 1, 12345, 2**31 + 7, 2**62 + 2**40 + 3, 2**63 - 2]


def test_cpp_philox_words_equal_tritons(tmp_path):
    offsets = torch.tensor([0, 1, 2, 3, 1000, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**40 + 17, 2**62 + 1],
                           dtype=torch.int64)  # fmt: skip
    expected = triton_philox(SEEDS, offsets, tmp_path)
    for seed, triton_outs in zip(SEEDS, expected):
        words = cpp_philox_words(seed, offsets)
        for w in range(4):
            assert torch.equal(words[:, w], triton_outs[w]), f"seed {seed}, word {w}"


def test_rand_equals_tritons_bit_for_bit_and_randn_to_a_few_ulp(tmp_path):
    n = (1 << 16) + 3
    offsets = torch.arange(n, dtype=torch.int64)  # the first random op of a graph: counter = position
    device = test_device()
    rand, randn = compile_fn(lambda: torch.rand(n, device=device)), compile_fn(lambda: torch.randn(n, device=device))
    manual_seeds = [0, 7, 2024]
    expected = triton_philox([seed_of_next_call(s) for s in manual_seeds], offsets, tmp_path)
    for manual_seed, triton_outs in zip(manual_seeds, expected):
        torch.manual_seed(manual_seed)
        assert torch.equal(rand().cpu(), triton_outs[4])
        torch.manual_seed(manual_seed)
        torch.testing.assert_close(randn().cpu(), triton_outs[5], rtol=4e-6, atol=4e-6)
    assert ember.metrics.fallback_calls == 0


def test_a_later_random_op_draws_at_the_counters_after_the_earlier_ones(tmp_path):
    """Each random op's counters follow the counters every earlier op of the graph took (its
    offset, a kernel argument): the second op's elements are tl.rand at n1 + position."""
    n1, n2 = 1000, 4099
    device = test_device()
    f = compile_fn(lambda: (torch.rand(n1, device=device), torch.rand(n2, device=device)))
    offsets = torch.arange(n1 + n2, dtype=torch.int64)
    expected = triton_philox([seed_of_next_call(9)], offsets, tmp_path)[0][4]
    torch.manual_seed(9)
    first, second = (t.cpu() for t in f())
    assert torch.equal(first, expected[:n1]) and torch.equal(second, expected[n1:])


def test_identical_layers_with_dropout_share_their_kernels():
    """Dropouts of identical layers differ only in their offsets, which are kernel arguments:
    twice the layers give twice the kernels but no new one to generate (Note: counter-based
    random numbers)."""

    def layers(n):
        def fn(x, w):
            for _ in range(n):
                x = F.dropout(torch.tanh(x @ w), 0.25, training=True)
            return x

        return fn

    x, w = torch.randn(8, 16, device=test_device()), torch.randn(16, 16, device=test_device())
    work = []
    for n in (2, 4):
        ember.metrics.reset()
        with torch.no_grad():
            compile_fn(layers(n))(x, w)
        work.append((ember.metrics.kernels_generated, ember.metrics.kernels_codegen))
    (small_kernels, small_codegen), (large_kernels, large_codegen) = work
    assert large_kernels >= small_kernels + 2, work
    assert large_codegen == small_codegen, work


# ---- reproducibility -------------------------------------------------------------------------


def random_outputs(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One graph with every kind of random op, over odd sizes so loops split unevenly."""
    device = x.device
    return (
        torch.rand(257, 1001, device=device), torch.randn_like(x), F.dropout(x, 0.3),
        torch.randint(-5, 1000, (3, 77), device=device), torch.bernoulli(torch.full_like(x, 0.25)),
        torch.empty(x.shape, device=device).normal_(2.0, 3.0),
    )  # fmt: skip


def test_manual_seed_reproduces_and_successive_calls_differ():
    f = compile_fn(random_outputs)
    x = torch.randn(513, 129, device=test_device())
    torch.manual_seed(3)
    first, second = f(x), f(x)
    torch.manual_seed(3)
    again = f(x)
    for a, b, c in zip(first, second, again):
        assert torch.equal(a, c)
        assert not torch.equal(a, b)
    assert ember.metrics.fallback_calls == 0


PROCESS_SCRIPT = textwrap.dedent("""
    import sys, torch
    from tests.test_random import random_outputs
    f = torch.compile(random_outputs, backend="ember", dynamic=False)
    torch.manual_seed(11)
    x = torch.randn(513, 129).to(sys.argv[2])
    torch.manual_seed(5)
    torch.save([t.cpu() for t in f(x)], sys.argv[1])
""")


@pytest.mark.parametrize("threads", ["1", "2"])
def test_values_are_the_same_in_other_processes_and_thread_counts(tmp_path, threads):
    torch.manual_seed(11)
    x = torch.randn(513, 129).to(test_device())
    torch.manual_seed(5)
    expected = compile_fn(random_outputs)(x)
    path = tmp_path / "values.pt"
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": f"{REPO_ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, "-c", PROCESS_SCRIPT, str(path), test_device()], env=env, check=True,
                   cwd=REPO_ROOT, capture_output=True, text=True)  # fmt: skip
    for got, want in zip(torch.load(path), expected):
        assert torch.equal(got, want.cpu())


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton kernels need a GPU or Triton's interpreter")  # fmt: skip
def test_cpp_and_triton_kernels_draw_the_same_numbers(monkeypatch):
    """The seed comes from torch's CPU generator for both backends and the Philox words, the
    uniform conversion and the Box-Muller arithmetic are the same IEEE operations: a CPU (C++)
    and a GPU (Triton) graph give the same values bit for bit."""
    x = torch.randn(77, 40)
    monkeypatch.setenv("EMBER_BACKEND", "cpp")
    torch.manual_seed(5)
    cpu = compile_fn(random_outputs)(x)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("EMBER_BACKEND", "triton" if device == "cpu" else "cpp")
    torch.manual_seed(5)
    triton = compile_fn(random_outputs)(x.to(device))
    for a, b in zip(cpu, triton):
        assert torch.equal(a, b.cpu())
    assert ember.metrics.fallback_calls == 0


def test_graphs_without_random_ops_leave_the_generator_alone():
    f = compile_fn(lambda x: x * 2)
    torch.manual_seed(1)
    f(torch.ones(3, device=test_device()))
    after_graph = torch.rand(4)
    torch.manual_seed(1)
    assert torch.equal(after_graph, torch.rand(4))


def test_two_random_ops_in_one_graph_differ():
    device = test_device()
    a, b = compile_fn(lambda: (torch.rand(1000, device=device), torch.rand(1000, device=device)))()
    a, b = a.cpu(), b.cpu()
    assert not torch.equal(a, b)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.15


def test_a_random_value_read_in_several_kernels_is_one_value():
    device = test_device()

    def fn():
        r = torch.rand(64, 48, device=device)  # inlined into each reader: every kernel recomputes it
        return r.sum(1), (r * 2).t(), r[::2] + 1

    sums, doubled, sliced = (t.cpu() for t in compile_fn(fn)())
    r = doubled.t() / 2
    torch.testing.assert_close(sums, r.sum(1))
    assert torch.equal(sliced, r[::2] + 1)
    assert ember.metrics.fallback_calls == 0 and ember.metrics.kernels_generated >= 2


# ---- statistics ------------------------------------------------------------------------------

N = 1 << 20


def test_uniform_statistics():
    u = compile_fn(lambda: torch.rand(N, device=test_device()))().cpu()
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 2e-3 and abs(u.var() - 1 / 12) < 2e-3
    sorted_u, _ = u.sort()  # Kolmogorov-Smirnov distance from the uniform CDF
    assert (sorted_u - torch.arange(N) / N).abs().max() < 3e-3


def test_normal_statistics():
    n = compile_fn(lambda: torch.randn(N, dtype=torch.float64, device=test_device()))().cpu()
    assert n.dtype == torch.float64 and torch.isfinite(n).all()
    assert abs(n.mean()) < 5e-3 and abs(n.var() - 1) < 1e-2
    assert abs((n.abs() > 2).double().mean() - 0.0455) < 2e-3  # tails: P(|n| > 2) = 4.55%
    assert abs(((n - n.mean()) ** 4).mean() / n.var() ** 2 - 3) < 0.05  # kurtosis of a normal


def test_bernoulli_uniform_and_normal_parameters():
    device = test_device()
    p = torch.linspace(0, 1, 8).repeat_interleave(N // 8)
    outputs = compile_fn(lambda p: (
        torch.bernoulli(p), torch.bernoulli(torch.zeros(N, dtype=torch.float64, device=device), 0.3),
        torch.empty(N, device=device).uniform_(-2.0, 5.0), torch.empty(N, device=device).normal_(3.0, 0.5),
        torch.normal(p, 2.0),
    ))(p.to(device))  # fmt: skip
    bern, bern_p, low_high, mean_std, normal = (t.cpu() for t in outputs)
    rates = bern.view(8, -1).mean(1)
    torch.testing.assert_close(rates, torch.linspace(0, 1, 8), atol=5e-3, rtol=0)
    assert bern_p.dtype == torch.float64 and abs(bern_p.mean() - 0.3) < 3e-3
    assert low_high.min() >= -2 and low_high.max() < 5 and abs(low_high.mean() - 1.5) < 2e-2
    assert abs(mean_std.mean() - 3) < 3e-3 and abs(mean_std.std() - 0.5) < 3e-3
    assert abs((normal - p).mean()) < 1e-2 and abs((normal - p).std() - 2) < 1e-2
    assert ember.metrics.fallback_calls == 0


def test_exponential_statistics():
    e = compile_fn(lambda: torch.empty(N, dtype=torch.float64, device=test_device()).exponential_(2.0))().cpu()
    assert e.dtype == torch.float64 and e.min() >= 0 and torch.isfinite(e).all()
    assert abs(e.mean() - 0.5) < 3e-3 and abs(e.std() - 0.5) < 3e-3
    assert abs((e > 1).double().mean() - math.exp(-2)) < 2e-3
    assert ember.metrics.fallback_calls == 0


def test_randint_range_and_uniformity():
    device = test_device()
    outputs = compile_fn(lambda x: (
        torch.randint(-3, 7, (N,), device=device), torch.randint(2**40, (5, 7), dtype=torch.int64, device=device),
        torch.randint_like(x, 10, 20),
    ))(torch.zeros(100, 3, dtype=torch.float64, device=device))  # fmt: skip
    values, small, like = (t.cpu() for t in outputs)
    assert values.dtype == torch.int64 and values.min() == -3 and values.max() == 6
    counts = torch.bincount(values + 3).double()
    assert ((counts - N / 10).abs() < 5 * (N / 10) ** 0.5).all()
    assert small.min() >= 0 and small.max() < 2**40 and small.max() > 2**32  # uses more than 32 bits
    assert like.dtype == torch.float64 and like.shape == (100, 3) and like.min() >= 10 and like.max() <= 19
    assert torch.equal(like, like.floor())


def test_randint_of_the_widest_ranges():
    device = test_device()
    half, full = compile_fn(lambda: (torch.randint(-(2**62), 2**62, (1000,), device=device),
                                     torch.randint(-(2**63), 2**63 - 1, (9,), device=device)))()  # fmt: skip
    half = half.cpu()
    assert half.min() >= -(2**62) and half.max() < 2**62 and half.min() < -(2**61) and half.max() > 2**61
    assert full.shape == (9,)  # a range past 2**63 draws 64 bits: aten does it
    assert ember.metrics.fallback_ops == {"aten.randint.low": 1}


def test_dropout_scales_kept_values_and_zeroes_the_rest():
    x = torch.randn(N) + 10  # never zero, so a zero output is a dropped element
    p = 0.3
    out, mask = (t.cpu() for t in compile_fn(lambda x: torch.ops.aten.native_dropout(x, p, True))(x.to(test_device())))
    assert mask.dtype == torch.bool
    assert torch.equal(out == 0, ~mask)
    torch.testing.assert_close(out[mask], x[mask] * (1 / (1 - p)), rtol=1e-6, atol=0)
    assert abs((~mask).double().mean() - p) < 3e-3


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_dropout_edge_probabilities(p):
    x = torch.randn(100)
    out = compile_fn(lambda x: F.dropout(x, p))(x.to(test_device())).cpu()
    assert torch.equal(out, x if p == 0 else torch.zeros_like(x))


def test_dropout_in_eval_mode_is_identity():
    model = torch.nn.Sequential(torch.nn.Dropout(0.5)).eval()
    x = torch.randn(10, 10, device=test_device())
    assert torch.equal(compile_fn(model)(x), x)


# ---- autograd and fusion -------------------------------------------------------------------


def test_dropout_backward_uses_the_forward_mask():
    x = (torch.randn(300, 70, device=test_device()) + 10).requires_grad_()
    out = compile_fn(lambda x: F.dropout(x, 0.4) * 3)(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    dropped = out == 0
    assert dropped.any() and (~dropped).any()
    assert torch.equal(x.grad == 0, dropped)
    torch.testing.assert_close(x.grad[~dropped], grad[~dropped] * 3 / 0.6, rtol=1e-6, atol=0)
    assert ember.metrics.fallback_calls == 0


def test_dropout_fuses_with_its_neighbours():
    out = compile_fn(lambda x: torch.relu(F.dropout(x * 2 + 1, 0.5)) - 1)(torch.randn(64, 33, device=test_device()))
    assert out.shape == (64, 33)
    assert ember.metrics.kernels_generated == 1 and ember.metrics.fallback_calls == 0


def test_training_step_with_dropout_has_no_fallbacks():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model, x = model.to(test_device()), torch.randn(8, 16, device=test_device())
    compile_fn(model)(x).sum().backward()
    assert ember.metrics.fallback_calls == 0 and ember.metrics.graphs_compiled == 2
    # forward: dropout, its mask and relu in one kernel between the two addmm externs
    assert all(p.grad is not None for p in model.parameters())


# ---- shapes and dtypes ---------------------------------------------------------------------


def test_shapes_strides_and_dtypes_follow_eager():
    device = test_device()
    channels_last = torch.randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)

    def fn(x):
        return (torch.rand((), device=device), torch.rand(0, 3, device=device), torch.rand_like(x),
                torch.randn(3, 4, dtype=torch.float64, device=device), torch.randn_like(x[:, :, ::2]),
                torch.randint(5, (2, 2), dtype=torch.int32, device=device))  # fmt: skip

    got, want = compile_fn(fn)(channels_last), fn(channels_last)
    for g, w in zip(got, want):
        assert (g.shape, g.dtype, g.stride()) == (w.shape, w.dtype, w.stride())
    assert 0 <= got[0] < 1 and got[2].min() >= 0 and got[5].min() >= 0 and got[5].max() < 5
    assert ember.metrics.fallback_calls == 0


VARIANTS = {
    "dropout2d": lambda x: F.dropout2d(x, 0.3),
    "dropout3d": lambda x: F.dropout3d(x, 0.3),
    "feature_alpha_dropout": lambda x: F.feature_alpha_dropout(x, 0.3, True),
    "normal_tensor_tensor": lambda x: torch.normal(x, x[0].abs() + 0.1),
    "normal_float_tensor": lambda x: torch.normal(1.0, x.abs()),
    "normal_sized": lambda x: torch.normal(1.0, 2.0, (3, 4), device=x.device),
    "bernoulli_tensor_p": lambda x: torch.empty(x.shape, device=x.device).bernoulli_(x[:, :1].sigmoid()),
    "permuted_like": lambda x: torch.rand_like(x.permute(3, 1, 0, 2)) + x.permute(3, 1, 0, 2),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_random_op_variants_lower_without_fallbacks(name):
    fn = VARIANTS[name]
    x = torch.randn(4, 6, 5, 3, device=test_device())
    got, want = compile_fn(fn)(x), fn(x)
    assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
    assert torch.isfinite(got).all()
    assert ember.metrics.fallback_calls == 0 and ember.metrics.kernels_generated == 1


# ---- EMBER_FALLBACK_RANDOM -------------------------------------------------------------------


def eager_random_ops(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    device = x.device
    return (
        torch.rand(5, 7, device=device), torch.randn_like(x), F.dropout(x, 0.3),
        torch.randint(0, 100, (9,), device=device), torch.bernoulli(x.sigmoid()), x.bernoulli(0.2),
        torch.empty_like(x).uniform_(1, 2), torch.empty_like(x).normal_(0, 2), torch.normal(x, 0.5),
        torch.randperm(10, device=device),
    )  # fmt: skip


def test_fallback_random_matches_eager_bit_for_bit(monkeypatch):
    monkeypatch.setenv("EMBER_FALLBACK_RANDOM", "1")
    x = torch.randn(6, 9, device=test_device())
    compiled = compile_fn(eager_random_ops)
    torch.manual_seed(17)
    got = compiled(x)
    torch.manual_seed(17)
    want = eager_random_ops(x)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert ember.metrics.fallback_calls > 0


def test_dropout_training_matches_eager_with_fallback_random(monkeypatch):
    monkeypatch.setenv("EMBER_FALLBACK_RANDOM", "1")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.ReLU())
    model, x = model.to(test_device()), torch.randn(4, 8, device=test_device())
    torch.manual_seed(2)
    compiled_out = compile_fn(model)(x)
    compiled_out.sum().backward()
    compiled_grad = model[0].weight.grad.clone()
    model.zero_grad()
    torch.manual_seed(2)
    eager_out = model(x)
    eager_out.sum().backward()
    assert torch.equal(compiled_out, eager_out)
    torch.testing.assert_close(compiled_grad, model[0].weight.grad)


def test_fallback_random_is_part_of_the_cache_key(monkeypatch):
    assert config_module.load(fallback_random=True).cache_key() != config_module.load().cache_key()
    monkeypatch.setenv("EMBER_FALLBACK_RANDOM", "1")
    assert config_module.load().fallback_random
