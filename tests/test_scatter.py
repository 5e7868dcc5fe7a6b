"""Stores at computed positions (ember/lower/scatter.py) against eager, through `check`.

Ops with the same inputs compile together as one graph returning a tuple. Inputs come
contiguous and transposed (non-contiguous self, src and index), in float32, int64 and bool
where eager takes them; index tensors hold duplicates where the op accumulates (never where
it overwrites: eager's result is unspecified then) and negative values where eager wraps
them. Every test asserts that nothing went to the aten fallback.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import check, check_lowered, compile_fn, data, indices, to_test_device, transposed

f32, f64, i32, i64, b8 = torch.float32, torch.float64, torch.int32, torch.int64, torch.bool


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- scatter, scatter_add, scatter_reduce --------------------------------------------------------

# x (4, 5) self; d (3, 5) distinct rows per column; u (5, 3) index with duplicates; s (4, 5) src
SCATTER: dict[str, Callable] = {
    "scatter_src": lambda x, d, u, s: x.scatter(0, d, s),
    "scatter_value": lambda x, d, u, s: x.scatter(0, d, 2),
    "scatter_dim1_negative_dim": lambda x, d, u, s: x.scatter(-1, d.t()[:3, :3] % 5, s),
    "scatter_add_dim0": lambda x, d, u, s: x.scatter_add(0, u.t()[:, :4] % 4, s),
    "scatter_add_dim1": lambda x, d, u, s: x.scatter_add(1, u[:4], s),
    "scatter_add_index_smaller_than_src": lambda x, d, u, s: x.scatter_add(1, u[:2, :2], s),
    "scatter_reduce_add_deprecated": lambda x, d, u, s: x.scatter(1, u[:4], s, reduce="add"),
    "scatter_multiply_value_deprecated": lambda x, d, u, s: x.scatter(1, u[:4], 2, reduce="multiply"),
    "scatter_int32_index": lambda x, d, u, s: x.scatter(0, d.to(i32), s),
}
for _reduce in ("sum", "prod", "mean", "amax", "amin"):
    for _include in (True, False):
        SCATTER[f"scatter_reduce_{_reduce}_{_include}"] = lambda x, d, u, s, r=_reduce, inc=_include: x.scatter_reduce(
            1, u[:4], s, r, include_self=inc
        )


def scatter_inputs(dtype: torch.dtype, layout: str) -> tuple[torch.Tensor, ...]:
    make = transposed if layout == "transposed" else data
    distinct = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(c))[:3] for c in range(5)], 1)
    dup = indices([[0, 4, 4], [1, 1, 0], [3, 3, 3], [4, 0, 2], [2, 2, 2]])
    if layout == "transposed":
        distinct, dup = distinct.t().contiguous().t(), dup.t().contiguous().t()
    return make((4, 5), dtype), distinct, dup, make((4, 5), dtype, 1)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", [f32, i64], ids=dtype_id)
def test_scatter_scatter_add_scatter_reduce(dtype, layout):
    x, d, u, s = scatter_inputs(dtype, layout)
    assert layout == "contiguous" or not (x.is_contiguous() or d.is_contiguous() or s.is_contiguous())
    check_lowered(SCATTER, x, d, u, s)
    assert ember.metrics.graphs_compiled == 1


def test_accumulating_an_expanded_source_adds_every_repeat():
    # index and source broadcast along dim 0 (stride 0): neither position nor value varies with
    # that loop, yet each of its iterations adds again (the loop was dropped: 1 add, not 5)
    x = data((5, 5), f32)
    index = indices([[4, 3, 4, 4, 3]]).expand(5, 5)
    source = data((1, 5), f32, 1).expand(5, 5)
    rows = indices([1]).expand(6)
    ops = {
        "scatter_add": lambda x, i, s, r: x.scatter_add(0, i, s),
        "scatter_reduce_prod": lambda x, i, s, r: x.scatter_reduce(0, i, s, "prod"),
        "index_put_accumulate": lambda x, i, s, r: x.index_put((r,), s[:1].expand(6, 5), accumulate=True),
        "index_add": lambda x, i, s, r: x.index_add(0, r, s[:1].expand(6, 5)),
    }
    check_lowered(ops, x, index, source, rows)


def test_scatter_bool():
    ops = {k: SCATTER[k] for k in ("scatter_src", "scatter_add_dim1", "scatter_reduce_amax_False")}
    ops["scatter_value"] = lambda x, d, u, s: x.scatter(0, d, True)
    x, d, u, s = scatter_inputs(b8, "contiguous")
    check_lowered(ops, x, d, u, s)


def test_scatter_nan_and_infinities():
    x, d, u, s = scatter_inputs(f32, "contiguous")
    s[0, 1], s[2, 3], x[1, 0], s[3, 0] = float("nan"), float("inf"), float("-inf"), float("nan")
    ops = {k: SCATTER[k] for k in SCATTER if "amax" in k or "amin" in k or "sum" in k or "scatter_add" in k}
    check_lowered(ops, x, d, u, s)


def test_scatter_0d_and_empty():
    ops = {
        "scatter_0d": lambda x, i, e, s: x.scatter(0, i, s),
        "scatter_add_0d": lambda x, i, e, s: x.scatter_add(0, i, s),
        "scatter_empty_index": lambda x, i, e, s: s.new_ones(3, 4).scatter_add(1, e, s.expand(3, 0)),
        "scatter_reduce_empty_index": lambda x, i, e, s: s.new_ones(3, 4).scatter_reduce(1, e, s.expand(3, 0), "amax"),
    }
    check_lowered(ops, data(()), indices(0), torch.zeros(3, 0, dtype=i64), data((), seed=1))


def test_scatter_with_duplicates_stores_one_of_the_values():
    """Overwriting with repeated positions: eager's result is unspecified (and differs between
    CPU and CUDA); ember's must be one of the values written there (a store never tears or mixes)."""
    x, i, s = torch.zeros(3, 4), indices([[0, 0, 1, 1], [0, 2, 1, 2]]), data((2, 4), seed=2)
    got = compile_fn(lambda x, i, s: x.scatter(0, i, s))(*map(to_test_device, (x, i, s))).cpu()
    for col in range(4):
        for row in range(3):
            writers = [s[k, col] for k in range(2) if i[k, col] == row]
            assert got[row, col] in writers if writers else got[row, col] == 0
    flat, values = indices([0, 5, 0, 3, -1, 3, 3]), data((7,), seed=3)
    for fn in (lambda x, i, v: x.put(i, v), lambda x, i, v: x.index_put((i,), v)):
        got = compile_fn(fn)(*map(to_test_device, (torch.zeros(6), flat, values))).cpu()
        for position in range(6):
            writers = [values[k] for k in range(7) if flat[k] % 6 == position]
            assert got[position] in writers if writers else got[position] == 0
    assert ember.metrics.fallback_calls == 0


