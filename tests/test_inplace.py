"""Kernels that write their output over a buffer dying with them (Note: in-place kernels,
codegen/kernel.py): over a backward's donated saved tensors (Note: donated inputs,
ember/donation.py), in kernels with reductions whose reads of the victim stay in the stored row,
on the C++ path and on Triton's (through its interpreter); the rule's refusals on hand-built
kernel ASTs; Triton's tuning of an in-place kernel on a copy; the peak memory it saves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.codegen.kernel import choose_inplace
from ember.ir import Buffer, Layout
from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, RangeKind, UOp
from tests.helpers import INTERPRETED, compile_fn, cpu_kernels_only, needs_triton, test_device, use_triton

# ---- the rule, on hand-built kernel ASTs ---------------------------------------------------

ROWS, COLS = 4, 8


def _buffer(name: str, size=(ROWS, COLS), stride=(COLS, 1), kind: str = "computed") -> Buffer:
    return Buffer(name, dtypes.float32, Layout(size, stride, 0), kind)


def _load(buffer: Buffer, index: UOp) -> UOp:
    return UOp(Ops.LOAD, buffer.dtype, (UOp(Ops.INDEX, buffer.dtype, (buffer.uop(), index)),))


def _sum(value: UOp, *ranges: UOp) -> UOp:
    return UOp(Ops.REDUCE, value.dtype, (value, *ranges), Ops.ADD)


def _kernel(out: Buffer, value: UOp, n: UOp, v: UOp) -> UOp:
    store = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, out.dtype, (out.uop(), n * COLS + v)), value))
    return UOp(Ops.SINK, dtypes.void, (store,))


def _ranges() -> tuple[UOp, UOp, UOp]:
    return UOp.range(ROWS, 0), UOp.range(COLS, 1), UOp.range(COLS, 2, RangeKind.REDUCE)


def _choose(value_of, victim: Buffer | None = None) -> dict[str, str]:
    """choose_inplace on out[n, v] = value_of(x, n, v, r) with x dying."""
    x, out = victim or _buffer("x"), _buffer("out")
    n, v, r = _ranges()
    return choose_inplace(_kernel(out, value_of(x, n, v, r), n, v), {"out": out}, {x.name: x})


def test_a_row_reduction_writes_over_the_rows_it_reads():
    # softmax's backward: out[n, v] = x[n, v] * (1 - sum_r x[n, r]): row n is read whole, then stored
    def value_of(x, n, v, r):
        return _load(x, n * COLS + v) * (-_sum(_load(x, n * COLS + r), r) + 1.0)

    assert _choose(value_of) == {"out": "x"}


@pytest.mark.parametrize(
    "value_of, why",
    [
        # the row's sum weighted by x[n, v]: recomputed per element, after earlier elements' stores
        (lambda x, n, v, r: _sum(_load(x, n * COLS + r) * _load(x, n * COLS + v), r),
         "a reduction varies with the row's element loops"),
        # a flipped read: another element of the row, outside any reduction
        (lambda x, n, v, r: _load(x, n * COLS + v * -1 + (COLS - 1)), "reads other elements than it stores"),
        # a row read at a shifted position: no element loop stands for r
        (lambda x, n, v, r: _sum(_load(x, n * COLS + r), r) + _load(x, ((n + 1) % ROWS) * COLS + v),
         "reads other elements than it stores"),
    ],
)  # fmt: skip
def test_reads_of_elements_stored_before_them_are_refused(value_of, why):
    ember.metrics.reset()
    assert _choose(value_of) == {}
    assert ember.metrics.inplace_refusals[why] == 1


def test_a_row_loop_inside_the_element_loop_is_refused():
    # out[n, v] = x[n, v] - sum_r x[r, v] with the loops v outside n: the column's sum varies with
    # v only, so row loop v nests outside element loop n; as numbered here (n outer) it would not
    x, out = _buffer("x"), _buffer("out")
    v, n, r = UOp.range(COLS, 0), UOp.range(ROWS, 1), UOp.range(ROWS, 2, RangeKind.REDUCE)
    ember.metrics.reset()
    chosen = choose_inplace(_kernel(out, _load(x, n * COLS + v) - _sum(_load(x, r * COLS + v), r), n, v),
                            {"out": out}, {"x": x})  # fmt: skip
    assert chosen == {"out": "x"}  # rows (v) outer: each column read whole before its elements are stored
    n, v = UOp.range(ROWS, 0), UOp.range(COLS, 1)
    chosen = choose_inplace(_kernel(out, _load(x, n * COLS + v) - _sum(_load(x, r * COLS + v), r), n, v),
                            {"out": out}, {"x": x})  # fmt: skip
    assert chosen == {}
    assert ember.metrics.inplace_refusals["a row loop runs inside an element loop"] == 1


def test_nested_reductions_are_refused():
    # out[n, v] = x[n, v] + sum over rows of each row's sum: a program walks the rows in pieces
    def value_of(x, n, v, r):
        row = UOp.range(ROWS, 3, RangeKind.REDUCE)
        return _load(x, n * COLS + v) + _sum(_sum(_load(x, row * COLS + r), r), row)

    ember.metrics.reset()
    assert _choose(value_of) == {}
    assert ember.metrics.inplace_refusals["a nested reduction reads its rows"] == 1


@pytest.mark.parametrize(
    "victim",
    [
        _buffer("x", stride=(1, ROWS), kind="input"),  # the same elements, transposed: not the output's strides
        _buffer("x", stride=(2 * COLS, 1), kind="input"),  # every other row of a larger storage
        _buffer("x", size=(ROWS, 1), stride=(1, 1), kind="input"),  # broadcast along the row
        _buffer("x", size=(ROWS, 1), stride=(1, 1)),
    ],
)
def test_victims_of_other_layouts_are_never_written_over(victim):
    def value_of(x, n, v, r):
        across = v * x.layout.stride[1] if x.layout.size[1] > 1 else UOp.const(dtypes.index, 0)
        index = n * x.layout.stride[0] + across
        return _load(x, index) * 2.0

    assert _choose(value_of, victim) == {}


def test_a_donated_input_of_the_output_layout_is_written_over():
    assert _choose(lambda x, n, v, r: _load(x, n * COLS + v) * 2.0, _buffer("x", kind="input")) == {"out": "x"}


# ---- training graphs: gradients over donated saved tensors -----------------------------------


def _backends(monkeypatch, backend: str) -> None:
    if backend == "triton":
        use_triton(monkeypatch)
    monkeypatch.setenv("EMBER_GRAPH_CACHE", "0")  # count what this compile decides


BACKENDS = [pytest.param("cpp", marks=cpu_kernels_only), pytest.param("triton", marks=needs_triton)]


def _gradients(f, inputs: list[torch.Tensor], *rest) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gradients of `f` compiled by ember (on the test device) and of eager on float64."""
    ours = [x.detach().to(test_device()).requires_grad_() for x in inputs]
    compile_fn(f)(*ours, *(r.to(test_device()) for r in rest)).backward()
    precise = [x.detach().double().requires_grad_() for x in inputs]
    f(*precise, *rest).backward()
    return [x.grad.cpu() for x in ours], [x.grad for x in precise]


