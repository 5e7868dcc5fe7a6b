"""One helper for every op and model test: compile with ember, compare with eager.

Float results are compared with eager run on float64-upcast inputs (eager float32 CPU
kernels are not always deterministic); dtypes and shapes with eager on the inputs as given.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map


def upcast(x):
    if isinstance(x, torch.Tensor) and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return x.detach().to(torch.float64)
    return x


def compile_fn(fn: Callable) -> Callable:
    torch._dynamo.reset()
    return torch.compile(fn, backend="ember", dynamic=False)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Triton tests run on CPU tensors through the interpreter, or on a GPU machine on CUDA tensors
needs_triton = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(),
    reason="Triton's interpreter needs TRITON_INTERPRET=1 at start-up (or run on a GPU)",
)


def use_triton(monkeypatch) -> None:
    """The test's kernels are Triton's: CPU tensors through the interpreter (TRITON_INTERPRET=1),
    else CUDA tensors compiled for the device (see `needs_triton`)."""
    if INTERPRETED:
        monkeypatch.setenv("EMBER_BACKEND", "triton")
        monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")
    else:
        monkeypatch.setenv("EMBER_TEST_DEVICE", "cuda")


def test_device() -> str:
    """EMBER_TEST_DEVICE=cuda runs every `check` on the GPU (Triton kernels); eager stays the
    reference on the CPU."""
    return os.environ.get("EMBER_TEST_DEVICE", "cpu")


test_device.__test__ = False  # a helper that tests import, not a test pytest should collect

# Tests of the C++ renderer's own structure (loop counts, symbols) or of behaviour only the
# C++ kernels give (var_mean's mean of infinities as eager's CPU Welford) run on the CPU only.
cpu_kernels_only = pytest.mark.skipif(test_device() != "cpu", reason="C++ kernels only (EMBER_TEST_DEVICE is not cpu)")


def dense(x: torch.Tensor) -> bool:
    """Every element of the storage belongs to `x` exactly once (a permuted contiguous layout)."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda p: p[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def to_test_device(x):
    """`x` on the test device with its strides and storage offset. A dense tensor is a fresh
    copy, as users' inputs mostly are (AOTAutograd traces view inputs differently); one with
    an offset or overlapping elements (broadcast) is a view of its whole storage moved there."""
    if not isinstance(x, torch.Tensor) or test_device() == "cpu":
        return x
    if x.storage_offset() == 0 and dense(x):
        return x.detach().to(test_device()).requires_grad_(x.requires_grad)  # keeps the strides
    elements = x.untyped_storage().nbytes() // x.element_size()
    storage = torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage(), 0, (elements,))
    return storage.to(test_device()).as_strided(x.shape, x.stride(), x.storage_offset()).requires_grad_(x.requires_grad)


def check(fn: Callable, *inputs, rtol: float = 1.3e-5, atol: float = 1e-5):
    """Run `fn` compiled by ember and eagerly; assert they agree. Returns ember's result."""
    actual = compile_fn(fn)(*tree_map(to_test_device, inputs))
    actual = tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, actual)
    same_dtype = fn(*inputs)
    upcast_result = fn(*tree_map(upcast, inputs))
    got, _ = tree_flatten(actual)
    eager, _ = tree_flatten(same_dtype)
    precise, _ = tree_flatten(upcast_result)
    assert len(got) == len(eager), f"{len(got)} outputs, eager gives {len(eager)}"
    for i, (g, e, p) in enumerate(zip(got, eager, precise)):
        if not isinstance(e, torch.Tensor):
            assert g == e, f"output {i}: {g!r}, eager {e!r}"
            continue
        assert isinstance(g, torch.Tensor), f"output {i} is a {type(g).__name__}, eager gives a tensor"
        assert g.shape == e.shape, f"output {i}: shape {tuple(g.shape)}, eager {tuple(e.shape)}"
        assert g.dtype == e.dtype, f"output {i}: dtype {g.dtype}, eager {e.dtype}"
        if g.is_floating_point():
            torch.testing.assert_close(g.double(), p.double(), rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m, i=i: f"output {i}: {m}")  # fmt: skip
        else:
            assert torch.equal(g, e), f"output {i}: values differ from eager\nember: {g}\neager: {e}"
    return actual


def check_lowered(ops: dict, *inputs, **tolerance) -> None:
    """`check` the ops compiled together as one graph; none may fall back to aten."""
    import ember

    fns = tuple(ops.values())
    try:
        check(lambda *xs: tuple(fn(*xs) for fn in fns), *inputs, **tolerance)
    except AssertionError as e:
        raise AssertionError(f"{e}\n(outputs in order: {list(ops)})") from None
    assert ember.metrics.fallback_calls == 0, f"lowered ops went to aten: {dict(ember.metrics.fallback_ops)}"


# ---- test data shared by the indexing, scatter and scan tests ----------------------------

f32, f64, i32, i64, b8 = torch.float32, torch.float64, torch.int32, torch.int64, torch.bool


def data(shape: tuple[int, ...], dtype: torch.dtype = f32, seed: int = 0, spread: float = 4.0, int_bound: int = 9
         ) -> torch.Tensor:  # fmt: skip
    """Floats uniform in [-spread, spread), integers in [-int_bound, int_bound], bools."""
    gen = torch.Generator().manual_seed(seed)
    if dtype is b8:
        return torch.rand(shape, generator=gen) < 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=gen, dtype=f64) * (2 * spread) - spread).to(dtype)
    return torch.randint(-int_bound, int_bound + 1, shape, generator=gen, dtype=dtype)


def transposed(shape: tuple[int, ...], dtype: torch.dtype = f32, seed: int = 0) -> torch.Tensor:
    """A non-contiguous tensor of `shape`: the transpose of a contiguous one."""
    return data(shape[::-1], dtype, seed).permute(*reversed(range(len(shape))))


def indices(values, dtype: torch.dtype = i64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# ---- threads -------------------------------------------------------------------------------


def run_threads(worker: Callable[[int], None], count: int) -> None:
    """`worker(i)` on `count` threads at once; the first exception a thread raised is raised here."""
    import threading

    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            worker(i)
        except BaseException as e:  # noqa: BLE001 - reported by the calling thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,), name=f"worker-{i}") for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
