"""Pooled large CPU buffers (runtime/memory.py, Note: pooled large buffers): a buffer is lent
again only once nothing but the pool holds its storage. Outputs a user keeps, views of them,
autograd's saved tensors and buffers of graphs running on other threads are never reused."""

import threading

import pytest
import torch

import ember
from ember.runtime import memory
from tests.helpers import compile_fn, run_threads

N = 1 << 21  # 8 MiB of float32: a large buffer


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch):
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")
    monkeypatch.setenv("EMBER_GRAPH_CACHE", "0")
    memory.release_pooled_buffers()
    yield
    memory.release_pooled_buffers()


def chain(a, b):
    return torch.where(a > 0, a * b, a - b) + 1


def expected(a, b):
    return chain(a.double(), b.double()).float()


def test_a_dropped_output_is_reused_and_the_result_stays_right():
    f = compile_fn(chain)
    a, b = torch.randn(N), torch.randn(N)
    first_ptr = f(a, b).data_ptr()  # dropped at once
    ember.metrics.reset()
    a2, b2 = torch.randn(N), torch.randn(N)
    out = f(a2, b2)
    assert ember.metrics.pooled_buffers_reused == 1
    assert out.data_ptr() == first_ptr
    torch.testing.assert_close(out, expected(a2, b2))


def test_a_kept_output_or_view_is_never_overwritten():
    f = compile_fn(chain)
    a, b = torch.randn(N), torch.randn(N)
    kept = f(a, b)
    view = f(b, a).view(1024, -1)[3:]  # only a view of the second output survives
    ember.metrics.reset()
    later = [f(torch.randn(N), torch.randn(N)) for _ in range(3)]
    assert ember.metrics.pooled_buffers_reused == 0  # every call needed a fresh buffer
    torch.testing.assert_close(kept, expected(a, b))
    torch.testing.assert_close(view, expected(b, a).view(1024, -1)[3:])
    assert len({t.data_ptr() for t in later} | {kept.data_ptr()}) == 4


def test_large_intermediates_are_reused_within_and_across_calls():
    def two_stages(a, b):
        t = torch.sin(a) * b  # a large intermediate the reduction reads
        return t.sum(0) + t.amax(0), torch.cos(t) - a

    f = compile_fn(two_stages)
    a, b = torch.randn(512, 4096), torch.randn(512, 4096)
    for _ in range(3):
        got = f(a, b)
    want = two_stages(a.double(), b.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.float(), rtol=1e-4, atol=1e-3)


def test_autograd_saved_tensors_are_not_reused_before_backward():
    def loss_terms(x, w):
        h = torch.tanh(x * w)  # saved for backward, 8 MiB
        return (h * h).sum()

    f = compile_fn(loss_terms)
    xs = [torch.randn(N) for _ in range(3)]
    w = torch.randn(N, requires_grad=True)
    losses = [f(x, w) for x in xs]  # three forwards before any backward
    grads = [torch.autograd.grad(loss, w)[0] for loss in losses]
    w64 = w.detach().double().requires_grad_()
    for x, grad in zip(xs, grads):
        (want,) = torch.autograd.grad(loss_terms(x.double(), w64), w64)
        torch.testing.assert_close(grad, want.float(), rtol=1e-4, atol=1e-5)


def in_lockstep(monkeypatch, parties: int) -> None:
    """Every thread enters `BufferPool.take` only once all have (so all see the same free
    storages) and leaves it only once all have taken one: the interleaving in which a storage
    checked free but not yet marked taken would be handed to two threads."""
    barrier = threading.Barrier(parties, timeout=60)
    take = memory.BufferPool.take

    def take_in_lockstep(self, *args, **kwargs):
        barrier.wait()
        taken = take(self, *args, **kwargs)
        barrier.wait()
        return taken

    monkeypatch.setattr(memory.BufferPool, "take", take_in_lockstep)


