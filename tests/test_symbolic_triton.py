"""Graphs with dynamic shapes on the Triton path, compiled once (Note: symbolic blocks,
ember/codegen/blocks.py): kernels take sizes as int64 arguments, mask every lane by them and
launch a grid computed at each call.

Without a GPU these run Triton's interpreter on CPU tensors (EMBER_BACKEND=triton, TRITON_INTERPRET=1
set by conftest.py before triton is imported); with EMBER_TEST_DEVICE=cuda they run on the GPU, where
`triton_compiles_in_process` also shows that no shape after the first compiles a kernel (ember
compiles each kernel for its argument types and pointer alignment only, never for the values of
its size arguments: Note: ember owns the Triton compile, runtime/triton_compile.py).
"""

import os

import pytest
import torch

import ember
from tests.helpers import test_device
from tests.test_symbolic_shapes import _tensors, _upcast, assert_compiled_once, gpt2, llama

DEVICE = test_device()

pytestmark = [
    pytest.mark.skipif(
        DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
        reason="Triton on CPU tensors: the interpreter needs TRITON_INTERPRET=1 at start-up",
    ),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setenv("EMBER_BACKEND", "triton")


def run_shapes(model, make_inputs, shapes, atol=1e-4):
    """`model` compiled with dynamic=True on the test device, run at every shape against float64
    eager on the CPU; asserts that shapes after the first generate and compile no kernel."""
    reference = _upcast(model)  # (before the model moves to the device)
    compiled = torch.compile(_on_device(model), backend="ember", dynamic=True)
    after_first = None
    with torch.no_grad():
        for shape in shapes:
            inputs = make_inputs(*shape)
            got = compiled(*[x.to(DEVICE) for x in inputs])
            want = reference(*[x.double() if x.is_floating_point() else x for x in inputs])
            for g, w in zip(_tensors(got), _tensors(want)):
                torch.testing.assert_close(g.cpu(), w.to(g.dtype), rtol=1e-4, atol=atol)
            after_first = after_first or _kernel_work()
    assert _kernel_work() == after_first, "a shape after the first generated or compiled kernels"


def _on_device(model):
    return model.to(DEVICE) if isinstance(model, torch.nn.Module) else model


def _kernel_work() -> tuple[int, int, int]:
    m = ember.metrics
    return m.kernels_codegen, m.code_cache_misses + m.code_cache_hits, m.triton_compiles_in_process


def test_pointwise_and_reductions_over_many_shapes():
    """Rows shorter and longer than a block (looped over many RBLOCK chunks), a softmax, var_mean
    over dim 0, a layer norm, a scan, sums over every dim, views that divide by sizes."""

    def f(x, y):
        z = torch.softmax(x * 2 + y, dim=-1)
        mean, var = torch.var_mean(z, dim=0)
        n, m = x.shape
        tripled = x.view(n, m, 1).expand(n, m, 3).reshape(n, m * 3)
        ln = torch.nn.functional.layer_norm(x, x.shape[-1:])
        return z.sum(1), mean * var, ln.amax(0), tripled.cumsum(1), (x.exp() - y).sum(), x.t().reshape(-1) * 2

    shapes = [(3, 33), (5, 8), (17, 4), (9, 130), (2, 300), (40, 7), (6, 64), (11, 65)]
    run_shapes(f, lambda n, m: [torch.randn(n, m), torch.randn(n, m)], shapes)
    assert_compiled_once()


def test_nested_reduction_with_a_symbolic_extent():
    """cross-entropy: the mean over rows of each row's logsumexp (Note: nested reductions), its
    chunked loop over a symbolic number of rows."""

    def f(logits, target):
        return torch.nn.functional.cross_entropy(logits, target), logits.logsumexp(-1)

    shapes = [(5, 11), (33, 7), (3, 70), (64, 3)]
    run_shapes(f, lambda n, c: [torch.randn(n, c), torch.randint(0, c, (n,))], shapes)
    assert_compiled_once()


def test_views_of_symbolic_sizes():
    def f(x):
        b, s, h = x.shape
        heads = x.view(b, s, 4, h // 4).permute(0, 2, 1, 3)
        return (heads * 2).reshape(b * 4, s, h // 4).transpose(1, 2).contiguous() + x.sum(-1).view(b, 1, s).repeat(
            4, 1, 1
        )

    run_shapes(f, lambda b, s: [torch.randn(b, s, 16)], [(2, 3), (3, 7), (4, 5), (2, 19)])
    assert_compiled_once()


def test_gpt2_compiles_once_for_every_batch_and_length():
    run_shapes(gpt2(), lambda b, s: [torch.randint(0, 500, (b, s))], [(2, 17), (3, 9), (2, 40), (4, 5)])
    assert_compiled_once()


def test_llama_compiles_once():
    run_shapes(llama(), lambda b, s: [torch.randint(0, 300, (b, s))], [(2, 11), (3, 29), (2, 50)])
    assert_compiled_once()


def test_a_generate_loop_with_a_kv_cache_compiles_twice():
    """Prefill and decode, the cache growing by one at each step: two graphs, neither per shape."""
    from transformers.cache_utils import DynamicCache

    model = gpt2()
    reference = _upcast(model)
    compiled = torch.compile(_on_device(model), backend="ember", dynamic=True)
    ids = want_ids = torch.randint(0, 500, (1, 7))
    cache, want_cache = DynamicCache(), DynamicCache()
    with torch.no_grad():
        for _ in range(5):
            out, want = compiled(ids.to(DEVICE), cache=cache), reference(want_ids, cache=want_cache)
            torch.testing.assert_close(out.logits.cpu(), want.logits.float(), rtol=1e-4, atol=1e-4)
            ids = want_ids = want.logits[:, -1:].argmax(-1)
            cache, want_cache = out.past_key_values, want.past_key_values
    assert ember.metrics.graphs_failed == 0 and ember.metrics.shape_specializations == 0
    assert ember.metrics.graphs_compiled == 2 and ember.metrics.symbolic_graphs >= 1


def test_training_forward_and_backward_compile_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
    )
    reference = _upcast(model)
    compiled = torch.compile(_on_device(model), backend="ember", dynamic=True)
    for batch in (5, 9, 30):
        x = torch.randn(batch, 32)
        compiled(x.to(DEVICE)).square().mean().backward()
        reference(x.double()).square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad.float(), rtol=1e-4, atol=1e-5)
            p.grad, q.grad = None, None
    assert_compiled_once(graphs=2)  # the forward and the backward