def test_parallel_accumulation_is_race_free():
    """Many threads adding into few elements: integer sums must be exact (atomic stores)."""
    n = 1 << 18
    src = torch.arange(n, dtype=i64).reshape(n // 8, 8)
    index = (torch.arange(n, dtype=i64) % 7).reshape(n // 8, 8)
    ops = {
        "sum": lambda x, i, s: x.scatter_add(0, i, s),
        "amax": lambda x, i, s: x.scatter_reduce(0, i, s, "amax"),
        "index_put": lambda x, i, s: x.index_put((i[:, 0],), s, accumulate=True),
    }
    check_lowered(ops, torch.zeros(7, 8, dtype=i64), index, src)


@pytest.mark.parametrize("dtype", [i64, f32], ids=dtype_id)
def test_owner_dim_accumulation_is_race_free(dtype):
    """Scatters along dim 0 of a wide source: the feature dim is the owner (threads split it,
    no atomics); sums must be exact for integers and one-thread-per-element for floats."""
    rows = 4096
    src = data((rows, 64), dtype, 3)
    index = torch.arange(rows * 64, dtype=i64).reshape(rows, 64) % 7
    ops = {
        "scatter_add": lambda x, i, s: x.scatter_add(0, i, s),
        "scatter_reduce_prod": lambda x, i, s: x.scatter_reduce(0, i[:64], s[:64] * 0 + 1.5 if s.is_floating_point()
                                                                 else s[:64], "prod", include_self=False),
        "scatter_reduce_mean": lambda x, i, s: x.scatter_reduce(0, i, s, "mean"),
        "scatter_amin": lambda x, i, s: x.scatter_reduce(0, i, s, "amin"),
        "index_put": lambda x, i, s: x.index_put((i[:, 0],), s, accumulate=True),
        "index_add_dim1": lambda x, i, s: x.t().index_add(1, i[:, 0], s.t()).t(),
    }  # fmt: skip
    check_lowered(ops, torch.zeros(7, 64, dtype=dtype), index, src, rtol=1e-5, atol=1e-3)


def test_scatter_kernels_and_readers_of_the_result():
    """A copy kernel, then the store kernel; readers of the result (even ones that also read
    self, which could fuse with the copy) see it after the stores."""
    fn = lambda x, i, s: (x.scatter_add(0, i, s) * 2 + x, x.sum())  # noqa: E731
    x, _, u, s = scatter_inputs(f32, "contiguous")
    check_lowered({"fn": fn}, x, u.t()[:, :4] % 4, s)


# ---- contention, race freedom, errors in atomic stores ------------------------------------------

CONTENDED = {
    "sum": lambda x, i, s: x.scatter_reduce(0, i, s, "sum"),
    "prod": lambda x, i, s: x.scatter_reduce(0, i, s, "prod"),
    "amax": lambda x, i, s: x.scatter_reduce(0, i, s, "amax", include_self=False),
    "amin": lambda x, i, s: x.scatter_reduce(0, i, s, "amin"),
    "mean": lambda x, i, s: x.scatter_reduce(0, i, s, "mean"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8,
                                   torch.uint8, torch.bool], ids=str)  # fmt: skip
def test_contended_stores_combine_every_value(dtype):
    """3000 values (300 of 8 or 16 bits: the interpreter serializes their word's swaps) into 5
    elements: every lane of a block meets many others at its element (atomics, compare-and-swap
    loops on the element or on the 32-bit word holding it). Float values are powers of two, so
    sums and products are exact in any order."""
    n = 3000 if dtype.itemsize >= 4 else 300
    index = torch.arange(n) * 7 % 5
    if dtype.is_floating_point:
        src = torch.tensor([1.0, -1.0, 2.0, 0.5, -2.0, 0.25])[torch.arange(n) * 5 % 6].to(dtype)
        src[17] = float("nan")  # element 2 (17 * 7 % 5): NaN propagates through max, min, sum, prod
    else:
        src = data((n,), torch.int64, seed=4, int_bound=3).to(dtype)  # uint8: wrapped negatives
    ops = dict(CONTENDED) if dtype is not torch.bool else {k: CONTENDED[k] for k in ("sum", "prod", "amax", "amin")}
    check_lowered(ops, data((5,), torch.int64, seed=5, int_bound=2).to(dtype), index, src)


def test_owner_dim_stores_are_atomic_across_a_block():
    """index_put with accumulate over (tokens, features): the feature dim is an owner dim (the
    C++ renderer's stores are plain there), but one Triton block holds many tokens of a
    feature, so the stores there must still be atomic: integer sums exact."""
    tokens = torch.arange(512) % 3
    grad = data((512, 32), torch.int64, seed=6, int_bound=1000)
    check_lowered({"index_put": lambda x, i, g: x.index_put((i,), g, accumulate=True)},
                  torch.zeros(3, 32, dtype=torch.int64), tokens, grad)  # fmt: skip


@pytest.mark.parametrize("reduce", ["prod", "amax", "sum"])
def test_out_of_range_in_an_atomic_store_raises_and_flag_resets(reduce):
    fn = compile_fn(lambda x, i, s: x.scatter_reduce(0, i, s, reduce))
    x, s = data((4,), seed=7), data((300,), seed=8)
    bad = torch.arange(300) % 4
    bad[250] = 4
    with pytest.raises(RuntimeError):
        fn(*map(to_test_device, (x, bad, s)))
    good = torch.arange(300) % 4
    got = fn(*map(to_test_device, (x, good, s))).cpu()
    torch.testing.assert_close(got, x.scatter_reduce(0, good, s, reduce), rtol=1e-5, atol=1e-5)
    assert ember.metrics.fallback_calls == 0


# ---- index_put and the ops that arrive as it ------------------------------------------------------


def index_assign(x, i, g, v):
    x = x.clone()
    x[i] = v[0]
    return x


def column_assign(x, i, g, v):
    x = x.clone()
    x[:, i % 4] = v.t()[:4]  # distinct columns: with repeats the winner is unspecified (on CUDA)
    return x


def mask_assign(x, i, g, v):
    x = x.clone()
    x[x > 0] = v[0, 0]
    return x


def mask_accumulate(x, i, g, v):
    return x.index_put((x[:, 0] > 0,), v[0], accumulate=True)


# x (4, 5); i (3,) distinct with a negative; g (4, 2); v (3, 5)
INDEX_PUT: dict[str, Callable] = {
    "index_put": lambda x, i, g, v: x.index_put((i,), v),
    "index_put_broadcast_value": lambda x, i, g, v: x.index_put((i,), v[0]),
    "index_put_accumulate_duplicates": lambda x, i, g, v: x.index_put((i % 2,), v, accumulate=True),
    "index_put_second_dim": column_assign,  # index_put with a None first
    "index_put_two_indices": lambda x, i, g, v: x.index_put((g[:, 0] % 4, g[:, 1]), v[0, :4], accumulate=True),
    "index_put_broadcast_indices": lambda x, i, g, v: x.index_put((g[:1, :1] % 4, g[:, 1:]), v[0, 0]),
    "index_add": lambda x, i, g, v: x.index_add(0, i % 4, v),
    "index_add_dim1_alpha": lambda x, i, g, v: x.index_add(1, i % 5, v.t()[:4], alpha=3),
    "index_copy": lambda x, i, g, v: x.index_copy(0, i % 4, v),
    "index_fill": lambda x, i, g, v: x.index_fill(1, i % 4, 2),
    "index_assign": index_assign,
    "mask_assign": mask_assign,
    "mask_accumulate": mask_accumulate,
    "put": lambda x, i, g, v: x.put(torch.stack([i, i - 6]), v[:2, :3]),  # distinct positions, some negative
    "put_accumulate": lambda x, i, g, v: x.put(g % 3, v[:2, :4].reshape(4, 2), accumulate=True),
}


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", [f32, i64], ids=dtype_id)
def test_index_put_and_friends(dtype, layout):
    make = transposed if layout == "transposed" else data
    g = indices([[0, 4], [1, 1], [3, 2], [-1, 0]])
    check_lowered(INDEX_PUT, make((4, 5), dtype), indices([3, 0, -2]), g, make((3, 5), dtype, 1))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "expanded"])
