import os

import pytest
import torch

# Without a GPU the Triton renderer's tests run under Triton's interpreter, which must be
# switched on before triton is imported (tests/test_triton.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests run strict: a graph that fails to compile is an error, never a silent eager run.
os.environ.setdefault("EMBER_STRICT", "1")
# Every kernel the suite compiles is checked against the IR spec after each codegen step.
os.environ.setdefault("EMBER_CHECK_IR", "1")
# A bad index a GPU kernel meets raises in the call itself; the tests of the default, deferred
# reporting (Note: deferred GPU error checks) set it back.
os.environ.setdefault("EMBER_GPU_ERROR_CHECKS", "sync")
# Which library a linear takes is timed on the machine (Note: timed matmul libraries), and the
# suite's counts must not depend on the machine: off, except in tests/test_matmul_timing.py,
# which sets the verdicts it wants.
os.environ.setdefault("EMBER_MATMUL_TIMING", "0")

# dynamo's dynamic-shape flags as this process starts, restored after each test (below).
_DYNAMO_SHAPE_FLAGS = {
    name: getattr(torch._dynamo.config, name) for name in ("automatic_dynamic_shapes", "assume_static_by_default")
}


@pytest.fixture(autouse=True)
def _isolated_ember(tmp_path_factory, monkeypatch):
    """Each test session shares one cache dir (so kernels compile once), fresh metrics."""
    import torch

    import ember

    cache = tmp_path_factory.getbasetemp().parent / "ember-test-cache"
    monkeypatch.setenv("EMBER_CACHE_DIR", os.environ.get("EMBER_TEST_CACHE_DIR", str(cache)))
    torch._dynamo.reset()
    ember.metrics.reset()
    yield
    _restore_dynamo_shape_flags()


def _restore_dynamo_shape_flags() -> None:
    """torch before 2.13 switches these two flags as plain process-wide attributes around each
    call of a `dynamic=False` compiled function (set, call, restore what it saw). Two threads
    calling at once can restore each other's setting, leaving automatic dynamic shapes off for
    the rest of the process: every later test in that pytest worker then compiles static
    graphs only (seen on torch 2.11 after tests/test_threads.py). A torch bug, not ember's."""
    for name, value in _DYNAMO_SHAPE_FLAGS.items():
        if getattr(torch._dynamo.config, name) != value:
            setattr(torch._dynamo.config, name, value)