def test_a_kernel_gets_a_configuration_per_size_class():
    """Note: size classes (ember/runtime/triton_sized.py). One softmax kernel over a symbolic row,
    called at very different sizes: each size class (powers of two of the rows and of the row
    length) gets its own configuration, persistent where the row fits a block and looped where
    it does not; a call in a class met before chooses nothing."""
    # (on the GPU a tiny class takes the kernel's default, looped: short rows there come many)
    short, same_class, long = ((4, 16), (3, 13), (4, 300)) if DEVICE == "cpu" else ((8192, 16), (5000, 13), (4, 20000))

    def f(x):
        return torch.softmax(x, -1)

    run_shapes(f, lambda n, m: [torch.randn(n, m)], [short, same_class, long])
    assert ember.metrics.triton_size_classes == 2
    assert ember.metrics.triton_size_class_variants == {"persistent": 1, "looped": 1}
    assert ember.metrics.shape_specializations == 0


def test_calls_past_the_size_cap_take_the_kernels_with_64_bit_indexes(monkeypatch, tmp_path):
    """Kernels index in int32 while every size is at most their cap, in int64 past it (Note:
    symbolic blocks): with the cap made 8, small shapes take the narrow kernels, larger ones
    the wide, and both compute every value."""
    from ember.codegen import blocks

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))  # (a cached wrapper would keep the real cap)
    monkeypatch.setattr(blocks, "narrow_size_cap", lambda sink, shape, limits: 8)

    def f(x, y):
        return torch.softmax(x * y, -1).sum(0), (x + 1).cumsum(1)

    def run(shapes):
        before = ember.metrics.triton_wide_index_launches
        run_shapes(f, lambda n, m: [torch.randn(n, m), torch.randn(n, m)], shapes)
        return ember.metrics.triton_wide_index_launches - before

    # at the cap and just past it too (on the GPU the first wide call compiles)
    narrow, wide = run([(3, 5), (8, 7), (8, 8)]), run([(3, 40), (20, 6), (9, 8), (8, 9)])
    if DEVICE == "cpu":  # (the interpreter counts its launches)
        assert narrow == 0 and wide > 0
    assert ember.metrics.symbolic_graphs >= 1 and ember.metrics.shape_specializations == 0