def test_index_fill_of_any_layout(layout):
    """ember's own index_fill decomposition (an index_put): torch 2.11's cloned a non-contiguous
    input through copy_ into empty_permuted, which AOTAutograd rejected before ember ran."""
    x = {
        "contiguous": data((4, 6)),
        "transposed": transposed((4, 6)),
        "sliced": data((4, 12))[:, ::2],
        "expanded": data((1, 6)).expand(4, 6),
    }[layout]
    ops = {
        "scalar_dim1_negative_repeated": lambda x, i: x.index_fill(1, i, -2.5) * 2,
        "tensor_value_dim0": lambda x, i: x.index_fill(0, i % 4, torch.tensor(7.0)),
        "in_place_dim_minus_one": lambda x, i: x.clone().index_fill_(-1, i, float("nan")),
    }
    check_lowered(ops, x, indices([0, -1, 3, 3]))
    torch._dynamo.reset()
    check(lambda x, i: x.index_fill(0, i, 3), data(()), indices([0]))  # 0-d: dim 0 is the element


def test_index_put_int32_indices_and_bool_values():
    ops = {
        "index_put": lambda x, i, v: x.index_put((i,), v),
        "index_put_accumulate": lambda x, i, v: x.index_put((i % 2,), v, accumulate=True),
    }
    check_lowered(ops, data((4, 5), b8), indices([3, 0, -2], i32), data((3, 5), b8, 1))


