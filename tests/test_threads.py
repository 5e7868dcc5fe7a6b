"""Compiled graphs called from several threads at once: every piece of process-wide state
(error flags, kernel loaders, launchers, searches, specializations, metrics) gives each call
its own answer. Races are forced where a bad interleaving can be built (barriers at the
point that used to be unguarded), and stressed with many threads elsewhere; every result is
checked against eager. The buffer pool's own tests are in test_buffer_pool.py."""

import os
import threading

import pytest
import torch
import torch.nn.functional as F

from ember.wrapper import runtime as wrapper_runtime
from tests.helpers import compile_fn, run_threads

interpreter_only = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter needs TRITON_INTERPRET=1 at start-up"
)
BACKENDS = ["cpp", pytest.param("triton", marks=interpreter_only)]


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")
    if request.param == "triton":
        monkeypatch.setenv("EMBER_BACKEND", "triton")
    return request.param


def embed_twice(w, i):
    return F.embedding(i, w) * 2


# ---- kernel error flags --------------------------------------------------------------------


def valid_checks_first(monkeypatch, flag_class) -> None:
    """Both threads have run their kernels before either reads its flag, and the thread with
    valid indices ("worker-0") reads first: were the flag shared, it would see the other's error."""
    barrier, valid_read = threading.Barrier(2, timeout=60), threading.Event()
    check = flag_class.check

    def check_in_order(self, errors):
        barrier.wait()
        valid = threading.current_thread().name == "worker-0"
        if not valid:
            assert valid_read.wait(60)
        try:
            return check(self, errors)
        finally:
            if valid:
                valid_read.set()

    monkeypatch.setattr(flag_class, "check", check_in_order)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_each_call_reads_only_its_own_kernel_errors(monkeypatch, backend):
    weight, good, bad = torch.randn(10, 4), torch.tensor([1, 9, 3]), torch.tensor([1, 10, 3])
    fn = compile_fn(embed_twice)
    torch.testing.assert_close(fn(weight, good), embed_twice(weight, good))  # compiled before the threads
    flag_class = wrapper_runtime.GpuErrorFlags if backend == "triton" else wrapper_runtime.KernelErrorFlag
    valid_checks_first(monkeypatch, flag_class)
    outcome = {}

    def worker(i):
        try:
            outcome[i] = fn(weight, good if i == 0 else bad)
        except IndexError as e:
            outcome[i] = e

    run_threads(worker, 2)
    assert isinstance(outcome[0], torch.Tensor), f"valid indices raised {outcome[0]!r}"
    torch.testing.assert_close(outcome[0], embed_twice(weight, good))
    assert isinstance(outcome[1], IndexError), "an index out of range returned rows"


def test_errors_stay_with_their_calls_under_stress():
    """Three threads with valid indices, one with an index out of range, 150 calls each."""
    weight, good, bad = torch.randn(64, 256), torch.randint(0, 64, (512,)), torch.randint(0, 64, (512,))
    bad[300] = 64
    fn = compile_fn(embed_twice)
    want = embed_twice(weight, good)
    wrong = []

    def worker(i):
        for _ in range(150):
            try:
                got = fn(weight, bad if i == 3 else good)
                if i == 3 or not torch.equal(got, want):
                    wrong.append((i, "rows"))
            except IndexError:
                if i != 3:
                    wrong.append((i, "IndexError"))

    run_threads(worker, 4)
    assert not wrong, f"{len(wrong)} wrong outcomes, e.g. {wrong[:3]}"
