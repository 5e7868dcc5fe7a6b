"""Horizontal fusion (Note: horizontal fusion, schedule/horizontal.py): independent small elementwise
kernels launched as one, in C++ (one OpenMP region) and in Triton (program ids split among the
parts, run by Triton's interpreter on the CPU), and the kernels that must not be grouped."""

import copy
import os

import pytest
import torch
from torch.utils._pytree import tree_map

import ember
from tests.helpers import compile_fn, needs_triton, use_triton

BACKENDS = ["cpp", pytest.param("triton", marks=needs_triton)]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> str:
    if request.param == "triton":
        use_triton(monkeypatch)
    else:  # C++ kernels: CPU tensors, on a GPU machine too
        monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")
    return request.param


def device() -> str:
    """The test device use_triton chose: the CPU (C++, or Triton's interpreter) or a GPU."""
    return os.environ.get("EMBER_TEST_DEVICE", "cpu")


def run_compiled(fn, *inputs: torch.Tensor):
    """`fn` compiled by ember and called on the inputs moved to the test device; results on the CPU."""
    got = compile_fn(fn)(*(x.to(device()) for x in inputs))
    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, got)


class ManyShapes(torch.nn.Module):
    """Parameters of several shapes: 0-d, a row, a matrix stored transposed (non-contiguous), one
    of 40000 elements (a C++ loop large enough for threads; more than one Triton program), and
    an empty one."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.bias = torch.nn.Parameter(torch.randn(7))
        self.transposed = torch.nn.Parameter(torch.randn(5, 3).t())
        self.large = torch.nn.Parameter(torch.randn(200, 200))
        self.empty = torch.nn.Parameter(torch.randn(0, 4))


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def stepped(module: torch.nn.Module, optimizer: str, compiled: bool, dtype=torch.float32, steps: int = 3):
    """`module`'s parameters after an eager step and `steps` more, compiled or eager; fixed gradients."""
    module = copy.deepcopy(module).to(device(), dtype)
    params = list(module.parameters())
    torch.manual_seed(1)
    for p in params:  # drawn in float32 (randn draws other numbers in float64), laid out as the parameter
        p.grad = torch.empty_like(p).copy_(torch.randn(p.shape))
    opt = OPTIMIZERS[optimizer](params)
    opt.step()  # eagerly: the states exist before the compile
    step = torch.compile(opt.step, backend="ember") if compiled else opt.step
    for _ in range(steps):
        step()
    return params


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_optimizer_step_is_a_few_kernels(backend, optimizer):
    """Every parameter's update in one horizontal kernel (Triton: the step counts, which every program
    of an update would read and write, in a second), matching float64 eager after several steps."""
    torch.manual_seed(0)
    module = ManyShapes()
    assert not module.transposed.is_contiguous()
    torch._dynamo.reset()
    got = stepped(module, optimizer, compiled=True)
    metrics = ember.metrics
    want = stepped(module, optimizer, compiled=False, dtype=torch.float64)
    for g, w in zip(got, want):
        assert g.stride() == w.stride()
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)
    assert metrics.graphs_compiled == 1 and metrics.extern_calls == 0
    if backend == "triton" and optimizer == "adamw":  # the step counts in a kernel of their own (fusion.py)
        assert metrics.horizontal_groups == 2 and metrics.kernels_generated == 2
    elif optimizer == "adamw":  # the empty parameter's step count: a kernel of its own, run before the rest
        assert metrics.horizontal_groups == 1 and metrics.kernels_generated == 2
    else:
        assert metrics.horizontal_groups == 1 and metrics.kernels_generated == 1


def test_optimizer_kernels_from_many_to_one(monkeypatch):
    """With horizontal fusion off, one kernel per parameter; on, one kernel (C++)."""
    monkeypatch.setenv("EMBER_TEST_DEVICE", "cpu")
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(8 + i, 9 + i) for i in range(5)])
    counts = {}
    for enabled in ("0", "1"):
        monkeypatch.setenv("EMBER_HORIZONTAL_FUSION", enabled)
        torch._dynamo.reset()
        ember.metrics.reset()
        stepped(module, "adamw", compiled=True)
        counts[enabled] = ember.metrics.kernels_generated
    assert counts == {"0": 10, "1": 1}
    assert ember.metrics.horizontal_groups == 1 and ember.metrics.horizontal_kernels_saved == 9


