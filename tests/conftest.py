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