def _assert_close(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_gradient_is_written_over_the_saved_logits(monkeypatch, backend):
    _backends(monkeypatch, backend)
    torch.manual_seed(0)
    x, w, target = torch.randn(64, 32), torch.randn(32, 1000) / 4, torch.randint(0, 1000, (64,))
    ember.metrics.reset()
    got, expected = _gradients(lambda x, w, t: F.cross_entropy(x @ w, t), [x, w], target)
    _assert_close(got, expected)
    assert ember.metrics.donated_inputs_overwritten == 1  # the logits, by the kernel of their gradient
    assert ember.metrics.inplace_writes >= 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(16, 300), (3, 2100)])
def test_softmax_gradient_is_written_over_the_saved_probabilities(monkeypatch, backend, shape):
    # softmax's backward reads the saved probabilities y in a row sum, sum_r g*y, and at the
    # element it stores: a reduction kernel writing over a row it read whole
    _backends(monkeypatch, backend)
    torch.manual_seed(0)
    x, w, weights = torch.randn(shape[0], 24), torch.randn(24, shape[1]), torch.randn(shape)
    ember.metrics.reset()
    got, expected = _gradients(lambda x, w, t: (torch.softmax(x @ w, -1) * t).sum(), [x, w], weights)
    _assert_close(got, expected)
    assert ember.metrics.donated_inputs_overwritten == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_softmax_over_columns_gradient_matches_eager(monkeypatch, backend):
    # the saved probabilities are read down columns while the gradient is stored row by row: a
    # column's sum would be taken after earlier rows were stored over it, so no kernel may write
    # over them where it reads them so (the kernel AST tests above: a row loop inside an element loop)
    _backends(monkeypatch, backend)
    torch.manual_seed(0)
    x, w, weights = torch.randn(40, 24), torch.randn(24, 30), torch.randn(40, 30)
    got, expected = _gradients(lambda x, w, t: (torch.softmax(x @ w, 0) * t).sum(), [x, w], weights)
    _assert_close(got, expected)


@cpu_kernels_only
def test_a_saved_tensor_a_forward_output_shares_is_never_donated(monkeypatch):
    # y is returned to the user too: AOTAutograd donates it not, so its gradient is a buffer of its own
    _backends(monkeypatch, "cpp")
    torch.manual_seed(0)
    x, w = torch.randn(16, 8), torch.randn(8, 40)

    def f(x, w):
        y = torch.softmax(x @ w, -1)
        return (y * y).sum(), y

    ours = [t.clone().requires_grad_() for t in (x, w)]
    loss, y = compile_fn(f)(*ours)
    kept = y.detach().clone()
    ember.metrics.reset()
    loss.backward()
    assert torch.equal(y.detach(), kept)
    assert ember.metrics.donated_inputs_overwritten == 0