def test_independent_outputs_share_a_kernel(backend):
    """Two elementwise results of different shapes (no vertical fusion) run as one kernel."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(33)
    got = run_compiled(lambda x, y: (x.sin() * 2, y.exp() + 1), x, y)
    torch.testing.assert_close(got[0], x.sin() * 2)
    torch.testing.assert_close(got[1], y.exp() + 1)
    assert ember.metrics.kernels_generated == 1 and ember.metrics.horizontal_groups == 1


def heavy(x: torch.Tensor) -> torch.Tensor:
    """More ops than lowering recomputes for a second reader: realized once, read by both."""
    for _ in range(20):
        x = (x * 1.01).sin()
    return x


def test_a_kernel_reading_another_is_not_grouped(backend):
    """b reads a transposed (iteration spaces differ: no vertical fusion): b depends on a and runs after it."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)

    def fn(x):
        a = heavy(x)
        return a, a.t() * 2

    got = run_compiled(fn, x)
    torch.testing.assert_close(got[1], heavy(x).t() * 2)
    assert ember.metrics.kernels_generated == 2 and ember.metrics.horizontal_groups == 0


def test_dependence_through_an_extern(backend):
    """c reads a through a matrix product: it may not join a's kernel. d, independent, joins c's
    (the kernel right before it), not a's: it allocates, and would move past the product."""
    torch.manual_seed(0)
    x, w, y = torch.randn(8, 8), torch.randn(8, 8), torch.randn(5)

    def fn(x, w, y):
        a = x.sin()
        c = (a @ w).cos()
        return a, c, y.exp()

    got = run_compiled(fn, x, w, y)
    for g, want in zip(got, fn(x.double(), w.double(), y.double())):
        torch.testing.assert_close(g.double(), want, rtol=1e-5, atol=1e-5)
    assert ember.metrics.horizontal_groups == 1
    assert ember.metrics.kernels_generated == 2 and ember.metrics.extern_calls == 1


def test_an_input_written_after_another_kernel_reads_it(backend):
    """out reads z at other elements; z is then written in place. The write waits for the read
    (a WeakDep), so the two kernels are not grouped, and out sees z's old contents."""
    torch.manual_seed(0)
    z = torch.randn(64)
    want_z, want_out = z * 3, z.flip(0) * 2

    def fn(z):
        out = z.flip(0) * 2
        z.mul_(3)
        return out

    z = z.to(device())
    with torch.no_grad():
        out = compile_fn(fn)(z)
    torch.testing.assert_close(out.cpu(), want_out)
    torch.testing.assert_close(z.cpu(), want_z)
    assert ember.metrics.horizontal_groups == 0 and ember.metrics.kernels_generated == 2


def test_large_kernels_launch_alone():
    """Kernels of a million elements or more gain nothing from sharing a launch (the size rule)."""
    x, y = torch.randn(1 << 20), torch.randn(1 << 20, 2)
    got = compile_fn(lambda x, y: (x + 1, y * 2))(x, y)
    torch.testing.assert_close(got[0], x + 1)
    assert ember.metrics.kernels_generated == 2 and ember.metrics.horizontal_groups == 0


def test_a_horizontal_kernel_holds_at_most_32_parts(backend):
    """40 independent results: two kernels, of 32 and 8 parts."""
    xs = [torch.randn(3 + i) for i in range(40)]
    got = run_compiled(lambda *xs: [x * (i + 1) for i, x in enumerate(xs)], *xs)
    for i, (g, x) in enumerate(zip(got, xs)):
        torch.testing.assert_close(g, x * (i + 1))
    assert ember.metrics.kernels_generated == 2 and ember.metrics.horizontal_groups == 2
    assert ember.metrics.horizontal_kernels_saved == 38


def test_parts_writing_over_inputs_they_alone_read(backend):
    """Each part may take over a dying input's storage (in-place kernels), never one another part reads."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(33)

    def fn(x, y):
        a, b = x + 1, y + 1  # dying intermediates
        return a.exp(), b.sin() + a[0, :1]

    got = run_compiled(fn, x, y)
    want = fn(x.double(), y.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)
