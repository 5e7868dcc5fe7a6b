"""CUDA graphs (runtime/cuda_graphs.py, Note: CUDA graphs): replays are right when inputs move,
outputs are held, outputs alias, inputs are written, threads share a graph, kernels report
errors; graphs that cannot be replayed run as they are with a reason. The GPU tests run on the
GPU machine; the option's plumbing is tested on the CPU too."""

from __future__ import annotations

import threading

import pytest
import torch

import ember
from ember.metrics import metrics

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def compiled(fn, **options):
    torch._dynamo.reset()
    metrics.reset()
    return torch.compile(fn, backend="ember", mode="reduce-overhead", dynamic=False, options=options or None)


def test_reduce_overhead_mode_on_cpu_graphs_changes_nothing():
    f = compiled(lambda x: (x * 2).sin())
    x = torch.randn(64)
    for _ in range(3):
        torch.testing.assert_close(f(x), (x * 2).sin())
    assert metrics.cuda_graphs_recorded == 0 and metrics.cuda_graph_refusals == 0
    assert metrics.graphs_compiled == 1


def test_unknown_mode_is_refused_by_name():
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1, backend="ember", mode="fastest")
    with pytest.raises(Exception, match="unknown torch.compile mode 'fastest'"):
        f(torch.ones(2))


def test_options_dict_reaches_ember_config():
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1, backend="ember", options={"no_such_option": 1})
    with pytest.raises(Exception, match="no_such_option"):
        f(torch.ones(2))


@cuda
def test_mlp_inference_replays_with_fresh_inputs_each_call():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 32)).cuda()
    f = compiled(model)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
    assert metrics.cuda_graph_replays >= 4
    assert 1 <= metrics.cuda_graphs_recorded <= 2  # a second one once the input moved
    assert metrics.cuda_graph_refusals == 0


@cuda
def test_held_large_outputs_are_never_overwritten():
    f = compiled(lambda x: x * 2 + 1)
    inputs = [torch.randn(1 << 20, device="cuda") for _ in range(5)]  # 4 MiB outputs: handed out as they are
    outputs = [f(x) for x in inputs]  # every output still held when the next call replays
    for x, out in zip(inputs, outputs):
        torch.testing.assert_close(out, x * 2 + 1)
    assert metrics.cuda_graph_replays >= 2


@cuda
def test_outputs_sharing_a_storage_still_share_it():
    def f(a):
        b = a * 2
        return b, b[1:]

    g = compiled(f)
    for size in (4, 1 << 19):  # copied out (small) and handed out (large)
        a = torch.randn(size, 8, device="cuda")
        for _ in range(3):
            out, view = g(a)
            out[1, 0] = 1234.0
            assert view[0, 0].item() == 1234.0
            torch.testing.assert_close(out[2:], a[2:] * 2)


@cuda
def test_inputs_the_graph_writes_are_written_at_every_call():
    def f(x):
        x.add_(1)
        return x * 2

    g = compiled(f)
    for _ in range(4):
        x = torch.randn(1000, device="cuda")
        expected = x + 1
        out = g(x)
        torch.testing.assert_close(x, expected)
        torch.testing.assert_close(out, expected * 2)


