"""Outputs that eager returns as views of one another, or of inputs, come back as views with
eager's relationship (lower/graph.py, Note: outputs that are views): a write through one output
shows in the others exactly where it does in eager. Copies that eager makes stay copies."""

import pytest
import torch

from tests.helpers import compile_fn, upcast


def base_and_slice(a):
    b = a * 2
    return b, b[1:]


def base_and_transpose(a):
    b = a + 1
    return b, b.t()


def base_and_reshape(a):
    b = a.sin()
    return b, b.view(-1), b.reshape(2, -1, 3)


def base_and_select(a):
    b = a * a
    return b, b[2], b.select(1, 3)


def view_before_its_base(a):
    b = a - 3
    return b[:, 1:4], b


def two_views_of_a_hidden_base(a):
    b = a * 3
    return b[1:], b[:2].t()


def views_of_views(a):
    b = a.exp()
    v = b.t()[1:]
    return v, v[:, 2], b


def view_of_an_input_and_of_a_result(a):
    return a[1:], a.t(), (a + 1)[::2]


def unfold_and_diagonal(a):
    b = a * 0.5
    return b, b.diagonal(), b.unfold(1, 2, 2)


def expanded_output(a):
    b = a.sum(0, keepdim=True)
    return b, b.expand(4, -1)


def pieces_of_splits(a):
    b = a + 2
    return (b, *b.split(4), *b.unbind(1)[:2], *b.chunk(2, 1), *a.split(3, 1))


def copy_of_a_result_is_no_view(a):
    b = a * 2
    return b, b[1:].clone(), b.t().contiguous()


CASES = [base_and_slice, base_and_transpose, base_and_reshape, base_and_select, view_before_its_base,
         two_views_of_a_hidden_base, views_of_views, view_of_an_input_and_of_a_result, unfold_and_diagonal,
         expanded_output, pieces_of_splits, copy_of_a_result_is_no_view]  # fmt: skip


def shares_memory(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def same_strides(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal strides where they matter (a dim of size 1 is never stepped along)."""
    return all(a == b or n == 1 for a, b, n in zip(x.stride(), y.stride(), x.shape))


def writable(t: torch.Tensor) -> bool:
    return 0 not in [s for s, n in zip(t.stride(), t.shape) if n > 1]  # (eager refuses overlapping writes)


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__)
def test_outputs_alias_as_in_eager(fn):
    a = torch.randn(6, 6)
    compiled = compile_fn(fn)
    a_got, a_want = a.clone(), a.clone()
    got, want = compiled(a_got), fn(a_want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w)
        if any(shares_memory(w, other) for other in (*want[:i], *want[i + 1 :], a_want)):  # a view: eager's strides
            assert same_strides(g, w), f"output {i}: strides {g.stride()}, eager {w.stride()}"
    for j in range(len(want)):  # write through each output in turn; every tensor sees what eager's sees
        a_got, a_want = a.clone(), a.clone()
        got, want = compiled(a_got), fn(a_want)
        if not writable(want[j]):
            continue
        got[j].add_(1000.0 + j)
        want[j].add_(1000.0 + j)
        for i, (g, w) in enumerate(zip((*got, a_got), (*want, a_want))):
            torch.testing.assert_close(g, w, msg=lambda m, i=i, j=j: f"tensor {i} after writing output {j}: {m}")
    got, want = compiled(a), fn(a)
    pairs = [(i, k) for i in range(len(want)) for k in range(i)]
    assert [shares_memory(got[i], got[k]) for i, k in pairs] == [shares_memory(want[i], want[k]) for i, k in pairs]


TRAINING_CASES = [base_and_slice, base_and_transpose, base_and_select, view_before_its_base,
                  two_views_of_a_hidden_base, views_of_views, pieces_of_splits]  # fmt: skip


@pytest.mark.parametrize("fn", TRAINING_CASES, ids=lambda f: f.__name__)
def test_output_views_under_training(fn):
    a = torch.randn(6, 6, requires_grad=True)
    got = compile_fn(fn)(a)
    a64 = upcast(a).requires_grad_()
    want = fn(a64)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
        assert same_strides(g, w)
    pairs = [(i, k) for i in range(len(want)) for k in range(i)]
    assert [shares_memory(got[i], got[k]) for i, k in pairs] == [shares_memory(want[i], want[k]) for i, k in pairs]
    weights = [torch.randn(w.shape, dtype=torch.float64) for w in want]
    (grad,) = torch.autograd.grad(sum((g.double() * c).sum() for g, c in zip(got, weights)), a)
    (expected,) = torch.autograd.grad(sum((w * c).sum() for w, c in zip(want, weights)), a64)
    torch.testing.assert_close(grad.double(), expected, rtol=1e-5, atol=1e-5)


def qkv_of_one_projection(x):
    """A transformer's q, k and v: pieces of one projection, heads split out and moved."""
    qkv = x * 2 + 1
    return tuple(t.view(x.shape[0], 2, 4).transpose(0, 1) for t in qkv.split(8, -1))


DYNAMIC_CASES = [base_and_slice, base_and_transpose, two_views_of_a_hidden_base, qkv_of_one_projection]


@pytest.mark.parametrize("fn", DYNAMIC_CASES, ids=lambda f: f.__name__)
def test_output_views_with_symbolic_sizes(fn):
    """Under dynamic=True the views are eager's too, from one symbolic graph (Note: outputs that
    are views): views of a computed buffer laid out as eager's base take eager's layout of each
    view. Before, any symbolic size copied every such view (q, k and v saved for a GPT-2 backward
    were three copies of the projection a layer)."""
    import ember

    torch._dynamo.reset()
    ember.metrics.reset()
    compiled = torch.compile(fn, backend="ember", dynamic=True)
    for rows in (6, 9, 13):
        a = torch.randn(rows, 24)
        got, want = compiled(a), fn(a)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
            assert same_strides(g, w), (g.stride(), w.stride())
        pairs = [(i, k) for i in range(len(want)) for k in range(i)]
        assert [shares_memory(got[i], got[k]) for i, k in pairs] == [shares_memory(want[i], want[k]) for i, k in pairs]
    assert ember.metrics.symbolic_graphs == 1 and not ember.metrics.symbolic_fallbacks
