"""Triton kernels compiled ahead of their first call (runtime/triton_pool.py, Note: the compile
pool; runtime/triton_compile.py, Note: ember owns the Triton compile) and the bounded tuning
plan (runtime/triton.py, Note: bounded tuning), on a machine without a GPU: the workers compile
for the CUDA target sm_90 (Triton needs no GPU to build a cubin); nothing is launched.

The pool's workers never run under the interpreter, so the pool is tested from this process
too; a launcher's own compile needs Triton's real jit functions, so the end-to-end check runs
in a process without TRITON_INTERPRET (tests/triton_compile_harness.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import ember
from ember.runtime import triton as triton_runtime
from ember.runtime.cache import open_root
from ember.runtime.triton import LaunchConfig, TritonLauncher, write_module
from ember.runtime.triton_compile import CompileRequest, triton_settings
from ember.runtime.triton_pool import CompileFailed, CompilePool, compile_pool
from tests.helpers import run_threads

ROOT = Path(__file__).resolve().parents[1]
TARGET = ("cuda", 90, 32)

KERNELS = """
import triton
import triton.language as tl


@triton.jit
def good_pointwise(x_ptr, XBLOCK: tl.constexpr):
    offsets = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) * 2)


@triton.jit
def bad_pointwise(x_ptr, XBLOCK: tl.constexpr):
    offsets = tl.arange(0, 3)  # not a power of two: Triton refuses to compile it
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets))
"""

CRASHING = "import os\nos._exit(3)  # the worker importing this module dies\n"


def request_for(module: tuple[str, str, str], function: str, xblock: int, cache_dir: Path) -> CompileRequest:
    options, _, environment = triton_settings()
    root, relative, sha256 = module
    return CompileRequest(root, relative, sha256, function, ("*fp32",), (True,), (("XBLOCK", xblock),), 4, TARGET,
                          options, str(cache_dir), environment)  # fmt: skip


@pytest.fixture
def modules(tmp_path):
    """The test kernels as Triton modules in a fresh ember cache: (root, relative, sha256) each."""
    root = open_root(tmp_path / "ember")
    found = {}
    for name, source in (("kernels", KERNELS), ("crashing", CRASHING)):
        relative, sha256, _ = write_module(source, root, False, ember.__version__)
        found[name] = (str(root), relative, sha256)
    return found


@pytest.fixture
def pool():
    made = CompilePool(2)
    yield made
    made.shutdown()


def run_harness(tmp_path, *mode: str) -> dict:
    """tests/triton_compile_harness.py in a process of its own (no interpreter, fresh caches, two
    workers, tuning plans on): its report."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment |= {
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "EMBER_CACHE_DIR": str(tmp_path / "ember"),
        "EMBER_COMPILE_THREADS": "2",
        "EMBER_AUTOTUNE": "1",
    }  # fmt: skip (tuning plans are the subject)
    done = subprocess.run([sys.executable, "-m", "tests.triton_compile_harness", *mode], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("harness: ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[0].removeprefix("harness: "))


def test_a_graph_compiles_ahead_and_the_first_call_finds_every_kernel_in_the_cache(tmp_path):
    """Every configuration the first call may launch was compiled by the pool's workers, and the
    launcher's own compile of each (what the first call does) is a hit in Triton's cache; the
    same kernel for unaligned pointers is not (the check can tell)."""
    report = run_harness(tmp_path)
    assert report["kernels"] >= 3 and report["error_flag_kernels"] >= 1 and report["by_value_kernels"] >= 1
    assert report["plans"][0] == 1 and report["plans"][-1] > 1  # a tiny kernel takes one, the softmax several
    assert report["requests"] == report["precompiled"] == sum(report["plans"])
    assert report["failures"] == []
    assert report["hits"] == report["requests"] and report["misses"] == 0
    assert report["added_entries"] == 0
    assert report["control_hit"] is False
    assert report["in_process"] == 0
    assert report["workers"] == 2


def test_symbolic_kernels_compile_for_the_gpu_with_sizes_as_arguments(tmp_path):
    """A graph with dynamic shapes on the GPU path (Note: symbolic blocks, ember/codegen/blocks.py):
    compiled once, its kernels' configurations compiled for sm_90 by the pool with the size
    arguments as int64 (never specialized: the requests hold no sizes), each a hit when the first
    call compiles it; the 64-bit-index twins that calls past a size cap take compile too."""
    report = run_harness(tmp_path, "symbolic")
    assert report["symbolic_graphs"] == 1 and report["kernels"] >= 3
    assert report["symbolic_grid_kernels"] >= 3 and report["by_value_kernels"] >= 3
    # the twins with 64-bit indexes compile too (the cross-entropy's kernel gathers at a loaded
    # position, unbounded: it indexes in int64 at every size and has no twin)
    assert report["wide_compiled"] >= 2
    assert report["failures"] == [] and report["requests"] == report["precompiled"]
    assert report["hits"] == report["requests"] and report["misses"] == 0 and report["in_process"] == 0


def test_a_horizontal_kernel_compiles_for_the_gpu(tmp_path):
    """A horizontal kernel (Note: horizontal fusion, ember/schedule/horizontal.py), its parts branches
    on the program id with names of their own, compiles for sm_90 through Triton's real frontend (the
    interpreter runs `if` on a program id as Python does)."""
    report = run_harness(tmp_path, "horizontal")
    assert report["horizontal_groups"] == 1 and report["kernels"] == 1 and report["by_value_kernels"] == 1
    assert report["failures"] == [] and report["requests"] == report["precompiled"]
    assert report["hits"] == report["requests"] and report["misses"] == 0 and report["in_process"] == 0


def test_the_pool_compiles_in_parallel_workers_into_the_given_triton_cache(modules, pool, tmp_path):
    cache = tmp_path / "triton"
    futures = [pool.submit(request_for(modules["kernels"], "good_pointwise", x, cache))[0] for x in (128, 256, 512)]
    assert [f.exception(timeout=600) for f in futures] == [None, None, None]
    assert len([p for p in cache.iterdir() if p.is_dir()]) >= 3  # an entry per configuration (and the launcher's)
    assert len(pool.worker_pids()) == 2
    # one C launcher per list of argument types: asked of the first request only
    assert [f.result()[0] for f in futures].count("compiled") == 2


def recording_ptxas(tmp_path: Path) -> tuple[Path, Path]:
    """Triton's ptxas behind a script that notes each run in a file and adds a line to the
    version it reports (so Triton keys its cache differently): (the script, the notes)."""
    import triton

    real = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    notes = tmp_path / "ptxas-runs.txt"
    script = tmp_path / "bin" / "ptxas"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$@" >> "{notes}"\n'
                      f'if [ "$1" = "--version" ]; then "{real}" --version; echo "(the test\'s ptxas)"; exit 0; fi\n'
                      f'exec "{real}" "$@"\n')  # fmt: skip
    script.chmod(0o755)
    return script, notes


def test_a_ptxas_chosen_after_the_workers_started_is_the_one_they_use(modules, tmp_path, monkeypatch):
    """Note: the tools that key Triton's cache. Inductor points TRITON_PTXAS_PATH at torch's
    ptxas once it compiles, after ember's workers may have started; ptxas's version is in
    Triton's cache key, so a worker still on Triton's ptxas compiled kernels under keys the
    launcher's own compile never finds. Requests carry the variable, and a worker that read one
    ptxas's version reads the new one's: its key is the one a worker started under the new
    ptxas gets; this process reads it again too (it would key its own compile by the old one)."""
    from triton.backends.nvidia import compiler

    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    triton_settings()
    assert "(the test's ptxas)" not in compiler.get_ptxas_version(90)  # Triton's ptxas, read once
    early, late = CompilePool(1), None
    try:
        warm, _ = early.submit(request_for(modules["kernels"], "good_pointwise", 128, tmp_path / "triton"))
        assert warm.exception(timeout=600) is None  # this worker has read Triton's ptxas's version
        script, notes = recording_ptxas(tmp_path)
        monkeypatch.setenv("TRITON_PTXAS_PATH", str(script))
        request = request_for(modules["kernels"], "good_pointwise", 256, tmp_path / "triton")
        assert ("TRITON_PTXAS_PATH", str(script)) in request.environment
        assert "(the test's ptxas)" in compiler.get_ptxas_version(90)  # this process keys by it too
        _, key = early.submit(request)[0].result(timeout=600)
        runs = notes.read_text().splitlines()
        assert any("--version" in run for run in runs) and any("--version" not in run for run in runs)
        late = CompilePool(1)  # started under the new ptxas, compiling into a cache of its own
        _, expected = late.submit(request_for(modules["kernels"], "good_pointwise", 256, tmp_path / "other"))[0].result(
            timeout=600
        )
        assert key == expected
    finally:
        early.shutdown()
        if late is not None:
            late.shutdown()


def test_a_failing_compile_names_its_kernel_and_the_pool_goes_on(modules, pool, tmp_path):
    cache = tmp_path / "triton"
    bad, _ = pool.submit(request_for(modules["kernels"], "bad_pointwise", 128, cache))
    with pytest.raises(CompileFailed, match=r"bad_pointwise \(XBLOCK=128, num_warps=4\) failed to compile"):
        bad.result(timeout=600)
    crashed, _ = pool.submit(request_for(modules["crashing"], "good_pointwise", 128, cache))
    with pytest.raises(CompileFailed, match=r"good_pointwise .* exited \(code 3\)"):
        crashed.result(timeout=600)
    after = [pool.submit(request_for(modules["kernels"], "good_pointwise", x, cache))[0] for x in (64, 128)]
    assert [f.exception(timeout=600) for f in after] == [None, None]


def test_identical_requests_from_many_threads_share_one_pool_and_one_compile(modules, tmp_path):
    pools, queued, futures = [], [], []
    lock = threading.Lock()
    request = request_for(modules["kernels"], "good_pointwise", 1024, tmp_path / "triton")
    start = threading.Barrier(4, timeout=60)

    def worker(i):
        start.wait()
        made = compile_pool()
        future, fresh = made.submit(request)
        with lock:
            pools.append(made), queued.append(fresh), futures.append(future)

    run_threads(worker, 4)
    assert len({id(p) for p in pools}) == 1
    assert queued.count(True) == 1 and len({id(f) for f in futures}) == 1
    assert futures[0].exception(timeout=600) is None


# ---- the tuning plan (Note: bounded tuning) ------------------------------------------------


class StandInModule:
    _sha256 = "0" * 64

    def __init__(self, folder: Path) -> None:
        self.__file__ = str(folder / "module.py")


def launcher(tmp_path, variants, xnumel, rnumel, autotune=True) -> TritonLauncher:
    return TritonLauncher(StandInModule(tmp_path), "k", variants, xnumel, rnumel, [0], interpret=False,
                          autotune=autotune, arguments=["*float32", "*float32"])  # fmt: skip


def test_tuning_times_candidates_only_where_the_choice_can_matter(tmp_path):
    big_pointwise = launcher(tmp_path, ["pointwise"], 1 << 20, 0)
    assert big_pointwise.tuning_plan("gpu") == triton_runtime.candidates(["pointwise"], 1 << 20, 0, False)
    assert len(big_pointwise.tuning_plan("gpu")) > 1
    tiny_reduction = launcher(tmp_path, ["persistent", "looped"], 64, 512)
    assert len(triton_runtime.candidates(["persistent", "looped"], 64, 512, False)) > 1
    assert tiny_reduction.tuning_plan("gpu") == triton_runtime.candidates(["persistent", "looped"], 64, 512, False)[:1]
    assert len(launcher(tmp_path, ["pointwise"], 1 << 20, 0, autotune=False).tuning_plan("gpu")) == 1


def test_a_recorded_winner_is_the_only_configuration_compiled(tmp_path):
    from dataclasses import asdict

    from ember.runtime.cache import write_entry

    kernel = launcher(tmp_path, ["pointwise"], 1 << 20, 0)
    winner = kernel.tuning_plan("gpu")[2]
    record, key = kernel.tuning_record("gpu")
    write_entry(record, key, asdict(winner))
    assert kernel.tuning_plan("gpu") == [winner]
    assert len(kernel.tuning_plan("another gpu")) > 1  # the record is per device
    write_entry(record, key, asdict(LaunchConfig("pointwise", 7, 0, 1)))  # not a candidate any more
    assert len(kernel.tuning_plan("gpu")) > 1


def sized_launcher(tmp_path, variants, rnumel_source="", rnumel=768) -> TritonLauncher:
    """A symbolic kernel's launcher (Note: size classes): x extent s0*s1*768, a row of
    `rnumel_source` (symbolic) or `rnumel`, three buffers and the sizes s0, s1."""
    from ember.runtime.triton_sized import SizedTritonLauncher

    facts = {"grid_numel": "s0*s1*768", "variables": ["s0", "s1"], "variables_at": 3, "size_cap": 512}
    if rnumel_source:
        facts |= {"rnumel_source": rnumel_source, "persistent_row": 16384}
    return SizedTritonLauncher(StandInModule(tmp_path), "k", variants, 2**62, 2**62 if rnumel_source else rnumel,
                               [0], interpret=False, arguments=["*float32"] * 3 + ["int64"] * 2, **facts)  # fmt: skip


def test_a_symbolic_kernel_chooses_a_configuration_per_size_class(tmp_path, monkeypatch):
    """Note: size classes. Calls are classed by the powers of two of their x extent and row and by
    the size cap; a tiny class takes the kernel's default (compiled at load), a large one the
    winner recorded for that class (without timing), a short symbolic row persistent blocks and a
    long one looped."""
    from dataclasses import asdict

    from ember.runtime.cache import write_entry

    monkeypatch.setattr(triton_runtime, "device_facts", lambda device: (TARGET, "gpu"))
    monkeypatch.setattr(triton_runtime, "torch_cuda_current_device", lambda: 0)
    monkeypatch.setattr(TritonLauncher, "benchmark", lambda *args: pytest.fail("timed a recorded class"))
    buffers = tuple(torch.empty(8) for _ in range(3))
    pointwise = sized_launcher(tmp_path, ["pointwise"], rnumel=0)
    small, large, past_cap = (pointwise.classify(*sizes)[1] for sizes in ((1, 37), (16, 100), (600, 2)))
    assert small == (15, 0, False) and large == (21, 0, False) and past_cap[2] is True
    assert pointwise.choose_for_class(small, (*buffers, 1, 37)) == pointwise.default_config()
    options = pointwise.class_candidates(large)
    assert len(options) > 1
    record, key = pointwise.tuning_record("gpu", large)
    write_entry(record, key, asdict(options[-1]))
    assert pointwise.choose_for_class(large, (*buffers, 16, 100)) == options[-1]
    assert pointwise.tuning_record("gpu", small)[0] != record  # one record per class

    row = sized_launcher(tmp_path, ["persistent", "looped"], rnumel_source="s1")
    short, long = row.classify(64, 16)[1], row.classify(2, 20000)[1]
    assert {c.variant for c in row.class_candidates(short)} == {"persistent"}
    assert {c.variant for c in row.class_candidates(long)} == {"looped"}
    assert row.default_config().variant == "looped"  # (compiled at load: no row is too long for it)
    for key, sizes in ((short, (64, 16)), (long, (2, 20000))):
        record, record_key = row.tuning_record("gpu", key)
        write_entry(record, record_key, asdict(row.class_candidates(key)[0]))
        assert row.choose_for_class(key, (*buffers, *sizes)).variant == ("persistent" if key == short else "looped")


def test_precompile_hands_the_plan_to_the_pool_and_counts_it(tmp_path, monkeypatch):
    submitted = []

    class RecordingPool:
        def submit(self, request):
            submitted.append(request)
            return None, True

    monkeypatch.setattr(triton_runtime, "device_facts", lambda device: (TARGET, "gpu"))
    kernel = launcher(tmp_path, ["pointwise"], 1 << 20, 0)
    kernel.precompile(0, RecordingPool())
    plan = kernel.tuning_plan("gpu")
    assert [dict(r.constexprs)["XBLOCK"] for r in submitted] == [c.xblock for c in plan]
    assert all(r.aligned == (True, True) and r.signature == ("*fp32", "*fp32") for r in submitted)
    assert ember.metrics.triton_configs_precompiled == len(plan)


def test_interpreted_kernels_are_never_precompiled(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter needs TRITON_INTERPRET=1 at start-up")
    monkeypatch.setenv("EMBER_BACKEND", "triton")
    x = torch.randn(300, 40)
    got = ember.compile(lambda t: torch.softmax(t, -1) * 2)(x)
    torch.testing.assert_close(got, torch.softmax(x, -1) * 2)
    assert ember.metrics.kernels_generated >= 1
    assert ember.metrics.triton_configs_precompiled == 0 and ember.metrics.triton_kernels_tuned == 0


def test_every_kernel_error_flag_is_16_byte_aligned():
    from ember.wrapper.runtime import GpuErrorFlags

    for codes in (1, 2, 3):
        flags = GpuErrorFlags(5, torch.device("cpu"), codes)
        assert all(flags.slot(i).data_ptr() % 16 == 0 for i in range(5))
    flags.slot(3)[0], flags.slot(3)[2] = 2, 17  # kernel 3 reports its error 2, value 17
    with pytest.raises(ValueError, match="second: 17"):
        two_errors = [("IndexError", "first"), ("ValueError", "second: {value}")]
        flags.check([[("IndexError", "first")]] * 3 + [two_errors] * 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches kernels on a GPU")
def test_on_a_gpu_the_first_call_finds_every_kernel_and_launcher_compiled(tmp_path, monkeypatch):
    """A CUDA graph's wrapper loads; once the pool is done, the first call (tuning included)
    adds nothing to Triton's cache: every kernel and C launcher it loads was built by the pool."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.compile_graph import compile_graph
    from ember.config import load

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("EMBER_AUTOTUNE", "1")  # the first call tunes: what must find its kernels compiled

    def program(x, w):
        return torch.softmax(x, -1) * w + 1, (x * 2).sum(0)

    x, w = torch.randn(512, 1000, device="cuda"), torch.randn(1000, device="cuda")
    call = compile_graph(make_fx(program)(x, w), [x, w], load(cache_dir=str(tmp_path / "ember")))
    pool = compile_pool()
    with pool.lock:
        pending = list(pool.futures.values())
    assert all(f.exception(timeout=600) is None for f in pending)
    before = set((tmp_path / "triton").iterdir())
    got = call([x, w])
    torch.cuda.synchronize()
    assert set((tmp_path / "triton").iterdir()) == before
    for value, expected in zip(got, program(x.double(), w.double())):
        torch.testing.assert_close(value, expected.float(), rtol=1e-4, atol=1e-4)
    assert ember.metrics.triton_configs_precompiled >= 2 and ember.metrics.triton_compiles_in_process == 0
    assert ember.metrics.triton_kernels_tuned >= 1
