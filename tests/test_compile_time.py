"""Compile time: the per-stage breakdown in `ember.metrics.compile_seconds`, the graph cache's
hits and misses within one process, and gcc started while kernels are still generated."""

import io
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import ember
from ember import compile_cpp
from ember.debug import progress as progress_module
from ember.debug.progress import CompileProgress
from ember.runtime import cpu
from tests.helpers import check

EMBER_STAGES = {"graph_key", "graph_cache_load", "lower", "schedule", "codegen", "render", "runtime", "wrapper"}


def two_kernel_program(x, y):
    # two pointwise kernels with an extern (mm) between them
    return torch.mm((x * y).tanh(), y).sin() * 2


def compile_twice(fn, *inputs, **options):
    """Compile `fn` in a fresh dynamo state twice (the second is a new process as far as the
    graph cache can tell: nothing is kept in memory between them); returns both metrics."""
    seen = []
    for _ in range(2):
        torch._dynamo.reset()
        ember.metrics.reset()
        torch.compile(fn, backend=lambda gm, ex: ember.ember_backend(gm, ex, **options), dynamic=False)(*inputs)
        seen.append(ember.metrics.compile_seconds.copy() | {"hits": ember.metrics.graph_cache_hits})
    return seen


def test_every_stage_is_timed_on_a_miss_and_only_the_lookup_on_a_hit(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    miss, hit = compile_twice(two_kernel_program, x, y)
    assert miss["hits"] == 0 and EMBER_STAGES | {"aot_autograd", "graph_cache_store"} <= set(miss)
    assert all(seconds >= 0 for seconds in miss.values())
    assert hit["hits"] == 1
    assert {"lower", "schedule", "codegen", "runtime", "wrapper"}.isdisjoint(hit)
    assert {"graph_key", "graph_cache_load", "aot_autograd"} <= set(hit)


def test_a_config_change_in_the_cache_key_misses(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    compile_twice(two_kernel_program, x, y)
    (other, again) = compile_twice(two_kernel_program, x, y, parallel_threshold=7)
    assert other["hits"] == 0 and "lower" in other  # a new key: compiled through every stage
    assert again["hits"] == 1


def test_a_flag_outside_the_cache_key_still_hits(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    x = torch.randn(32)
    compile_twice(lambda t: t.sin() + 1, x)
    (hit, _) = compile_twice(lambda t: t.sin() + 1, x, compile_threads=1)
    assert hit["hits"] == 1


def test_kernels_compile_while_others_are_generated(tmp_path, monkeypatch):
    """Each batch of kernels goes to gcc when it is full: with batches of one, the first
    kernel's compile starts before the second kernel is generated (with the compiles deferred,
    the wait below times out)."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")  # gcc's pipeline: the C++ backend on any machine
    monkeypatch.setattr(compile_cpp, "BATCH_KERNELS", 1)
    started, waits = threading.Semaphore(0), []
    real_submit, real_compile = compile_cpp.KernelBuilder.submit, compile_cpp.compile_cpp_batch

    def submit(self, kernel):
        real_submit(self, kernel)
        waits.append(started.acquire(timeout=60))

    def compile_spy(*args, **kwargs):
        started.release()
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(compile_cpp.KernelBuilder, "submit", submit)
    monkeypatch.setattr(compile_cpp, "compile_cpp_batch", compile_spy)
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    check(two_kernel_program, x, y)
    assert ember.metrics.kernels_generated == 2 and ember.metrics.code_cache_misses == 2
    assert waits == [True, True]


def test_identical_kernels_compile_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("EMBER_HORIZONTAL_FUSION", "0")  # x's and y's kernels stay two kernels
    compiled = []
    real_compile = compile_cpp.compile_cpp_batch
    monkeypatch.setattr(compile_cpp, "compile_cpp_batch",
                        lambda kernels, *a: compiled.extend(kernels) or real_compile(kernels, *a))  # fmt: skip

    def f(x, y):  # the same pointwise kernel on two inputs of one layout, each read after
        a, b = x.exp() * 2, y.exp() * 2
        return a, b, torch.mm(a, b)

    x, y = torch.randn(16, 16), torch.randn(16, 16)
    check(f, x, y)
    kernels = ember.metrics.kernels_generated
    assert kernels >= 2 and len(compiled) < kernels  # x's and y's kernels share sources: fewer compiled
    assert len(compiled) == len(set(compiled))
    assert ember.metrics.code_cache_hits + ember.metrics.code_cache_misses == kernels


@pytest.mark.parametrize("requested", [0, 1, 3])
def test_compile_workers(requested):
    usable = len(os.sched_getaffinity(0))
    assert compile_cpp.compile_workers(requested) == (requested or usable)


def test_graph_cache_off_neither_loads_nor_writes_graphs(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    first, second = compile_twice(two_kernel_program, x, y, graph_cache=False)
    assert first["hits"] == second["hits"] == 0
    assert "graph_cache_store" not in first and "lower" in second
    assert not list(tmp_path.rglob("*graphs*"))
    on, again = compile_twice(two_kernel_program, x, y)  # nothing was left behind to hit
    assert on["hits"] == 0 and again["hits"] == 1


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_on_a_terminal_shows_stage_and_kernels_then_is_erased():
    terminal = FakeTerminal()
    progress = CompileProgress(stream=terminal, delay_s=0.0)
    progress.stage_started("codegen")
    progress.kernels(total=5)
    progress.kernels(generated=2, compiled=1)
    deadline = time.monotonic() + 30
    while "2/5 kernels generated, 1 compiled" not in terminal.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    progress.finish()
    shown = terminal.getvalue()
    assert "codegen: 2/5 kernels generated, 1 compiled" in shown
    assert shown.endswith("\r")  # the last write blanks the line and returns to its start


def test_progress_waits_before_drawing():
    terminal = FakeTerminal()
    progress = CompileProgress(stream=terminal, delay_s=3600.0)
    time.sleep(0.6)
    progress.finish()
    assert terminal.getvalue() == ""


def test_compile_is_silent_off_a_terminal_and_logs_each_stage(tmp_path, monkeypatch, capfd, caplog):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(progress_module, "DELAY_S", 0.0)  # a slow compile as far as the line is concerned
    with caplog.at_level(logging.DEBUG, logger="ember"):
        x, y = torch.randn(64, 64), torch.randn(64, 64)
        check(two_kernel_program, x, y)
    assert "ember: compiling" not in capfd.readouterr().err
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "ember")
    for name in ("lower", "schedule", "codegen", "runtime", "wrapper"):
        assert f"stage {name}: " in logged
    assert "graph compiled in" in logged
    infos = [r.getMessage() for r in caplog.records if r.name == "ember" and r.levelno == logging.INFO]
    assert any(" graph " in m and f"{ember.metrics.kernels_generated} kernels" in m for m in infos), infos
    assert not any(m.startswith("stage ") for m in infos)  # stage timings are DEBUG


def test_torch_logs_output_code_shows_embers_kernels_and_wrapper(tmp_path):
    code = "import torch\nf = torch.compile(lambda x: x.sin() * 2, backend='ember')\nf(torch.randn(8))\n"
    env = {**os.environ, "TORCH_LOGS": "output_code", "EMBER_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ember output code, inference graph" in result.stderr
    assert "kernels/" in result.stderr and "wrapper.py" in result.stderr


def test_graph_key_reads_the_graph_without_generating_its_python():
    """AOTAutograd's graphs generate their Python lazily; the graph key spells the nodes itself
    (runtime/graph_cache.py graph_text), so a compiled graph's Python is never generated (for an
    optimizer step's graph of thousands of nodes, a good part of a second). The key still tells
    apart graphs that differ in one argument and is the same for the same graph traced again."""
    from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module

    from ember.runtime.graph_cache import graph_key

    def traced(scale: float) -> torch.fx.GraphModule:
        gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten.mul.Tensor(x, scale) + 1)
        with _use_lazy_graph_module(True):
            return _make_graph_module(gm, gm.graph)

    inputs = [torch.randn(4)]
    lazy = traced(2.0)
    assert isinstance(lazy, _LazyGraphModule) and lazy._needs_recompile()
    key = graph_key(lazy, inputs, "config", "identity")
    assert lazy._needs_recompile()
    assert key == graph_key(traced(2.0), inputs, "config", "identity")
    assert key != graph_key(traced(3.0), inputs, "config", "identity")


def test_random_draws_compile_with_their_own_flags_and_spread_over_batches(tmp_path, monkeypatch):
    """Note: gcc's effort on random draws (runtime/cpu.py): every gcc run over a source with
    Philox draws gets DRAW_FLAGS and holds only such sources, at most DRAWS_PER_BATCH draws unless
    one kernel has more; sources without draws keep gcc's defaults."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "DRAWS_PER_BATCH", 3)
    monkeypatch.setattr(compile_cpp, "DRAWS_PER_BATCH", 3)
    runs = []
    real_run_gcc = cpu._run_gcc

    def spy(folder, key, source, symbols, compiler, extra_flags):
        runs.append((cpu.random_draws(source), symbols.count(",") + 1, extra_flags))
        return real_run_gcc(folder, key, source, symbols, compiler, extra_flags)

    monkeypatch.setattr(cpu, "_run_gcc", spy)

    def masks(x, y, z):  # two masks a shape (a kernel each shape), a softmax: drawing and plain kernels
        drawn = [torch.nn.functional.dropout(t + i, 0.5, training=True) for t in (x, y, z) for i in range(2)]
        return drawn, y.softmax(-1), (x @ x).sin()

    x, y, z = torch.randn(32, 32), torch.randn(8, 48), torch.randn(16, 40)
    # (horizontal fusion off: the drawing kernels and the sine stay kernels of their own)
    drawn, soft, _ = ember.compile(masks, dynamic=False, strict=True, horizontal_fusion=False)(x, y, z)
    assert all(0.2 < (d == 0).float().mean() < 0.8 for d in drawn) and soft.shape == y.shape
    assert any(draws for draws, _, _ in runs) and any(not draws for draws, _, _ in runs), runs
    for draws, kernels, flags in runs:
        assert flags == (cpu.DRAW_FLAGS if draws else ()), runs
        assert draws <= 3 or kernels == 1, runs
