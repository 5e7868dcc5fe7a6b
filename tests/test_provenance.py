"""Provenance: `ember explain` (and fusion.txt) names, per step, the aten ops it computes and the
user's source lines they came from."""

import inspect

import torch

import ember


def softmax_of_gelu(x, w):
    h = torch.nn.functional.gelu(x @ w)
    return torch.softmax(h * 2, -1)


def test_each_step_names_its_aten_ops_and_source_lines():
    text = ember.explain(softmax_of_gelu, torch.randn(8, 16), torch.randn(16, 16))
    lines, first = inspect.getsourcelines(softmax_of_gelu)
    gelu_line, softmax_line = first + 1, first + 2
    steps = text.split("step ")[1:]
    extern = next(s for s in steps if "extern aten.mm" in s)
    assert f"{__file__}:{gelu_line}: h = torch.nn.functional.gelu(x @ w)" in extern
    kernels = [s for s in steps if ": kernel [" in s]
    assert kernels and all("    aten: " in s for s in kernels)
    ops = ", ".join(s.split("    aten: ")[1].split("\n")[0] for s in kernels)
    for op in ("gelu.default", "mul.Tensor", "amax.default", "exp.default", "div.Tensor"):
        assert op in ops
    assert any(f"{__file__}:{softmax_line}:" in s for s in kernels)


def test_backward_steps_name_the_forward_lines():
    x = torch.randn(6, 5, requires_grad=True)
    text = ember.explain(lambda a: torch.tanh(a * 3).sum().backward(), x)
    graphs = text.split("=== graph")[1:]
    assert len(graphs) == 2  # forward, backward
    assert "aten: " in graphs[1] and "from " in graphs[1]


def test_profiler_shows_each_kernel_and_extern_as_a_named_range():
    def f(x):
        return torch.sort(torch.softmax(x.sin() * 2, -1), -1)[0].sum(0)

    compiled = torch.compile(f, backend="ember")
    x = torch.randn(16, 32)
    ember.metrics.reset()
    compiled(x)  # compiles, unprofiled
    kernels, externs = ember.metrics.kernels_generated, ember.metrics.extern_calls
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.testing.assert_close(compiled(x), f(x))
    names = [e.name for e in prof.events() if e.name.startswith("ember ")]
    assert len(names) == kernels + externs
    assert "ember fallback sort.default" in names
    kernel_ranges = [n for n in names if n.startswith("ember kernel_")]
    assert any("sin" in n and "exp" in n for n in kernel_ranges), kernel_ranges
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(x)  # the profiled variant, compiled once, runs again
    assert len([e for e in prof.events() if e.name.startswith("ember ")]) == kernels + externs
