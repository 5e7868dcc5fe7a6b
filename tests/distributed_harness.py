"""Spawning a small process group from a test: N ranks run one function, the test gets their results.

    results = run_ranks(scenario, tmp_path, cache_dir, world_size=2)

Each rank is a fresh process (torch.multiprocessing, start method "spawn") that joins a process
group through a file store in `tmp_path` (no port to pick, none to collide), runs
`scenario(rank, world_size, device)` and saves what it returns; the test asserts on the list,
one result per rank. On the CPU the group is gloo; with `EMBER_TEST_DEVICE=cuda` it is NCCL on
one GPU per rank (the test is skipped with the reason when there are fewer GPUs than ranks).

Every rank compiles with `EMBER_STRICT=1` (a fallback to eager is an error) into the one cache
folder `cache_dir`, so the ranks compile the same graphs into the same cache at the same time.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# A rank waits this long for the others in a collective: a rank that died makes the others fail
# instead of hanging the suite.
COLLECTIVE_TIMEOUT_S = 120


def distributed_device() -> str:
    return os.environ.get("EMBER_TEST_DEVICE", "cpu")


def skip_unless_enough_devices(world_size: int) -> None:
    if not torch.distributed.is_available():
        pytest.skip("this torch has no torch.distributed")
    if distributed_device() == "cuda" and torch.cuda.device_count() < world_size:
        pytest.skip(f"EMBER_TEST_DEVICE=cuda needs {world_size} GPUs, {torch.cuda.device_count()} present")


def run_ranks(scenario: Callable[[int, int, torch.device], Any], folder: Path, cache_dir: Path,
              world_size: int = 2, env: dict[str, str] | None = None) -> list[Any]:  # fmt: skip
    """Run `scenario` on `world_size` spawned ranks; its results, by rank. A rank that raises
    fails the test with that rank's traceback."""
    skip_unless_enough_devices(world_size)
    settings = {"EMBER_STRICT": "1", "EMBER_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1", **(env or {})}
    store = folder / "store"
    store.unlink(missing_ok=True)
    torch.multiprocessing.spawn(_rank_main, (scenario, world_size, str(folder), settings), nprocs=world_size)
    results = []
    for rank in range(world_size):
        outcome = torch.load(folder / f"rank{rank}.pt", weights_only=False)
        if "error" in outcome:
            pytest.fail(f"rank {rank} failed:\n{outcome['error']}")
        results.append(outcome["result"])
    return results


def _rank_main(rank: int, scenario: Callable, world_size: int, folder: str, settings: dict[str, str]) -> None:
    # A rank killed by a signal prints every thread's Python stack into the test's captured stderr.
    faulthandler.enable()
    os.environ.update(settings)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    device = torch.device("cpu")
    backend = "gloo"
    if distributed_device() == "cuda":
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(
        backend, init_method=f"file://{folder}/store", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )  # fmt: skip
    try:
        outcome: dict[str, Any] = {"result": scenario(rank, world_size, device)}
    except BaseException:
        outcome = {"error": traceback.format_exc()}
    torch.save(outcome, Path(folder) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()
    # The rank's work is saved and its group shut down: leave without the interpreter's teardown.
    # In that teardown torch's C++ objects (gloo's workers, process groups that DeviceMesh and the
    # functional collectives' registry still reference after destroy_process_group) are destroyed
    # in no fixed order. Once in CI (stop 33) a rank aborted with "terminate called without an
    # active exception" in two tests, which 24 runs under load here did not reproduce; if a rank
    # aborts inside its scenario again, faulthandler's stacks show where.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assert_cache_intact(cache_dir: Path) -> None:
    """Every entry the ranks wrote passes the checks ember makes before using one (Note: cache
    safety, ember/runtime/cache.py): each JSON record holds its own key and payload checksum,
    each kernel's shared object matches the checksum its record gives, each wrapper is named
    by the hash of its source; and no writer left a temporary file behind."""
    from ember.runtime.cache import ORPHAN_NAME, content_hash, read_entry, read_verified, resolve_in_root

    files = [p for p in cache_dir.rglob("*") if p.is_file()]
    assert files, f"nothing was cached in {cache_dir}"
    assert not [p for p in files if ORPHAN_NAME.fullmatch(p.name)], "temporary files left behind"
    for path in files:
        kind = path.relative_to(cache_dir).parts[0]
        if path.name.endswith(".tune.json"):  # a Triton module's tuning record: <module>.<key[:12]>.tune.json
            key = json.loads(path.read_text()).get("key", "")
            assert key.startswith(path.name.split(".")[-3]), f"{path}: a tuning record of another key"
            read_entry(path, key)  # raises CorruptEntry
        elif path.suffix == ".json":
            payload = read_entry(path, path.stem)  # raises CorruptEntry
            if kind == "kernels" and "library" in payload:
                read_verified(resolve_in_root(cache_dir, payload["library"]), payload["sha256"])
            elif kind == "kernels":
                read_verified(path.parent / payload["file"], payload["sha256"])
        elif kind == "wrappers" and path.suffix == ".py":
            assert content_hash(path.read_text()) == path.stem, f"{path}: its source does not match its name"