def test_two_threads_taking_at_once_never_share_a_free_storage(monkeypatch):
    size, stride, nbytes = (N,), (1,), N * 4
    memory.empty_large(size, stride, torch.float32, nbytes, huge_pages=False, pool_bytes=64 << 20)  # freed: pooled
    in_lockstep(monkeypatch, 2)
    taken = [None, None]

    def worker(i):
        taken[i] = memory.empty_large(size, stride, torch.float32, nbytes, huge_pages=False, pool_bytes=64 << 20)

    run_threads(worker, 2)
    assert taken[0].data_ptr() != taken[1].data_ptr()


def test_threads_running_one_graph_get_their_own_buffers(monkeypatch):
    f = compile_fn(chain)
    f(torch.randn(N), torch.randn(N))  # compile once, before the threads start
    threads, rounds = 4, 6
    in_lockstep(monkeypatch, threads)
    round_done = threading.Barrier(threads, timeout=60)
    pointers: list[set] = [set() for _ in range(rounds)]

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        for r in range(rounds):
            a, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
            out = f(a, b)
            pointers[r].add(out.data_ptr())
            round_done.wait()  # every thread's output is still held here
            assert torch.equal(out, chain(a, b)), f"thread {seed}, round {r}: another thread's values"
            del out

    run_threads(worker, threads)
    assert all(len(p) == threads for p in pointers)


def test_stress_many_threads_and_shapes_match_eager():
    """No lockstep: many threads, two graphs and two buffer sizes, every result checked."""
    f, g = compile_fn(chain), compile_fn(lambda a: (a * 3 - 1).repeat(2))
    small, large = torch.randn(N), torch.randn(N)
    f(small, large), g(small)  # compiled before the threads start
    failures = []

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        for i in range(12):
            a, b = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
            if seed % 2 == i % 2 and not torch.equal(f(a, b), chain(a, b)):
                failures.append((seed, i, "chain"))
            if seed % 2 != i % 2 and not torch.equal(g(a), (a * 3 - 1).repeat(2)):
                failures.append((seed, i, "repeat"))

    run_threads(worker, 8)
    assert not failures


def test_the_pool_holds_at_most_its_limit(monkeypatch):
    monkeypatch.setenv("EMBER_BUFFER_POOL_MB", "12")  # room for one 8 MiB buffer, not two
    f = compile_fn(chain)
    a, b = torch.randn(N), torch.randn(N)
    kept = [f(a, b) for _ in range(3)]
    assert memory.POOL.held_bytes <= 12 << 20
    del kept
    ember.metrics.reset()
    f(a, b)
    assert ember.metrics.pooled_buffers_reused == 1
    g = compile_fn(lambda a: a.repeat(2) * 2)  # a 16 MiB output: over the limit, fresh
    g(a)
    torch.testing.assert_close(g(a), a.repeat(2) * 2)
    assert memory.POOL.held_bytes <= 12 << 20


def test_pool_off_allocates_fresh_buffers(monkeypatch):
    monkeypatch.setenv("EMBER_BUFFER_POOL_MB", "0")
    f = compile_fn(chain)
    a, b = torch.randn(N), torch.randn(N)
    ember.metrics.reset()
    for _ in range(3):
        torch.testing.assert_close(f(a, b), expected(a, b))
    assert ember.metrics.pooled_buffers_reused == 0
    assert memory.POOL.held_bytes == 0


def test_empty_large_matches_empty_strided_shapes():
    for size, stride in [((3, 1 << 20), (1 << 20, 1)), ((1 << 20, 3), (1, 1 << 20)), ((0, 5), (5, 1)),
                         ((2, 1 << 21), (0, 1))]:  # fmt: skip
        ref = torch.empty_strided(size, stride)
        nbytes = ref.untyped_storage().nbytes()
        t = memory.empty_large(size, stride, torch.float32, nbytes, huge_pages=True, pool_bytes=64 << 20)
        assert t.shape == ref.shape and t.stride() == ref.stride()
        assert t.untyped_storage().nbytes() >= ref.untyped_storage().nbytes()
        t.fill_(1.5)
        assert bool((t == 1.5).all())
