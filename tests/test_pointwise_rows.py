"""Pointwise Triton kernels planned in rows (Note: pointwise kernels in rows, codegen/blocks.py):
the outer loops on x, the innermost on r, under Triton's interpreter with the threshold lowered so
small shapes take the plan (persistent rows up to 64 columns there, looped past that), against
float64 eager; ember.metrics.row_kernels counts the kernels so planned."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import check, data, needs_triton, test_device, use_triton

pytestmark = needs_triton


@pytest.fixture(autouse=True)
def _rows_at_small_sizes(monkeypatch):
    use_triton(monkeypatch)
    monkeypatch.setenv("EMBER_POINTWISE_ROWS", "8")
    monkeypatch.setenv("EMBER_GRAPH_CACHE", "0")  # count what this compile decides


def _row_column_add(x, row, column):
    return x * row[..., None] + column


# (shape, planned in rows): columns and rows at least 8, the columns not a power of two
SHAPES = [
    ((9, 37), True),  # persistent under the interpreter
    ((12, 100), True),  # looped
    ((3, 4, 37), True),  # two outer loops flattened into the rows
    ((37, 16), False),  # a power of two: its division is a shift
    ((1, 37), False),  # too few rows
    ((0, 37), False),  # empty
    ((9, 5), False),  # short rows
]


@pytest.mark.parametrize(("shape", "in_rows"), SHAPES, ids=[str(s) for s, _ in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_broadcast_reads_in_rows(shape, in_rows, dtype):
    x, row, column = data(shape, dtype), data(shape[:-1], dtype, seed=1), data(shape[-1:], dtype, seed=2)
    x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)[: x.numel()]
    # bfloat16: the product (up to 16) rounds before the add, as eager's does: half an ulp is 1/16
    tolerance = {"rtol": 1e-2, "atol": 0.07} if dtype is torch.bfloat16 else {}
    check(_row_column_add, x, row, column, **tolerance)
    assert ember.metrics.row_kernels == int(in_rows)
    assert ember.metrics.kernels_generated == (1 if x.numel() else 0)


def test_a_contiguous_pointwise_kernel_stays_flat():
    """Every read varies with every loop: the flat index needs no division, nothing to gain."""
    check(lambda a, b: a * 2 + b.sin(), data((12, 100)), data((12, 100), seed=1))
    assert ember.metrics.row_kernels == 0


def test_strided_and_transposed_reads_in_rows():
    x = data((100, 12)).t()  # transposed: a column's elements 12 apart
    row = data((24,), seed=1)[::2]  # strided
    check(lambda x, r: (x + r[:, None]).exp(), x, row)
    assert ember.metrics.row_kernels == 1


def test_kernel_errors_in_rows():
    """A gather per row still reports a bad index, through the row's lanes."""
    x, index = data((10, 37)), torch.arange(10) % 37
    check(lambda x, i: x - x.gather(1, i[:, None]), x, index)
    assert ember.metrics.row_kernels == 1
    with pytest.raises(RuntimeError):
        ember_fn = torch.compile(lambda x, i: x - x.gather(1, i[:, None]), backend="ember", dynamic=False)
        ember_fn(x.to(test_device()), torch.full((10,), 40).to(test_device()))


@pytest.mark.parametrize("shape", [(9, 37), (12, 100), (16, 9)], ids=str)
def test_cross_entropy_gradient_in_rows(shape):
    """The language-model loss's backward (Note: a one-hot sum is a select): one kernel, in rows."""
    rows, classes = shape
    x = data(shape, seed=3).to(test_device()).requires_grad_()
    t = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(4))
    t[1] = -100
    loss = torch.compile(F.cross_entropy, backend="ember", dynamic=False)(x, t.to(test_device()))
    ember.metrics.reset()
    loss.backward()
    exact = x.detach().cpu().double().requires_grad_()
    F.cross_entropy(exact, t).backward()
    torch.testing.assert_close(x.grad.cpu().double(), exact.grad, rtol=1e-5, atol=1e-6)
    assert ember.metrics.kernels_generated == 1 and ember.metrics.row_kernels == 1


def test_causal_lm_training_step_in_rows():
    """A LLaMA-style causal LM's loss (shifted labels, ignore_index) through training: the logits'
    gradient is planned in rows, and every parameter's gradient matches float64 eager."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    reference = copy.deepcopy(model).double()
    ids = torch.randint(0, 100, (2, 12))
    labels = ids.clone()
    labels[0, 3] = -100
    device = test_device()
    loss = torch.compile(model.to(device), backend="ember")(ids.to(device), labels=labels.to(device)).loss
    loss.backward()
    want = reference(ids, labels=labels).loss
    want.backward()
    torch.testing.assert_close(loss.detach().cpu().double(), want.detach().double(), rtol=1e-5, atol=1e-5)
    for (name, got), expected in zip(model.named_parameters(), reference.parameters()):
        scale = expected.grad.abs().max().item()
        torch.testing.assert_close(got.grad.cpu().double(), expected.grad, rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
    assert ember.metrics.row_kernels >= 1 and ember.metrics.graphs_failed == 0
