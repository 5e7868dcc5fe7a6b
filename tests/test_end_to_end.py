"""The foundation's acceptance checks: one kernel for a fused pointwise+view program,
fallback externs, the code cache across processes, strict mode and eager fallback."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import ember
from tests.helpers import check, compile_fn, to_test_device


def test_pointwise_view_program_is_one_kernel():
    f = lambda x, y: ((x.sin() * y.exp() + 1).relu() / (1 + x.abs())).t()[::2]
    x, y = torch.randn(1024, 1024), torch.randn(1024, 1024)
    check(f, x, y)
    assert ember.metrics.kernels_generated == 1
    assert ember.metrics.fallback_calls == 0


def test_op_without_lowering_runs_through_fallback():
    def f(x):
        values, indices = torch.sort(x, dim=-1)
        return values * 2, indices

    check(f, torch.randn(6, 9))
    assert ember.metrics.fallback_ops["aten.sort.default"] == 1
    assert ember.metrics.kernels_generated == 1


def test_view_of_input_comes_back_as_view():
    x = torch.randn(4, 5)
    out = compile_fn(lambda x: x.t())(x)
    assert out.data_ptr() == x.data_ptr() and out.stride() == (1, 5)


def test_clone_of_input_is_a_new_tensor():
    x = torch.randn(4, 5)
    out = compile_fn(lambda x: x.clone())(x)
    assert out.data_ptr() != x.data_ptr()
    assert torch.equal(out, x)


def test_output_layout_follows_eager_when_dense():
    x = torch.randn(8, 6).t()
    out = compile_fn(lambda x: x * 2)(x)
    assert out.stride() == (x * 2).stride()


def grads_match_float64_eager(fn, *inputs, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """One backward of `fn(*inputs).sum()` compiled by ember; the float inputs' gradients are
    compared with eager's on float64 copies, allowing each element also four times eager float32's own
    distance from float64 there (an extern float32 matmul on the GPU rounds as eager's does)."""

    def run(f, dtype):
        xs = [x.detach().to(dtype).requires_grad_() if x.is_floating_point() else x for x in inputs]
        out = f(*xs)
        out.backward(torch.ones_like(out))
        return out, [x.grad for x in xs if x.is_floating_point()]

    out, grads = run(compile_fn(fn), torch.float32)
    want_out, want_grads = run(fn, torch.float64)
    eager_out, eager_grads = run(fn, torch.float32)
    for got, want, eager in zip([out, *grads], [want_out, *want_grads], [eager_out, *eager_grads]):
        got, want, eager = got.detach().double().cpu(), want.detach().cpu(), eager.detach().double().cpu()
        allowed = atol + rtol * want.abs() + 4 * (eager - want).abs()
        excess = (got - want).abs() - allowed
        assert not (excess > 0).any(), f"{int((excess > 0).sum())} elements off; worst by {excess.max():.3g}"
    assert ember.metrics.graphs_failed == 0


def heads_after_empty_cache(x, w):
    """A matmul's result split into heads (a permuted view) and appended to an empty cache, as
    Hugging Face attention does: cat then is that view, but eager's cat is contiguous."""
    b, s, d = x.shape
    heads = (x @ w).view(b, s, 4, d // 4).transpose(1, 2)
    return torch.cat([x.new_zeros(b, 4, 0, d // 4), heads], dim=-2)


@pytest.mark.parametrize("shape", [(2, 8, 16), (3, 5, 32), (1, 16, 8)])
def test_output_view_of_intermediate_has_eager_strides(shape):
    x, w = torch.randn(shape), torch.randn(shape[-1], shape[-1])
    out = check(heads_after_empty_cache, x, w)
    assert out.stride() == heads_after_empty_cache(x, w).stride()


@pytest.mark.parametrize("shape", [(2, 8, 16), (3, 5, 32)])
def test_tensor_saved_for_backward_has_eager_strides(shape):
    # the cat is saved for the backward of the square, which was traced with eager's strides
    grads_match_float64_eager(lambda x, w: heads_after_empty_cache(x, w).square(), torch.randn(shape),
                              torch.randn(shape[-1], shape[-1]))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("shape, expanded", [((1, 8), (4, 8)), ((3, 1), (3, 5)), ((1, 6, 1), (2, 6, 3))])
def test_broadcast_output_comes_back_broadcast(shape, expanded, dtype):
    def f(x):
        return (x * 3 + 1).expand(expanded)

    x = torch.randint(-5, 5, shape).to(dtype)
    check(f, x)
    out = compile_fn(f)(to_test_device(x))  # (check's copy to the CPU would make it dense)
    assert out.stride() == f(x).stride()
    assert ember.metrics.graphs_failed == 0


@pytest.mark.parametrize("batch, seq", [(2, 16), (3, 7)])
def test_broadcast_indices_saved_for_backward(batch, seq):
    # BERT-style position ids: a row computed from a buffer, expanded over the batch, saved (with
    # eager's stride 0) for the embedding's backward
    def f(table, positions, order):
        ids = torch.gather(positions, 1, order).expand(batch, seq)
        return torch.nn.functional.embedding(ids, table) * 2

    positions, order = torch.arange(seq).view(1, seq), torch.randperm(seq).view(1, seq)
    grads_match_float64_eager(f, torch.randn(seq, 8), positions, order)


SCRIPT = (
    "import torch, ember\n"
    "f = torch.compile(lambda x: (x * 3).cos() + 1, backend='ember')\n"
    "assert torch.allclose(f(torch.ones(64, 64)), torch.full((64, 64), 3.0).cos() + 1)\n"
    "m = ember.metrics\n"
    "print('METRICS', m.graph_cache_hits, m.code_cache_hits, m.code_cache_misses, m.kernels_generated)\n"
)


def run_script(env: dict) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return next(line for line in done.stdout.splitlines() if line.startswith("METRICS")).split()[1:]


def test_second_process_hits_code_cache(tmp_path):
    env = {**os.environ, "EMBER_CACHE_DIR": str(tmp_path / "cache"), "EMBER_GRAPH_CACHE": "0"}
    assert run_script(env) == ["0", "0", "1", "1"]
    assert run_script(env) == ["0", "1", "0", "1"]


def test_second_process_loads_the_whole_graph_from_cache(tmp_path):
    env = {**os.environ, "EMBER_CACHE_DIR": str(tmp_path / "cache")}
    assert run_script(env) == ["0", "0", "1", "1"]
    assert run_script(env) == ["1", "0", "0", "1"]  # no lowering, no codegen, no gcc


def test_corrupt_cache_entries_are_rebuilt(tmp_path):
    env = {**os.environ, "EMBER_CACHE_DIR": str(tmp_path / "cache")}
    run_script(env)
    for entry in (tmp_path / "cache").rglob("*"):
        if entry.suffix in (".so", ".json"):
            entry.write_bytes(b"garbage")
    assert run_script(env) == ["0", "0", "1", "1"]
    assert run_script(env) == ["1", "0", "0", "1"]


def test_strict_mode_raises_with_stage(monkeypatch):
    monkeypatch.setenv("EMBER_CXX", "/nonexistent/compiler")
    with pytest.raises(Exception, match="stage 'runtime'"):
        compile_fn(lambda x: x + 1)(torch.ones(3))


def test_failure_falls_back_to_eager_with_one_warning(monkeypatch):
    monkeypatch.setenv("EMBER_CXX", "/nonexistent/compiler")
    monkeypatch.setenv("EMBER_STRICT", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compile_fn(lambda x: x + 1)(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
    ours = [w for w in caught if "ember" in str(w.message)]
    assert len(ours) == 1 and "stage 'runtime'" in str(ours[0].message)
    assert ours[0].filename == __file__  # the user's line, not a file inside torch
    assert ember.metrics.graphs_failed == 1


def test_a_graph_aot_autograd_cannot_trace_runs_eagerly(monkeypatch):
    def failing_aot_autograd(**compilers):
        def trace(gm, example_inputs):
            raise RuntimeError("functionalization failed")

        return trace

    monkeypatch.setattr(ember.frontend, "aot_autograd", failing_aot_autograd)
    monkeypatch.setenv("EMBER_STRICT", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compile_fn(lambda x: x * 3)(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 3.0))
    messages = [str(w.message) for w in caught if "ember" in str(w.message)]
    assert len(messages) == 1 and "stage 'frontend'" in messages[0] and "functionalization failed" in messages[0]
    assert ember.metrics.graphs_failed == 1
    monkeypatch.setenv("EMBER_STRICT", "1")
    with pytest.raises(Exception, match="functionalization failed"):
        compile_fn(lambda x: x * 4)(torch.ones(2))


def test_debug_dump(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EMBER_DEBUG", "1")
    monkeypatch.setenv("EMBER_DEBUG_DIR", str(tmp_path / "dbg"))
    compile_fn(lambda x: x.exp() + 1)(torch.ones(5))
    (graph_dir,) = list((tmp_path / "dbg").iterdir())
    for name in ("fx_graph.txt", "ir.txt", "wrapper.py", "timings.txt"):
        assert (graph_dir / name).read_text()
    assert len(list((graph_dir / "kernels").glob("*.cpp"))) == 1
    assert str(graph_dir.resolve()) in capsys.readouterr().err


def test_debug_dumps_are_numbered_and_named_by_role(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_DEBUG", "1")
    monkeypatch.setenv("EMBER_DEBUG_DIR", str(tmp_path))
    x = torch.randn(4, 3, requires_grad=True)
    compile_fn(lambda a: (a.sin() * 2).sum())(x).backward()
    with torch.no_grad():
        compile_fn(lambda a: a.cos() + 1)(x)
    names = sorted(folder.name for folder in tmp_path.iterdir())
    roles = [name.split("_")[1] for name in names]
    assert roles == ["forward", "backward", "inference"], names
    numbers = [int(name.split("_")[0]) for name in names]
    assert numbers == sorted(set(numbers))  # distinct, in compile order


def test_ember_compile_rejects_unknown_option():
    with pytest.raises(TypeError, match="unknown ember option"):
        ember.compile(lambda x: x, not_an_option=1)


def test_ember_compile_module():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(ember.compile(model)(x), model(x))


def test_view_of_an_extern_result_that_is_itself_a_view():
    # aten.diagonal returns a view with a storage offset; ember's view of it counts from it
    check(lambda x: torch.diagonal(x, -2).clone() * 2, torch.arange(15.0).view(3, 5))


def test_empty_views_and_effect_tokens():
    check(lambda x: [t * 2 for t in x.unbind(0)], torch.randn(5, 0, 5))
    check(lambda x: x.reshape(0) + 1, torch.randn(0, 8))
    check(lambda x: torch.linalg.inv(x) + 1, torch.randn(3, 3) + 3 * torch.eye(3), rtol=1e-4, atol=1e-4)
