"""Errors on data are raised as eager raises them, and the compiled graph stays usable."""

import pytest
import torch

from tests.helpers import check, compile_fn, to_test_device


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_division_by_zero_raises_like_eager(dtype):
    fn = lambda a, b: (a // b, a % b, torch.div(a, b, rounding_mode="trunc"))
    a, b = torch.tensor([7, -7, 5], dtype=dtype), torch.tensor([2, 3, 0], dtype=dtype)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        fn(a, b)
    compiled = compile_fn(fn)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        compiled(a, b)
    b[2] = -4
    for got, want in zip(compiled(a, b), fn(a, b)):
        assert torch.equal(got, want)


def test_a_zero_divisor_of_a_division_feeding_another_is_reported():
    # the inner division's only user is the outer one; its CHECK used to be dropped (a silent 0)
    fn = lambda a, b, c: torch.div(torch.div(a, b, rounding_mode="trunc"), c, rounding_mode="trunc")
    a, b, c = torch.tensor([7, 8, 9]), torch.tensor([1, 0, 2]), torch.tensor([2, 3, 5])
    compiled = compile_fn(fn)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        compiled(a, b, c)
    b[1] = -3
    assert torch.equal(compiled(a, b, c), fn(a, b, c))


def test_division_by_a_nonzero_constant_needs_no_check():
    check(lambda a: (a // 3, a % -2), torch.arange(-6, 6))


def test_gather_out_of_range_raises_then_recovers():
    fn = lambda x, i: torch.gather(x, 1, i) * 2
    x, i = torch.randn(4, 5), torch.randint(0, 5, (4, 3))
    compiled = compile_fn(fn)
    torch.testing.assert_close(compiled(x, i), fn(x, i))
    i[1, 2] = 7
    with pytest.raises(RuntimeError, match="index 7 is out of bounds"):  # as eager's gather
        compiled(x, i)
    i[1, 2] = -1
    with pytest.raises(RuntimeError, match="index -1 is out of bounds"):
        compiled(x, i)
    i[1, 2] = 4
    torch.testing.assert_close(compiled(x, i), fn(x, i))


# ops reading positions from data: x (6, 5), i (3,) with one bad position. index_add reaches ember
# as index_put (AOTAutograd's decomposition), so its error is index_put's IndexError.
BAD_POSITIONS = {
    "embedding": lambda x, i: torch.nn.functional.embedding(i, x) * 2,
    "index_select": lambda x, i: x.index_select(0, i) + 1,
    "advanced_index": lambda x, i: x[i] * 2,
    "gather": lambda x, i: torch.gather(x, 0, i.unsqueeze(1).expand(3, 5)) * 2,
    "scatter": lambda x, i: x.scatter(0, i.unsqueeze(1).expand(3, 5), 1.0),
    "index_put": lambda x, i: x.index_put((i,), torch.tensor(1.0, device=x.device)),
    "index_add": lambda x, i: x.index_add(0, i, torch.ones(3, 5, device=x.device)),
    "put": lambda x, i: x.put(i, torch.ones(3, device=x.device)),
}
WRAPS_NEGATIVE = {"advanced_index", "index_put", "put"}  # -k counts from the end, as in Python


@pytest.mark.parametrize("op", list(BAD_POSITIONS))
@pytest.mark.parametrize("bad", [123, -141])
def test_kernel_errors_name_the_offending_index(op, bad):
    """An ember kernel's error names the index it rejects, as eager's mostly do, with eager's
    exception type (Note: kernel errors)."""
    fn = BAD_POSITIONS[op]
    x, i = to_test_device(torch.randn(6, 5)), to_test_device(torch.tensor([1, bad, 2]))
    with pytest.raises((IndexError, RuntimeError)) as eager:
        fn(x.cpu(), i.cpu())
    compiled = compile_fn(fn)
    kind = IndexError if op == "index_add" else type(eager.value)
    with pytest.raises(kind, match=f"index {bad} ") as got:
        compiled(x, i)
        if x.device.type == "cuda":
            torch.cuda.synchronize()
    assert "reported by an ember kernel" in str(got.value)
    i[1] = -2 if op in WRAPS_NEGATIVE else 4
    torch.testing.assert_close(compiled(x, i).cpu(), fn(x.cpu(), i.cpu()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the interpreter reads the rows at once)")
def test_deferred_gpu_errors_are_raised_by_a_later_call(monkeypatch):
    """By default a GPU call does not wait for its kernels' error rows: the thread's next call,
    or `ember.check_gpu_errors()`, raises them (Note: deferred GPU error checks)."""
    import ember

    monkeypatch.setenv("EMBER_GPU_ERROR_CHECKS", "deferred")
    fn = BAD_POSITIONS["embedding"]
    x, good = torch.randn(6, 5, device="cuda"), torch.tensor([1, 4, 2], device="cuda")
    bad = torch.tensor([1, 123, 2], device="cuda")
    compiled = compile_fn(fn)
    compiled(x, bad)  # returns: the rows are read later
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match="index 123 .*earlier call on this thread"):
        compiled(x, good)
    torch.testing.assert_close(compiled(x, good), fn(x, good))
    compiled(x, bad)
    with pytest.raises(IndexError, match="index 123 "):
        ember.check_gpu_errors()
    ember.check_gpu_errors()  # nothing left
    torch.testing.assert_close(compiled(x, good), fn(x, good))


class _FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_deferred_checks_raise_once_their_kernels_finish_and_only_on_their_thread():
    """The queue of deferred GPU checks, with stand-in events: a check whose kernels have not
    finished stays queued, a finished one raises once, and other threads never see it."""
    import threading

    from ember.wrapper import runtime

    event = _FakeEvent()
    rows = torch.tensor([[0, 0, 0, 0], [1, 77, 0, 0]])
    errors = [[("IndexError", "index {value} is out of bounds for dimension 0 with size 6")]] * 2
    runtime._pending.queue.append(runtime._DeferredCheck(rows, event, errors))
    runtime.report_earlier_gpu_errors()  # not finished: nothing yet
    seen = []
    other = threading.Thread(target=lambda: seen.append(runtime.check_gpu_errors()))
    other.start()
    other.join()
    assert seen == [None] and len(runtime._pending.queue) == 1
    event.done = True
    with pytest.raises(IndexError, match="index 77 is out of bounds.*earlier call on this thread"):
        runtime.report_earlier_gpu_errors()
    runtime.report_earlier_gpu_errors()  # raised once
    runtime._pending.queue.append(runtime._DeferredCheck(rows, _FakeEvent(), errors))
    with pytest.raises(IndexError, match="index 77 "):
        runtime.check_gpu_errors()  # waits for it
    assert not runtime._pending.queue


def test_threads_that_ended_leave_no_queue_behind():
    """Each thread that calls a GPU graph gets its own queue of deferred checks; a thread that
    ended with nothing queued is dropped when the next one registers (a server's thread per
    request would otherwise grow the list without end)."""
    import threading

    from ember.wrapper import runtime

    runtime.report_earlier_gpu_errors()  # this thread's queue exists
    for _ in range(50):
        worker = threading.Thread(target=runtime.report_earlier_gpu_errors)
        worker.start()
        worker.join()
    live = threading.Thread(target=runtime.report_earlier_gpu_errors)
    live.start()
    live.join()
    assert len(runtime._queues) <= 3  # this thread's, the last one's, and at most one more