@cuda
def test_training_step_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1)).cuda()
    twin = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1)).cuda()
    twin.load_state_dict(model.state_dict())
    step = compiled(lambda x, y: torch.nn.functional.mse_loss(model(x), y))
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(6):
        x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 1, device="cuda")
        loss = step(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        twin_loss = torch.nn.functional.mse_loss(twin(x), y)
        twin_loss.backward()
        twin_opt.step()
        twin_opt.zero_grad()
        torch.testing.assert_close(loss, twin_loss, rtol=1e-4, atol=1e-5)
    assert metrics.cuda_graph_replays >= 6  # forward and backward graphs
    assert metrics.cuda_graph_refusals == 0
    # a fresh batch each step: the forward records again once and copies it from then on; the
    # backward records again when the forward's outputs moved, never copying them
    assert metrics.cuda_graphs_recorded <= 4


def _seeded_calls(f, inputs, calls: int) -> list:
    """`f`'s results at `calls` calls after torch.manual_seed(0), the first call (compile and a
    CUDA graph runner's warm-up) made before seeding."""
    f(*inputs)
    torch.manual_seed(0)
    return [f(*inputs) for _ in range(calls)]


@cuda
def test_dropout_replays_draw_fresh_numbers_the_same_as_without_graphs():
    """Note: random numbers in CUDA graphs: each replay draws its own seed, from torch's
    generator, so the numbers equal those of the same calls without CUDA graphs."""
    fn = lambda x: torch.nn.functional.dropout(x, 0.5, training=True) * 2  # noqa: E731
    x = torch.ones(4096, device="cuda")
    replayed = _seeded_calls(compiled(fn), [x], 4)
    assert metrics.cuda_graph_refusals == 0 and metrics.cuda_graphs_recorded == 1
    assert metrics.cuda_graph_replays == 4
    torch._dynamo.reset()
    plain = _seeded_calls(torch.compile(fn, backend="ember", dynamic=False), [x], 4)
    assert not torch.equal(replayed[2], replayed[3])  # fresh numbers at every replay
    for got, want in zip(replayed, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert 0.4 < (got != 0).float().mean().item() < 0.6


@cuda
def test_training_with_dropout_replays_forward_and_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Dropout(0.3), torch.nn.GELU(),
                                torch.nn.Linear(128, 8)).cuda()  # fmt: skip
    x = torch.randn(32, 64, device="cuda")

    def step(f):
        loss = f(x).square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    graphs = compiled(model)
    replayed = _seeded_calls(lambda: step(graphs), [], 4)
    # the forward and the backward; the backward once more when the saved values it reads move
    assert metrics.cuda_graph_refusals == 0 and 2 <= metrics.cuda_graphs_recorded <= 3
    assert metrics.cuda_graph_replays >= 6
    torch._dynamo.reset()
    plain_model = torch.compile(model, backend="ember", dynamic=False)
    plain = _seeded_calls(lambda: step(plain_model), [], 4)
    for (loss, grads), (want_loss, want_grads) in zip(replayed, plain):
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@cuda
def test_bad_index_raises_after_a_replay():
    weight = torch.randn(10, 4, device="cuda")
    f = compiled(lambda i: torch.nn.functional.embedding(i, weight) * 2)
    good = torch.tensor([1, 2, 3], device="cuda")
    for _ in range(3):
        torch.testing.assert_close(f(good), weight[good] * 2)
    assert metrics.cuda_graph_replays >= 1
    with pytest.raises(IndexError):
        f(torch.tensor([1, 20, 3], device="cuda"))
    torch.testing.assert_close(f(good), weight[good] * 2)


@cuda
def test_deferred_error_checks_of_the_warm_up_call_do_not_stop_the_recording():
    """The default deferred checks queue an event at the warm-up call; the next call (the
    recording) must not query it while capturing (it would invalidate the capture)."""
    weight = torch.randn(10, 4, device="cuda")
    torch._dynamo.reset()
    metrics.reset()
    options = {"cuda_graphs": True, "gpu_error_checks": "deferred"}  # (the tests' default is "sync")
    f = torch.compile(lambda i: torch.nn.functional.embedding(i, weight) * 2, backend="ember", options=options)
    good = torch.tensor([1, 2, 3], device="cuda")
    for _ in range(4):
        torch.testing.assert_close(f(good), weight[good] * 2)
    assert metrics.cuda_graph_refusals == 0 and metrics.cuda_graphs_recorded == 1
    assert metrics.cuda_graph_replays >= 2
    f(torch.tensor([1, 20, 3], device="cuda"))
    with pytest.raises(IndexError):
        ember.check_gpu_errors()


@cuda
def test_small_outputs_of_several_dtypes_stay_right_while_kept():
    """Note: one copy per replay: small outputs are packed into one buffer per replay, each a
    tensor of its own that later replays never overwrite."""

    def fn(x):
        return x.sum(), x.argmax(), x > 0, x.half() * 2, x[:3] + 1, (x * 3).reshape(10, 10).t()

    f = compiled(fn)
    kept = []
    for k in range(6):
        x = torch.randn(100, device="cuda") + k
        kept.append((x, f(x)))
    assert metrics.cuda_graph_replays >= 4 and metrics.cuda_graph_refusals == 0
    for x, got in kept:
        for g, w in zip(got, fn(x)):
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    got = kept[-1][1]
    got[0].add_(100)  # each output is its own tensor: writing one changes no other
    torch.testing.assert_close(got[1], fn(kept[-1][0])[1])
    torch.testing.assert_close(got[4], fn(kept[-1][0])[4])


@cuda
def test_threads_sharing_a_graph_get_their_own_results():
    f = compiled(lambda x: (x * 3).cos() + x)
    f(torch.randn(1 << 16, device="cuda"))  # warm up and record before the threads start
    f(torch.randn(1 << 16, device="cuda"))
    wrong = []

    def work(seed: int) -> None:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        for _ in range(50):
            x = torch.randn(1 << 16, device="cuda", generator=generator)
            out = f(x)
            if not torch.allclose(out, (x * 3).cos() + x, rtol=1e-4, atol=1e-4):
                wrong.append(seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    assert metrics.cuda_graph_replays >= 100


@cuda
def test_cpu_input_is_refused_with_a_reason(caplog):
    f = compiled(lambda x, i: x[i] * 2)
    x, i = torch.arange(8.0, device="cuda"), torch.tensor([1, 5])
    with caplog.at_level("WARNING", logger="ember"):
        for _ in range(3):
            out = f(x, i)
    torch.testing.assert_close(out, x[i.cuda()] * 2)
    assert metrics.cuda_graph_refusals == 1 and "input 1 (shape (2,), torch.int64) is on cpu" in caplog.text


@cuda
def test_a_0d_cpu_input_is_copied_in_before_each_replay():
    f = compiled(lambda x, s: x * s)
    x = torch.ones(8, device="cuda")
    for k in range(5):
        torch.testing.assert_close(f(x, torch.tensor(float(k))), torch.full((8,), float(k), device="cuda"))
    assert metrics.cuda_graph_refusals == 0 and metrics.cuda_graphs_recorded == 1
    assert metrics.cuda_graph_replays == 4


@cuda
def test_ember_compile_takes_the_mode_too():
    torch._dynamo.reset()
    metrics.reset()
    f = ember.compile(lambda x: x.relu() * 2, mode="reduce-overhead")
    for _ in range(3):
        x = torch.randn(100, device="cuda")
        torch.testing.assert_close(f(x), x.relu() * 2)
    assert metrics.cuda_graph_replays >= 1


def _twin_models(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).cuda()
    twin = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).cuda()
    twin.load_state_dict(model.state_dict())
    return model, twin


@cuda
def test_a_training_step_hands_activations_and_gradients_over_without_copies():
    """Note: outputs lent or copied: the backward reads the forward's saved activations, and the
    compiled optimizer reads the gradients, where the recordings lent them; only the loss is
    copied out."""
    model, twin = _twin_models()
    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 4, device="cuda")

    def whole_step(net, opt):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    opt, twin_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(twin.parameters(), lr=1e-2)
    step = compiled(lambda: whole_step(model, opt))
    losses = [step().item() for _ in range(4)]  # warm-ups and recordings
    metrics.reset()
    losses += [step().item() for _ in range(5)]
    assert metrics.cuda_graph_replays >= 15 and metrics.cuda_graph_refusals == 0  # forward, backward, optimizer
    assert metrics.cuda_graph_skips == 0 and metrics.cuda_graphs_recorded == 0
    # at most the loss's gradient (a fresh tensor at each backward); copying the 4 gradients into the
    # optimizer's recording would be 4 a step
    assert metrics.cuda_graph_input_copies <= 5
    assert metrics.cuda_graph_output_copies == 5  # the loss of each forward
    for loss in losses:
        assert loss == pytest.approx(whole_step(twin, twin_opt).item(), rel=1e-5, abs=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):  # (9 AdamW steps: rounding of compiled updates)
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@cuda
@pytest.mark.parametrize("keep", ["zero_in_place", "by_hand"])
def test_gradients_kept_across_steps_stay_right_and_are_copied_from_then_on(keep):
    model, twin = _twin_models(1)
    graphs = compiled(model)
    kept, want = [], []
    for k in range(6):
        x = torch.randn(8, 32, device="cuda") + k
        for net, out in ((graphs, kept), (twin, want)):
            net(x).square().mean().backward()
            out.append([p.grad if keep == "by_hand" else p.grad.clone() for p in net.parameters()])
            if keep == "by_hand":  # the user holds the gradient tensors themselves
                for p in net.parameters():
                    p.grad = None
            else:  # .grad keeps the first step's storages, zeroed and accumulated into in place
                net.zero_grad(set_to_none=False)
    assert metrics.cuda_graph_refusals == 0 and metrics.cuda_graph_replays >= 8 and metrics.cuda_graph_skips == 0
    if keep == "by_hand":  # (zeroed in place, .grad holds the warm-up call's gradients, not lent ones)
        assert metrics.cuda_graph_outputs_kept > 0
    for got, expected in zip(kept, want):
        for g, w in zip(got, expected):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_only_graphs_that_launch_work_are_recorded():
    from ember.compile_graph import launches_work
    from ember.runtime.graph_cache import GraphSummary

    assert not launches_work(GraphSummary())  # views and aliases alone: nothing to replay
    assert launches_work(GraphSummary(kernels=1)) and launches_work(GraphSummary(extern_calls=2))


@cuda
def test_a_graph_of_views_runs_without_a_recording():
    f = compiled(lambda x: (x.t()[1:], x.view(-1)))
    for _ in range(3):
        x = torch.randn(4, 6, device="cuda")
        a, b = f(x)
        assert torch.equal(a, x.t()[1:]) and torch.equal(b, x.view(-1))
    assert metrics.cuda_graphs_recorded == 0 and metrics.cuda_graph_refusals == 0
