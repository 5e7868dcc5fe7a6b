"""The on-disk cache never serves a wrong or crashing artifact, never loads code others could
have written, and `ember cache clear` removes only what ember wrote (Note: cache safety,
ember/runtime/cache.py).

Damaged kernels are loaded in fresh processes: a truncated .so kills its process (SIGBUS),
which must show here as a failed run, not as a dead test worker.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ember
from tests.helpers import compile_fn

# Two programs with the same inputs and the same shapes: one kernel each.
PROGRAMS = {
    "sin": lambda x, y: (x * y + 1.0).sin(),
    "cos": lambda x, y: (x * y - 1.0).cos(),
    "pair": lambda x, y: torch.mm((x * y).tanh(), y / 64).sin(),  # two kernels: one batch (runtime/cpu.py)
}


def program_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.linspace(-3, 3, 4096).reshape(64, 64), torch.linspace(1, 2, 4096).reshape(64, 64)


def expected(name: str) -> torch.Tensor:
    x, y = program_inputs()
    return PROGRAMS[name](x.double(), y.double()).float()


SCRIPT = """
import json, sys, torch, ember
programs = {"sin": lambda x, y: (x * y + 1.0).sin(), "cos": lambda x, y: (x * y - 1.0).cos(),
            "pair": lambda x, y: torch.mm((x * y).tanh(), y / 64).sin()}
x, y = torch.linspace(-3, 3, 4096).reshape(64, 64), torch.linspace(1, 2, 4096).reshape(64, 64)
for name in sys.argv[1:]:
    torch._dynamo.reset()
    out = torch.compile(programs[name], backend="ember", dynamic=False)(x, y)
    ok = torch.allclose(out.double(), programs[name](x.double(), y.double()), atol=1e-5)
    if not ok:
        print("WRONG", name)
m = ember.metrics
print("RESULT", json.dumps({"hits": m.graph_cache_hits, "code_hits": m.code_cache_hits,
                            "code_misses": m.code_cache_misses, "rebuilt": getattr(m, "cache_entries_rebuilt", None)}))