def test_index_reduce():
    ops = {
        f"{reduce}_{include}": lambda x, i, s, r=reduce, inc=include: x.index_reduce(1, i, s, r, include_self=inc)
        for reduce in ("prod", "mean", "amax", "amin")
        for include in (True, False)
    }
    for dtype in (f32, i64):
        torch._dynamo.reset()
        check_lowered(ops, data((3, 5), dtype), indices([4, 0, 4, 2]), transposed((3, 4), dtype, 1))
    torch._dynamo.reset()
    scalar_ops = {
        f"{reduce}_{include}": lambda x, i, s, r=reduce, inc=include: x.index_reduce(0, i, s, r, include_self=inc)
        for reduce in ("prod", "mean", "amax", "amin")
        for include in (True, False)
    }
    check_lowered(scalar_ops, data(()), indices([0]), data((), seed=1))


def test_masked_scatter():
    ops = {
        "masked_scatter": lambda x, m, s: x.masked_scatter(m, s),
        "broadcast_mask": lambda x, m, s: x.masked_scatter(m[:1], s),
        "transposed": lambda x, m, s: x.t().masked_scatter(m.t(), s),
    }
    x, m = data((4, 5)), data((4, 5), b8, 1)
    check_lowered(ops, x, m, data((30,), seed=2))


