"""Smoke test of the benchmark harness: the two smallest workloads, tiny sizes, eager and ember,
run end to end through `python -m benchmarks.run` (warm compile subprocess included)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run import SOURCE_CHANGED

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_harness_produces_correct_rows(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "benchmarks.run", "--quick", "--strict", "--models", "mlp,attention"]
    command += ["--compilers", "eager,ember", "--repeat", "2", "--warmup", "1", "--json", str(out)]
    # keep the caller's path too: where ember's dynamo entry point is registered by a path, not an install
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr

    rows = {row["name"]: row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {"mlp", "attention"}
    for name, row in rows.items():
        errors = dict(row["errors"])
        # Someone editing ember while the test runs makes the warm compile meaningless, not wrong.
        source_changed = errors.pop("ember warm", None) == SOURCE_CHANGED
        assert errors == {}, f"{name}: {errors}"
        assert row["correct"] == {"eager": True, "ember": True}, f"{name}: {row['max_error']}"
        assert row["ms"]["eager"] > 0 and row["ms"]["ember"] > 0
        assert row["samples"] == 2
        assert row["compile_s"]["ember"] > 0
        assert row["ember_metrics"]["graphs_compiled"] > 0
        # attention is all extern calls (its linears, and flash attention: passes/attention.py)
        assert row["ember_metrics"]["kernels_generated"] > 0 or name == "attention"
        if not source_changed:
            assert row["warm_compile_s"] > 0
            assert row["ember_metrics"]["warm_code_cache_misses"] == 0, (
                "the warm compile should find every kernel cached"
            )
    assert "\nmlp " in done.stdout and "geomean speedup over eager, ember" in done.stdout


def run_rows(tmp_path, *options: str) -> dict:
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "benchmarks.run", "--quick", "--strict", "--compilers", "eager,ember"]
    command += [*options, "--repeat", "2", "--warmup", "1", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return {row["name"]: row for row in json.loads(out.read_text())["results"]}


def test_optimizer_step_and_real_model_workloads(tmp_path):
    """The whole training step with AdamW (each compiler on its own copy), and the real-model
    suite's registry (`--suite real`, warm compile subprocess included), a training step too."""
    pytest.importorskip("transformers")
    rows = run_rows(tmp_path, "--models", "gpt2_adamw", "--no-warm")
    rows |= run_rows(tmp_path, "--suite", "real", "--models", "resnet50_b1")
    rows |= run_rows(tmp_path, "--suite", "real", "--models", "bert_base_train", "--no-warm")
    assert set(rows) == {"gpt2_adamw", "resnet50_b1", "bert_base_train"}
    for name, row in rows.items():
        errors = dict(row["errors"])
        if errors.get("ember warm") == SOURCE_CHANGED:  # someone edited ember during the run
            del errors["ember warm"]
        assert errors == {}, f"{name}: {errors}"
        assert row["correct"] == {"eager": True, "ember": True}, f"{name}: {row['max_error']}"
        assert row["ember_metrics"]["fallback_calls"] == 0
    assert rows["gpt2_adamw"]["ember_metrics"]["inputs_written_in_place"] > 0


def test_call_profile_reports_both_graphs():
    """benchmarks/call_profile.py on the smallest case, a few calls: both graphs timed and profiled."""
    pytest.importorskip("transformers")
    command = [sys.executable, "-m", "benchmarks.call_profile", "--case", "gpt2-tiny", "--shape", "1,8",
               "--device", "cpu", "--calls", "3", "--top", "5"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("static", "symbolic"):
        assert f"gpt2-tiny (1, 8) {name}: wall" in done.stdout
        assert f"===== {name}: 3 calls, by own time" in done.stdout


def test_decode_benchmark_tokens_match_eager():
    """benchmarks/decode.py on two-layer models, ember only: each model's loop compiles, its tokens
    equal eager's (the benchmark prints when they differ) and a per-token time is printed."""
    pytest.importorskip("transformers")
    command = [sys.executable, "-m", "benchmarks.decode", "--quick", "--compilers", "ember", "--tokens", "4",
               "--rounds", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "differ" not in done.stdout, done.stdout
    for name in ("gpt2", "llama"):
        assert f"{name}: 4 tokens, batch 1" in done.stdout, done.stdout
    assert done.stdout.count("  ember ") == 2, done.stdout


def test_distributed_benchmark_on_two_gloo_ranks(tmp_path):
    """benchmarks/distributed.py end to end on the CPU: SimpleFSDP (collectives in ember's graphs),
    ember with its default bound on collectives in flight and without one, losses against eager's.
    On gloo both issue the collectives one at a time (Note: gloo runs collectives one at a time)."""
    pytest.importorskip("transformers")
    import torch

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch has no gloo")
    out = tmp_path / "dist.json"
    backends = "eager,ember,ember@EMBER_COLLECTIVES_IN_FLIGHT=0"
    command = [sys.executable, "-m", "benchmarks.distributed", "--device", "cpu", "--nproc", "2", "--tiny",
               "--fsdp", "simple", "--backends", backends, "--json", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    env["EMBER_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["backend"]: row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {"eager", "ember", "ember@EMBER_COLLECTIVES_IN_FLIGHT=0"}
    bounded, unbounded = rows["ember"]["ember_graphs"], rows["ember@EMBER_COLLECTIVES_IN_FLIGHT=0"]["ember_graphs"]
    assert bounded["collectives"] == unbounded["collectives"] > 0
    assert bounded["most_in_flight"] == unbounded["most_in_flight"] == 1, (bounded, unbounded)
    assert bounded["overlapped_kernels"] == unbounded["overlapped_kernels"] > 0, (bounded, unbounded)
    for row in rows.values():
        assert row["max_loss_diff_vs_eager"] < 1e-4, row


def test_architecture_sweep_checks_every_mode(tmp_path):
    """benchmarks/architectures.py on one model: each mode in a process of its own, every output and
    gradient against float64 eager."""
    out = tmp_path / "architectures.json"
    command = [sys.executable, "-m", "benchmarks.architectures", "distilbert", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = {row["mode"]: row for row in json.loads(out.read_text())}
    assert set(results) == {"infer", "train", "dyn", "bf16"}, done.stdout
    assert all(row["status"] == "ok" for row in results.values()), done.stdout
    assert results["train"]["n_compared"] > 10  # the loss, the logits and the gradients


def test_timm_sweep_checks_every_mode(tmp_path):
    """benchmarks/timm_sweep.py on a small vision transformer and a small CNN (BatchNorm's running
    statistics in train mode): each mode in a process of its own, every output and gradient against
    float64 eager."""
    pytest.importorskip("timm")
    out = tmp_path / "timm.json"
    command = [sys.executable, "-m", "benchmarks.timm_sweep", "vit", "regnetx_002", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = {(row["name"], row["mode"]): row for row in json.loads(out.read_text())}
    modes = {"infer", "train", "dyn", "channels_last"}
    assert set(results) == {(name, mode) for name in ("vit", "regnetx_002") for mode in modes}, done.stdout
    assert all(row["status"] == "ok" for row in results.values()), done.stdout
    # the loss, the output, about 130 gradients and 50 BatchNorms' statistics
    assert results[("regnetx_002", "train")]["n_compared"] > 150
    assert "totals: ok 8" in done.stdout