@cpu_kernels_only
def test_without_torch_donations_nothing_is_donated(monkeypatch):
    monkeypatch.setenv("EMBER_GRAPH_CACHE", "0")
    torch.manual_seed(0)
    x, w, target = torch.randn(8, 16), torch.randn(16, 50), torch.randint(0, 50, (8,))
    ember.metrics.reset()
    with torch._functorch.config.patch(donated_buffer=False):
        got, expected = _gradients(lambda x, w, t: F.cross_entropy(x @ w, t), [x, w], target)
    _assert_close(got, expected)
    assert ember.metrics.donated_inputs_overwritten == 0


# ---- Triton's tuning runs an in-place kernel on a copy ------------------------------------


@needs_triton
@pytest.mark.skipif(not INTERPRETED, reason="forces tuning through the interpreter")
def test_tuning_an_in_place_kernel_leaves_its_input_for_the_real_call(monkeypatch):
    """The first call times several launch configurations, each launch a full run of the kernel;
    one writing over its input would feed every later launch (and the real call) what an earlier
    one wrote. Tuning is forced on here, each trial a real interpreted launch."""
    from ember.runtime import triton as triton_runtime

    trials = []

    def choose(self, args):
        options = triton_runtime.candidates(self.variants, self.xextent, self.rnumel, False)[:3]
        return options[0] if len(options) == 1 else self.benchmark(options, args, ("cpu", 0, 0))

    def trial(self, config, args, target):
        trials.append(config)
        return lambda: self.launch(config, args)

    def do_bench(fn, warmup, rep, return_mode):
        for _ in range(3):
            fn()
        return float(len(trials))  # the first candidate wins

    import triton.testing

    monkeypatch.setattr(triton_runtime.TritonLauncher, "choose", choose)
    monkeypatch.setattr(triton_runtime.TritonLauncher, "trial", trial)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    _backends(monkeypatch, "triton")
    torch.manual_seed(0)
    x, w, target = torch.randn(64, 32), torch.randn(32, 1000) / 4, torch.randint(0, 1000, (64,))
    ember.metrics.reset()
    got, expected = _gradients(lambda x, w, t: F.cross_entropy(x @ w, t), [x, w], target)
    _assert_close(got, expected)
    assert ember.metrics.donated_inputs_overwritten == 1
    assert ember.metrics.triton_kernels_tuned >= 1 and len(trials) >= 2


@pytest.mark.parametrize("metadata", [None, object(), type("Meta", (), {"bw_donated_idxs": None})()])
def test_a_torch_without_donation_metadata_donates_nothing(monkeypatch, metadata):
    from ember.donation import DONATED_INPUTS, donated_positions, mark_donated_inputs

    context = type("Context", (), {"fw_metadata": metadata})() if metadata is not None else None
    monkeypatch.setattr(torch._guards.TracingContext, "try_get", staticmethod(lambda: context))
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    mark_donated_inputs(gm, [torch.ones(3)])
    assert donated_positions() == [] and DONATED_INPUTS not in gm.meta


def test_two_donated_inputs_on_one_storage_are_not_donated(monkeypatch):
    from ember.donation import DONATED_INPUTS, mark_donated_inputs

    metadata = type("Meta", (), {"bw_donated_idxs": [0, 1, 2]})()
    context = type("Context", (), {"fw_metadata": metadata})()
    monkeypatch.setattr(torch._guards.TracingContext, "try_get", staticmethod(lambda: context))
    gm = torch.fx.symbolic_trace(lambda a, b, c: a + b.sum() + c)
    base = torch.ones(4, 4)
    mark_donated_inputs(gm, [base, base[0], torch.ones(4)])  # a and b share a storage
    assert gm.meta[DONATED_INPUTS] == ("c",)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_language_model_loss_gradient_is_written_over_saved_logits_of_another_shape(monkeypatch, backend):
    # as a causal LM under bf16 autocast: the logits are saved as the matmul's (tokens, vocab) bf16
    # result, and the gradient of their float upcast is made in the model's (batch, sequence,
    # vocab) shape: the same elements in the same order, so it is written over them
    _backends(monkeypatch, backend)
    torch.manual_seed(0)
    hidden, w = torch.randn(2, 24, 16).bfloat16(), (torch.randn(16, 300) / 4).bfloat16()
    target = torch.randint(0, 300, (2, 24))
    target[0, 3] = -100  # ignored

    def loss(h, w, t):
        logits = (h.reshape(-1, 16) @ w).view(2, 24, 300)
        return F.cross_entropy(logits.float().view(-1, 300), t.view(-1))

    ember.metrics.reset()
    got, expected = _gradients(loss, [hidden, w], target)
    for g, e in zip(got, expected):  # (bf16 logits and gradients)
        torch.testing.assert_close(g.double(), e, rtol=2e-2, atol=2e-3)
    assert ember.metrics.donated_inputs_overwritten == 1