def test_diagonal_and_as_strided_scatter():
    ops = {
        "diagonal": lambda x, s: torch.diagonal_scatter(x, s[0, :4]),
        "diagonal_offset": lambda x, s: torch.diagonal_scatter(x, s[1, :3], 2),
        "diagonal_negative_offset_dims": lambda x, s: torch.diagonal_scatter(x, s[2, :3], -2, 1, 0),
        "as_strided": lambda x, s: torch.as_strided_scatter(x, s[:2, :2], (2, 2), (1, 5), 1),
        "as_strided_3": lambda x, s: torch.as_strided_scatter(x, s[0, :3], (3,), (6,)),
    }
    check_lowered(ops, data((4, 5)), data((3, 5), seed=1))


def test_as_strided_scatter_of_an_expanded_input_keeps_every_row():
    # the fake kernel gives the result its input's strides (0, 1), which the values do not have
    # (eager's clone is dense): stored once and returned broadcast, every row was the first
    x = data((1, 3)).expand(3, 3)
    check(lambda x, s: torch.as_strided_scatter(x, s, (2, 2), (1, 2), 0), x, data((2, 2), seed=1))


# ---- out of range ---------------------------------------------------------------------------------

OUT_OF_RANGE: dict[str, tuple[Callable, type[Exception]]] = {
    "scatter": (lambda x, i: x.scatter(0, i.unsqueeze(0), 1.0), RuntimeError),
    "scatter_add": (lambda x, i: x.scatter_add(1, i.unsqueeze(0), x), RuntimeError),
    "scatter_reduce": (lambda x, i: x.scatter_reduce(0, i.unsqueeze(0), x, "amax"), RuntimeError),
    "index_put": (lambda x, i: x.index_put((i,), x[0]), IndexError),
    "index_put_accumulate": (lambda x, i: x.index_put((i,), x[0], accumulate=True), IndexError),
    "put": (lambda x, i: x.put(i * 7, x[0, :2]), IndexError),
    "index_reduce": (lambda x, i: x.index_reduce(0, i, x[:2], "amax"), IndexError),
}


@pytest.mark.parametrize("op", list(OUT_OF_RANGE))
@pytest.mark.parametrize("bad", [5, -6])
def test_out_of_range_index_raises_as_in_eager(op, bad):
    fn, error = OUT_OF_RANGE[op]
    x, i = data((4, 5)), indices([0, bad])
    with pytest.raises(error):
        fn(x, i)
    compiled = compile_fn(fn)
    with pytest.raises(error):
        compiled(x, i)
    assert ember.metrics.fallback_calls == 0
    assert torch.equal(compiled(x, indices([0, 1])), fn(x, indices([0, 1])))  # still right after


def test_negative_scatter_index_raises_and_masked_scatter_short_source():
    x = data((4, 5))
    with pytest.raises(RuntimeError):
        compile_fn(lambda x, i: x.scatter(0, i, 1.0))(x, indices([[0, -1]]))
    with pytest.raises(RuntimeError):
        compile_fn(lambda x, m, s: x.masked_scatter(m, s))(x, x > -9, data((3,)))
    assert ember.metrics.fallback_calls == 0


def in_place_on_input(x, i, s):
    x.scatter_add_(0, i, s)
    x.index_put_((i[0],), s[0], accumulate=True)
    return x.cumsum(0)


def test_in_place_on_an_input():
    """Functionalized: the stores go to a copy, which is written back into the input."""
    x, i, s = data((4, 5)), indices([[0, 1, 2, 0, 3], [3, 3, 3, 3, 3]]), data((2, 5), seed=1)
    got_x, want_x = x.clone(), x.clone()
    torch.testing.assert_close(compile_fn(in_place_on_input)(got_x, i, s), in_place_on_input(want_x, i, s))
    torch.testing.assert_close(got_x, want_x)
    assert ember.metrics.fallback_calls == 0


# ---- gradients ------------------------------------------------------------------------------------