"""


def run_process(cache: Path, *names: str, graph_cache: bool = True, cwd: Path | None = None) -> dict:
    """Compiles and runs `names` in a new process (strict: a graph that fails raises); its
    metrics. `cwd`: where the process imports ember from (the repository by default)."""
    env = {**os.environ, "EMBER_CACHE_DIR": str(cache), "EMBER_STRICT": "1", "EMBER_GRAPH_CACHE": str(int(graph_cache))}
    done = subprocess.run([sys.executable, "-c", SCRIPT, *names], env=env, capture_output=True, text=True, cwd=cwd)
    assert done.returncode == 0, f"the run died (return code {done.returncode}):\n{done.stderr[-3000:]}"
    assert "WRONG" not in done.stdout, done.stdout
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT") :])


def start_process(cache: Path, *names: str) -> subprocess.Popen:
    env = {**os.environ, "EMBER_CACHE_DIR": str(cache), "EMBER_STRICT": "1"}
    return subprocess.Popen([sys.executable, "-c", SCRIPT, *names], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def kernel_files(cache: Path) -> list[Path]:
    return sorted((cache / "kernels").rglob("*.so"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache for this test, in-process and in the processes it starts."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("EMBER_CACHE_DIR", str(folder))
    return folder


def compile_and_run(name: str, **options) -> torch.Tensor:
    torch._dynamo.reset()
    return ember.compile(PROGRAMS[name], dynamic=False, **options)(*program_inputs())


# ---- damaged kernels --------------------------------------------------------------------------


@pytest.mark.parametrize("graph_cache", [True, False])
def test_truncated_kernel_is_rebuilt_not_loaded(cache, graph_cache):
    run_process(cache, "sin", graph_cache=graph_cache)
    (so,) = kernel_files(cache)
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])  # loading it would SIGBUS
    second = run_process(cache, "sin", graph_cache=graph_cache)
    assert second["rebuilt"] >= 1 and second["code_misses"] == 1
    third = run_process(cache, "sin", graph_cache=graph_cache)  # repaired for good
    assert third["rebuilt"] == 0 and third["code_misses"] == 0


@pytest.mark.parametrize("graph_cache", [True, False])
def test_truncated_batch_of_kernels_is_rebuilt_not_loaded(cache, graph_cache, monkeypatch):
    """Two kernels compiled in one gcc run share a .so (Note: kernels compiled together)."""
    monkeypatch.setenv("EMBER_COMPILE_THREADS", "1")  # one worker: the graph's two kernels in one batch
    first = run_process(cache, "pair", graph_cache=graph_cache)
    assert first["code_misses"] == 2
    (so,) = kernel_files(cache)  # one shared object for both kernels
    records = [json.loads(json.loads(r.read_text())["payload"]) for r in (cache / "kernels").rglob("*.json")]
    assert [r.get("library") for r in records] == [so.relative_to(cache).as_posix()] * 2
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])  # loading it would SIGBUS
    second = run_process(cache, "pair", graph_cache=graph_cache)
    assert second["rebuilt"] >= 1 and second["code_misses"] == 2
    third = run_process(cache, "pair", graph_cache=graph_cache)  # repaired for good
    assert third["rebuilt"] == 0 and third["code_misses"] == 0


def test_kernel_swapped_for_another_valid_one_is_rebuilt(cache):
    run_process(cache, "sin", "cos")
    sin_so, cos_so = sorted(kernel_files(cache), key=lambda p: p.stat().st_mtime)
    sin_so.write_bytes(cos_so.read_bytes())  # a valid shared object, with another kernel in it
    second = run_process(cache, "sin", "cos")
    assert second["hits"] == 1 and second["rebuilt"] >= 1 and second["code_misses"] == 1


def test_wrapper_with_bytes_that_are_not_utf8_is_rewritten(cache):
    expected_sin = expected("sin")
    compile_and_run("sin")
    (wrapper,) = (cache / "wrappers").rglob("*.py")
    source = wrapper.read_bytes()
    wrapper.write_bytes(b"\xff\xfe\x00garbage" + source[: len(source) // 3])
    ember.metrics.reset()
    assert torch.allclose(compile_and_run("sin"), expected_sin, atol=1e-5)
    assert ember.metrics.graph_cache_hits == 1 and ember.metrics.cache_entries_rebuilt == 1
    assert wrapper.read_bytes() == source


def test_swapped_graph_entries_are_not_served(cache):
    compile_and_run("sin")
    compile_and_run("cos")
    first, second = sorted((cache / "graphs").rglob("*.json"))
    first_bytes, second_bytes = first.read_bytes(), second.read_bytes()
    first.write_bytes(second_bytes)
    second.write_bytes(first_bytes)
    ember.metrics.reset()
    assert torch.allclose(compile_and_run("sin"), expected("sin"), atol=1e-5)
    assert torch.allclose(compile_and_run("cos"), expected("cos"), atol=1e-5)
    assert ember.metrics.graph_cache_hits == 0 and ember.metrics.cache_entries_rebuilt == 2


def test_graph_entry_that_fails_its_checksum_is_rebuilt(cache):
    compile_and_run("sin")
    (entry,) = (cache / "graphs").rglob("*.json")
    record = json.loads(entry.read_text())
    payload = json.loads(record["payload"])
    payload["summary"]["kernels"] += 1  # valid JSON, valid fields, not what was written
    record["payload"] = json.dumps(payload)
    entry.write_text(json.dumps(record))
    ember.metrics.reset()
    assert torch.allclose(compile_and_run("sin"), expected("sin"), atol=1e-5)
    assert ember.metrics.graph_cache_hits == 0 and ember.metrics.cache_entries_rebuilt == 1


def test_graph_entries_hold_ops_by_name_not_pickles(cache):
    def f(x):  # linalg.inv's error check is an effectful op: the wrapper holds it as an object
        return torch.linalg.inv(x) + 1

    x = torch.randn(3, 3) + 3 * torch.eye(3)
    compile_fn(f)(x)
    (entry,) = (cache / "graphs").rglob("*.json")
    objects = json.loads(json.loads(entry.read_text())["payload"])["objects"]
    assert all(isinstance(o, dict) for o in objects), objects  # described by name, never pickled
    if torch.__version__ >= "2.12":  # (torch 2.11's AOTAutograd leaves the check out of the graph)
        assert {"op": "aten::_linalg_check_errors", "overload": "default"} in objects
    ember.metrics.reset()
    assert torch.allclose(compile_fn(f)(x), torch.linalg.inv(x) + 1, atol=1e-5)
    assert ember.metrics.graph_cache_hits == 1


# ---- what the key covers ---------------------------------------------------------------------


def test_key_covers_every_file_of_ember():
    from ember.runtime.cache_identity import ember_source_files

    package = Path(ember.__file__).parent
    on_disk = {p.relative_to(package).as_posix() for p in package.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip
    assert {path for path, _ in ember_source_files()} == on_disk


def test_edited_or_added_data_file_of_ember_is_a_new_key(tmp_path):
    """Headers are part of ember too: a copy of ember whose data files changed (one edited,
    one added) never serves a graph the original compiled."""
    package = tmp_path / "src" / "ember"
    shutil.copytree(Path(ember.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    assert run_process(cache, "sin", cwd=package.parent)["code_misses"] == 1
    for header in package.rglob("*.h"):
        header.write_text(header.read_text() + "\n// edited\n")
    (package / "renderer" / "added.h").write_text("// a header a kernel might include\n")
    assert run_process(cache, "sin", cwd=package.parent)["hits"] == 0


def test_changed_source_file_is_a_new_key(cache, monkeypatch):
    import ember.runtime.cache_identity as identity

    compile_and_run("sin")
    files = identity.ember_source_files()
    edited = tuple((path, "0" * 64 if path.endswith(".h") or path == "renderer/cpp.py" else digest)
                   for path, digest in files)  # fmt: skip
    monkeypatch.setattr(identity, "ember_source_files", lambda: edited)
    ember.metrics.reset()
    assert torch.allclose(compile_and_run("sin"), expected("sin"), atol=1e-5)
    assert ember.metrics.graph_cache_hits == 0


def test_other_cpu_features_are_new_keys(cache, monkeypatch):
    import ember.runtime.cache_identity as identity

    compile_and_run("sin")
    model, flags = identity.cpu_info()
    other = flags ^ {"avx512f"}  # a CPU with (or without) AVX-512
    monkeypatch.setattr(identity, "cpu_info", lambda: (model, other))
    ember.metrics.reset()
    assert torch.allclose(compile_and_run("sin"), expected("sin"), atol=1e-5)
    assert ember.metrics.graph_cache_hits == 0 and ember.metrics.code_cache_misses == 1


def test_other_compiler_is_a_new_key(cache, monkeypatch):
    import ember.runtime.cache_identity as identity

    compile_and_run("sin")
    real = identity.compiler_identity
    monkeypatch.setattr(identity, "compiler_identity", lambda compiler: real(compiler) + " (another build)")
    ember.metrics.reset()
    compile_and_run("sin")
    assert ember.metrics.graph_cache_hits == 0 and ember.metrics.code_cache_misses == 1


# ---- a cache moved or copied elsewhere --------------------------------------------------------


def test_moved_cache_loads_its_own_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_COMPILE_THREADS", "1")  # pair's two kernels in one batch
    first = run_process(tmp_path / "original", "sin", "cos", "pair")
    assert first["code_misses"] == 4
    os.rename(tmp_path / "original", tmp_path / "moved")
    second = run_process(tmp_path / "moved", "sin", "cos", "pair")
    assert second["hits"] == 3 and second["code_misses"] == 0 and second["rebuilt"] == 0
    third = run_process(tmp_path / "moved", "sin", "cos", "pair", graph_cache=False)  # each kernel's record
    assert third["code_misses"] == 0 and third["code_hits"] == 4 and third["rebuilt"] == 0


# ---- temporary files of killed compiles -------------------------------------------------------


def test_orphaned_temporary_files_are_removed(cache):
    from ember.runtime.cache import ORPHAN_AGE_S

    compile_and_run("sin")
    (record,) = (cache / "kernels").rglob("*.json")
    folder, key = record.parent, record.stem
    old, fresh = folder / f".{key}.so.k1ll3d.so", folder / f".{key}.so.runn1n.so"
    old.write_bytes(b"half a kernel")
    fresh.write_bytes(b"a kernel being written")
    os.utime(old, (time.time() - 2 * ORPHAN_AGE_S,) * 2)
    record.unlink()  # the next compile writes this folder again
    compile_and_run("sin", graph_cache=False)
    assert not old.exists()
    assert fresh.exists()  # it may belong to a compile still running


# ---- who may write the folders code is loaded from --------------------------------------------


def test_cache_folders_are_private(cache):
    compile_and_run("sin")
    folders = [cache, *(p for p in cache.rglob("*") if p.is_dir())]
    assert len(folders) > 4 and all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in folders)
    assert all(not p.stat().st_mode & 0o077 for p in cache.rglob("*") if p.is_file())


@pytest.mark.parametrize("where", ["root", "kernels"])
def test_folder_writable_by_others_is_refused(cache, where):
    folder = cache if where == "root" else cache / "kernels"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    with pytest.raises(Exception, match=f"{re.escape(str(folder))} is writable by group or others.*chmod go-w"):
        compile_and_run("sin")
    assert not list(cache.rglob("*.so"))


def test_folder_of_another_user_is_refused(cache, monkeypatch):
    cache.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: cache.stat().st_uid + 1)
    with pytest.raises(Exception, match=f"{re.escape(str(cache))} belongs to user id"):
        compile_and_run("sin")


# ---- ember cache clear ---------------------------------------------------------------------


def test_cache_clear_leaves_foreign_files_alone(tmp_path, monkeypatch, capsys):
    project = tmp_path / "myproject"
    (project / "kernels").mkdir(parents=True, mode=0o700)
    (project / "notes.txt").write_text("mine")
    (project / "kernels" / "readme.md").write_text("also mine")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(project))
    compile_and_run("sin")
    assert list(project.rglob("*.so"))
    from ember.cli import main

    main(["cache", "clear"])
    printed = capsys.readouterr().out
    left = sorted(p.relative_to(project).as_posix() for p in project.rglob("*"))
    assert left == ["kernels", "kernels/readme.md", "notes.txt"]
    assert "removed" in printed and "notes.txt" in printed and "kernels/readme.md" in printed
    compile_and_run("sin")  # and the cache works again afterwards
    assert list(project.rglob("*.so"))


def test_cache_clear_removes_a_cache_it_made(cache, capsys):
    compile_and_run("sin")
    from ember.cli import main

    main(["cache", "clear"])
    assert not cache.exists()
    assert "removed" in capsys.readouterr().out


def test_cache_clear_refuses_a_folder_that_is_not_a_cache(tmp_path, monkeypatch):
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(folder))
    from ember.cli import main

    with pytest.raises(SystemExit, match="not an ember cache"):
        main(["cache", "clear"])
    assert (folder / "notes.txt").read_text() == "mine"


# ---- concurrent writers ------------------------------------------------------------------------


def test_processes_compiling_into_one_fresh_cache_at_once(cache):
    runs = [start_process(cache, "sin", "cos") for _ in range(4)]
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0 and "WRONG" not in out, err[-3000:]
    assert_every_entry_verifies(cache)
    after = run_process(cache, "sin", "cos")
    assert after["hits"] == 2 and after["rebuilt"] == 0


def assert_every_entry_verifies(cache: Path) -> None:
    from ember.runtime.cache import read_entry, read_verified

    assert not [p for p in cache.rglob(".*") if p.name != ".ember-cache"], "temporary files left behind"
    records = sorted((cache / "kernels").rglob("*.json"))
    assert len(records) == 2
    for record in records:
        entry = read_entry(record, record.stem)
        read_verified(record.parent / entry["file"], entry["sha256"])
    graphs = sorted((cache / "graphs").rglob("*.json"))
    assert len(graphs) == 2 and all(read_entry(g, g.stem) is not None for g in graphs)


def test_threads_compiling_into_one_fresh_cache_at_once(cache):
    from concurrent.futures import ThreadPoolExecutor

    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.compile_graph import compile_graph
    from ember.config import load

    x, y = program_inputs()
    graph = make_fx(PROGRAMS["sin"])(x, y)
    config = load()
    with ThreadPoolExecutor(4) as pool:
        calls = list(pool.map(lambda _: compile_graph(graph, [x, y], config), range(8)))
    for call in calls:
        assert torch.allclose(call([x, y])[0], expected("sin"), atol=1e-5)
    assert not [p for p in cache.rglob(".*") if p.name != ".ember-cache"]


def test_graphs_compile_in_a_cache_copied_with_its_modes(tmp_path):
    # copytree keeps modes: a private cache copied elsewhere stays usable
    run_process(tmp_path / "a", "sin")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "a")
    assert run_process(tmp_path / "b", "sin")["hits"] == 1
