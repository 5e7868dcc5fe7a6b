"""Wrapper memory planning: reuse, frees, the planned peak, and no use after free."""

import pytest
import torch

import ember
from ember.ir import Buffer, Layout
from ember.uop.dtypes import dtypes
from ember.wrapper import lines as L
from ember.wrapper.plan import live_bytes, nbytes, plan_memory


def compile_and_capture(model, x):
    """Compile with ember and return the planned wrapper of the (single) graph."""
    import os

    from ember import compile_graph

    os.environ["EMBER_GRAPH_CACHE"] = "0"  # generate the wrapper, even if an earlier test cached it
    captured = []
    original = compile_graph.generate_wrapper

    def spy(*args, **kwargs):
        captured.append(original(*args, **kwargs))
        return captured[-1]

    compile_graph.generate_wrapper = spy
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(model, backend="ember")(x)
    finally:
        compile_graph.generate_wrapper = original
        del os.environ["EMBER_GRAPH_CACHE"]
    return out, captured[-1]


def linear_gelu_chain():
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(64, 64), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def test_linear_gelu_chain_reuses_and_frees_every_intermediate():
    model, x = linear_gelu_chain(), torch.randn(32, 64)
    out, wrapper = compile_and_capture(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    lines = wrapper.lines
    assert sum(isinstance(line, L.Reuse) for line in lines) >= 6
    returned = set(lines[-1].values)
    allocated = {line.buffer.name for line in lines if isinstance(line, L.Allocate)}
    allocated |= {line.new.name for line in lines if isinstance(line, L.Reuse)}
    extern = {b.name for line in lines if isinstance(line, L.ExternCall) for b in line.outputs}
    released = {line.buffer.name for line in lines if isinstance(line, L.FreeIfNotReused)}
    released |= {line.old.name for line in lines if isinstance(line, L.Reuse)}
    assert (allocated | extern) - returned <= released


def test_planned_peak_matches_a_simulation_of_the_emitted_lines():
    _, wrapper = compile_and_capture(linear_gelu_chain(), torch.randn(32, 64))
    # brute force: sizes of live named tensors after each rendered statement
    live: dict[str, int] = {}
    peak = 0
    for line in wrapper.lines:
        if isinstance(line, L.Allocate):
            live[line.buffer.name] = nbytes(line.buffer)
        elif isinstance(line, L.ExternCall) and line.single:
            live[line.outputs[0].name] = nbytes(line.outputs[0])
        elif isinstance(line, L.Reuse):
            live[line.new.name] = live.pop(line.old.name)
        elif isinstance(line, L.FreeIfNotReused):
            live.pop(line.buffer.name)
        peak = max(peak, sum(live.values()))
    assert wrapper.peak_bytes == peak == max(live_bytes(wrapper.lines))


def test_no_buffer_is_used_after_it_is_freed_or_reused():
    _, wrapper = compile_and_capture(linear_gelu_chain(), torch.randn(32, 64))
    dead: set[str] = set()
    for line in wrapper.lines:
        text = line.render()
        for name in dead:
            assert f"{name}." not in text and f"{name}," not in text and f"({name})" not in text, (name, text)
        if isinstance(line, L.FreeIfNotReused):
            dead.add(line.buffer.name)
        elif isinstance(line, L.Reuse):
            dead.add(line.old.name)
            dead.discard(line.new.name)


def test_reuse_keeps_results_correct_across_calls():
    model, x = linear_gelu_chain(), torch.randn(32, 64)
    compiled = torch.compile(model, backend="ember")
    with torch.no_grad():
        first = compiled(x)
        second = compiled(x * 2)
        torch.testing.assert_close(first, model(x))
        torch.testing.assert_close(second, model(x * 2))
    assert ember.metrics.graphs_compiled == 1


def test_pointwise_kernel_writes_over_its_dying_input():
    # the addmm result dies in the GELU kernel, which reads it at the index it stores: in place
    model, x = linear_gelu_chain(), torch.randn(32, 64)
    out, wrapper = compile_and_capture(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    extern = {b.name for line in wrapper.lines if isinstance(line, L.ExternCall) for b in line.outputs}
    inplace = [line for line in wrapper.lines if isinstance(line, L.Reuse) and line.old.name in extern]
    assert len(inplace) == 8


@pytest.mark.parametrize(
    "f",
    [
        lambda a, b: (lambda y: (y + 1) * (y.t() - 1))(a @ b),  # read at a transposed index too
        lambda a, b: (lambda y: (y.relu(), y))(a @ b),  # returned: it lives on
    ],
)
def test_no_inplace_when_the_input_is_read_elsewhere_or_lives_on(f):
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    out, wrapper = compile_and_capture(lambda a: f(a, b), a)
    torch.testing.assert_close(out, f(a, b))
    extern = {b.name for line in wrapper.lines if isinstance(line, L.ExternCall) for b in line.outputs}
    assert extern and not [line for line in wrapper.lines if isinstance(line, L.Reuse) and line.old.name in extern]


def test_inplace_chain_of_kernels_matches_eager():
    def f(x):
        a = x.sin() * 2  # realized: read twice below by kernels that the scheduler keeps apart
        b = a.sum(1, keepdim=True)
        return (a.cos() + b).relu()

    x = torch.randn(64, 32)
    out, _ = compile_and_capture(f, x)
    torch.testing.assert_close(out, f(x))


def test_kernel_writes_over_a_dying_extern_result_read_through_a_reshape():
    # the mm result (32, 64) is read as (4, 8, 64): its index (b*8 + s)*64 + c is the store's
    # b*512 + s*64 + c, so the relu still runs in place
    w = torch.randn(48, 64)
    f = lambda x: (x.reshape(32, 48) @ w).reshape(4, 8, 64).relu()  # noqa: E731
    x = torch.randn(4, 8, 48)
    out, wrapper = compile_and_capture(f, x)
    torch.testing.assert_close(out, f(x))
    extern = {b.name for line in wrapper.lines if isinstance(line, L.ExternCall) for b in line.outputs}
    assert [line for line in wrapper.lines if isinstance(line, L.Reuse) and line.old.name in extern]


def test_transposed_bmm_operand_is_copied_column_major(monkeypatch):
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")  # the C++ wrapper's layout choice
    # k.transpose(-2, -1) must be copied for bmm (its heads dim does not merge with the batch
    # dim); the copy is stored with its last two dims column-major, so it reads k contiguously
    # (Note: transposed matmul operands)
    w = torch.randn(32, 96)

    def attention_scores(x):
        q, k, _ = (x @ w).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return torch.matmul(q, k.transpose(-2, -1)).softmax(-1)

    x = torch.randn(2, 16, 32)
    out, wrapper = compile_and_capture(attention_scores, x)
    torch.testing.assert_close(out, attention_scores(x))
    allocated = [line.buffer.layout for line in wrapper.lines if isinstance(line, L.Allocate)]
    assert any(layout.size == (8, 8, 16) and layout.stride == (128, 1, 8) for layout in allocated)


def _two_chains(x):
    # a large intermediate (reused between calls by nobody: it dies in the call) and a large output
    y = torch.sin(x) * 2
    return (y.sum(0) + y.mean(0), torch.cos(x) + 1)


@pytest.mark.parametrize("huge_pages", ["1", "0"])
def test_large_cpu_buffers_are_allocated_in_huge_pages(monkeypatch, huge_pages):
    # Note: huge pages for fresh buffers (runtime/memory.py): buffers of 4 MiB and more
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")
    monkeypatch.setenv("EMBER_HUGE_PAGES", huge_pages)
    x = torch.randn(2048, 1024)  # 8 MiB of float32
    out, wrapper = compile_and_capture(_two_chains, x)
    expected = _two_chains(x.double())
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-4)
    big = [line for line in wrapper.lines if isinstance(line, L.Allocate) and nbytes(line.buffer) >= 4 << 20]
    small = [line for line in wrapper.lines if isinstance(line, L.Allocate) and nbytes(line.buffer) < 4 << 20]
    assert big and small
    assert all(line.huge_pages == (huge_pages == "1") for line in big)
    assert not any(line.huge_pages for line in small)


def test_empty_huge_gives_a_usable_tensor_and_advises_only_whole_huge_pages():
    from ember.runtime import memory

    t = memory.empty_huge((3, 1 << 20), (1 << 20, 1), torch.float32)
    assert t.shape == (3, 1 << 20) and t.stride() == (1 << 20, 1) and t.dtype == torch.float32
    t.fill_(2.5)
    assert torch.equal(t, torch.full((3, 1 << 20), 2.5))
    assert memory.advise_huge_pages(torch.empty(1000)) is False  # smaller than one huge page
    assert memory.advise_huge_pages(torch.empty(1 << 22)) is memory.huge_pages_available()


def _buffer(name: str, floats: int, kind: str = "computed") -> Buffer:
    return Buffer(name, dtypes.float32, Layout.contiguous((floats,)), kind)


def test_a_dead_buffer_is_not_held_over_the_peak_of_dying_inputs():
    """Note: the peak with dying inputs (wrapper/plan.py). A backward's shape: a saved input of
    4000 bytes dies at its last use, after a 2000-byte gradient appears next to it, which is the
    call's peak (6000). A 64-byte temporary dead before that point could be handed to a later
    64-byte buffer, holding it over the peak: by the wrapper's own buffers (peak 4464 at the
    end) that looked free, but it raised the call's peak to 6064. It is freed instead."""
    saved, early, grad, late, last = (_buffer("saved", 1000, "input"), _buffer("early", 16), _buffer("grad", 500),
                                      _buffer("late", 16), _buffer("last", 600))  # fmt: skip
    lines = [
        L.AssertInput(saved),
        L.Allocate(early),
        L.KernelCall("k0", ["early", "saved"]),
        L.FreeIfNotReused(early),
        L.Allocate(grad),
        L.KernelCall("k1", ["grad", "saved"]),
        L.Del(["saved"]),
        L.Allocate(late),
        L.KernelCall("k2", ["late", "grad"]),
        L.Allocate(last),
        L.KernelCall("k3", ["last", "late"]),
        L.FreeIfNotReused(late),
        L.Return(["grad", "last"]),
    ]
    planned, peak = plan_memory(lines)
    assert not any(isinstance(line, L.Reuse) for line in planned)
    assert max(live_bytes(planned, inputs_die=True)) == 6000
    assert peak == max(live_bytes(planned)) == 2000 + 64 + 2400