def check_gradients(fn: Callable, *inputs) -> None:
    """The gradients of sum(fn(*inputs) * weights) w.r.t. the float inputs, ember against eager."""

    def grads(run, cast):
        leaves = [cast(x).requires_grad_() if x.is_floating_point() else x for x in inputs]
        out = run(*leaves)
        weights = torch.linspace(-1, 2, out.numel(), dtype=out.dtype).reshape(out.shape)
        (out * weights).sum().backward()
        return [x.grad for x in leaves if x.is_floating_point()]

    got = grads(compile_fn(fn), lambda x: x.detach().clone())
    want = grads(fn, lambda x: x.detach().to(f64))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1.3e-5, atol=1e-5)
    assert ember.metrics.fallback_calls == 0, dict(ember.metrics.fallback_ops)


def test_gradient_of_gather_is_scatter_add():
    check_gradients(
        lambda x, i: x.gather(1, i) * 2, data((4, 5)), indices([[0, 0, 4], [1, 1, 1], [2, 3, 2], [4, 4, 0]])
    )


def test_gradient_of_embedding():
    ids = indices([[1, 2, 2, 9], [0, 1, 1, 1]])
    check_gradients(lambda w, i: F.embedding(i, w), data((10, 3)), ids)
    check_gradients(lambda w, i: F.embedding(i, w, padding_idx=1), data((10, 3)), ids)


def test_training_step_with_embedding():
    torch.manual_seed(0)
    embedding, linear = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3)

    def step(ids):
        loss = linear(embedding(ids)).cumsum(1).sum()
        loss.backward()
        return loss

    ids = torch.randint(0, 50, (4, 7))
    compile_fn(step)(ids)
    got = embedding.weight.grad.clone()
    embedding.weight.grad = None
    step(ids)
    torch.testing.assert_close(got, embedding.weight.grad)
    assert ember.metrics.fallback_calls == 0, dict(ember.metrics.fallback_ops)


def test_gradient_of_advanced_indexing_and_index_select():
    check_gradients(lambda x, i: x[i] + x[:, i % 5].t(), data((5, 5)), indices([3, 0, 3, -1, 0]))
    check_gradients(lambda x, i: x.index_select(0, i).sin(), data((5, 3)), indices([4, 4, 0]))


# ---- a scatter of one element per row is a select (Note in lower/scatter.py) ------------------


def one_per_row(rows: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, size, (rows, 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [f32, i64, b8], ids=dtype_id)
def test_scatter_of_one_element_per_row_fuses_as_a_select(dtype):
    """index (rows, 1) along dim 1, (1, cols) along dim 0, int32 or int64, x transposed, src
    larger than index, a value: one kernel with its reader, nothing stored at computed positions."""
    x, src = transposed((6, 9), dtype), data((6, 9), dtype, 1)
    along_rows, along_cols = one_per_row(6, 9), one_per_row(9, 6, 1).t()
    value = True if dtype is b8 else 3
    ops = {
        "dim1_src": lambda x, r, c, s: x.scatter(1, r, s),
        "dim1_value": lambda x, r, c, s: x.scatter(-1, r.to(i32), value),
        "dim0_src": lambda x, r, c, s: x.scatter(0, c, s),
    }
    check_lowered(ops, x, along_rows, along_cols, src)
    assert ember.metrics.kernels_generated == 1


def test_scatter_of_one_element_per_row_keeps_nan_and_raises_out_of_range():
    x = data((4, 5))
    x[1, 2], x[2, 0] = float("nan"), float("inf")
    check_lowered({"scatter": lambda x, i: x.scatter(1, i, float("nan")) * 2}, x, indices([[0], [2], [4], [1]]))
    for bad in (5, -1):
        with pytest.raises(RuntimeError):
            compile_fn(lambda x, i: x.scatter(1, i, 1.0) + 1)(x, indices([[0], [bad], [1], [1]]))
    assert ember.metrics.fallback_calls == 0


def test_cross_entropy_backward_matches_float64_eager():
    """nll_loss's gradient (-grad scattered into zeros at each row's target, ignore_index rows
    left zero) takes the select form inside the backward graph, fused into the softmax gradient."""
    target = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(4))
    target[3] = -100  # ignore_index
    grads = []
    for dtype, fn in ((f64, F.cross_entropy), (f32, compile_fn(F.cross_entropy))):
        logits = to_test_device(data((16, 50)).to(dtype)).requires_grad_()  # a leaf on the test device
        fn(logits, to_test_device(target)).backward()
        grads.append(logits.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0].float(), rtol=1.3e-5, atol=1e-6)
    assert ember.metrics.fallback_calls == 0 and ember.metrics.graphs_compiled == 2
