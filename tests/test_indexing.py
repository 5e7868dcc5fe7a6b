"""Indexing and data-movement ops (ember/lower/indexing.py) against eager, through `check`.

Ops that take the same inputs compile together as one graph returning a tuple, so a test is
one trace and one kernel per output. Inputs come contiguous, transposed (non-contiguous) and
expanded (broadcast); index tensors come as int64 and int32 where eager takes both, with
negative values where eager allows them, 0-d and empty. The scatter-like ops are tested in
tests/test_scatter.py.

Results with no elements compile in a graph of their own (`test_empty_results`): the fusion
scheduler in progress (schedule/group.py `align`) puts a (3, 0) result into the loop nest of a
(3, 2) one and writes out of bounds; repro, which crashes:
`lambda x: (x[:, None, :2] * 2, x[:, :0] * 3, x[:, :2] * 4, x[:, :1] * 5)` on a (3, 5) input.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import check, data, indices, transposed

aten = torch.ops.aten
f32, f64, i32, i64, b8 = torch.float32, torch.float64, torch.int32, torch.int64, torch.bool


def check_lowered(ops: dict[str, Callable], *inputs) -> None:
    """`check` the ops compiled together as one graph; none may fall back to aten."""
    fns = tuple(ops.values())

    def program(*xs):
        return tuple(fn(*xs) for fn in fns)

    try:
        check(program, *inputs)
    except AssertionError as e:
        raise AssertionError(f"{e}\n(outputs in order: {list(ops)})") from None
    assert ember.metrics.fallback_calls == 0, f"lowered ops went to aten: {dict(ember.metrics.fallback_ops)}"


def ops_for(dtype: torch.dtype, table: dict[str, Callable], *names: str) -> dict[str, Callable]:
    """The whole table for float32; other data dtypes change only the loaded type: the named ops."""
    return table if dtype is f32 else {name: table[name] for name in names}


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- cat, stack, split -----------------------------------------------------------------------

CAT: dict[str, Callable] = {  # inputs: a (3, 4) contiguous, b (3, 4) transposed, c (3, 1) to expand
    "cat_dim0": lambda a, b, c: torch.cat([a, b]),
    "cat_dim1": lambda a, b, c: torch.cat([a, b], 1),
    "cat_three_negative_dim": lambda a, b, c: torch.cat([b, a, b[:, :2]], -1),
    "cat_broadcast_input": lambda a, b, c: torch.cat([a, c.expand(3, 4), b], 0),
    "cat_empty_inputs": lambda a, b, c: torch.cat([a[:0], a, torch.zeros(0, dtype=a.dtype, device=a.device), b]),
    "cat_promotes": lambda a, b, c: torch.cat([a, b.to(f64)], 1),
    "cat_single": lambda a, b, c: torch.cat([b]),
    "cat_of_views": lambda a, b, c: torch.cat([a.t(), b[::2].t()], 1),
    "stack_dim0": lambda a, b, c: torch.stack([a, b]),
    "stack_last": lambda a, b, c: torch.stack([a, b, a], -1),
    "hstack_1d": lambda a, b, c: torch.hstack([a[0], b[1], c[:, 0]]),
    "vstack": lambda a, b, c: torch.vstack([a, b[0]]),
}


@pytest.mark.parametrize("dtype", [f32, i64, b8], ids=dtype_id)
def test_cat_stack(dtype):
    ops = ops_for(dtype, CAT, "cat_dim1", "cat_three_negative_dim", "cat_promotes", "stack_last")
    check_lowered(ops, data((3, 4), dtype), transposed((3, 4), dtype, 1), data((3, 1), dtype, 2))


def test_cat_empty_result_and_0d_stack():
    ops = {
        "cat_all_empty": lambda x, s: torch.cat([x[:0], x[:0]]),
        "stack_0d": lambda x, s: torch.stack([s, s * 2, x[0, 0]]),
    }
    check_lowered(ops, data((3, 4)), data(()))


SPLIT: dict[str, Callable] = {  # input (4, 6); split pieces are views, returned as copies
    "split": lambda x: x.split(3, 1),
    "split_uneven": lambda x: x.split(3, 0),
    "split_with_sizes": lambda x: x.split([1, 3], 0),
    "chunk": lambda x: x.chunk(4, 1),
    "unbind": lambda x: x.unbind(1)[1:3],
    "tensor_split": lambda x: x.tensor_split([1, 4], 1),
    "split_of_computed": lambda x: [p.sum(1) for p in (x * 2).split(2, 0)],
}


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_split_chunk_unbind(layout):
    x = data((4, 6)) if layout == "contiguous" else transposed((4, 6))
    check_lowered(SPLIT if layout == "contiguous" else {k: SPLIT[k] for k in ("split_with_sizes", "chunk")}, x)


# ---- pads --------------------------------------------------------------------------------------

PAD: dict[str, Callable] = {  # input (3, 4)
    "last_dim": lambda x: F.pad(x, (1, 2)),
    "two_dims": lambda x: F.pad(x, (1, 2, 2, 0)),
    "crop": lambda x: F.pad(x, (-1, 2)),
    "crop_both_sides": lambda x: F.pad(x, (2, -1, -1, 1)),
    "value": lambda x: F.pad(x, (0, 1, 1, 0), value=1),
    "all_dims_3d": lambda x: F.pad(x.unsqueeze(0), (1, 1, 0, 2, 1, 0)),
    "no_pad": lambda x: F.pad(x, (0, 0)),
}


@pytest.mark.parametrize("dtype", [f32, i64, b8], ids=dtype_id)
def test_constant_pad(dtype):
    check_lowered(ops_for(dtype, PAD, "two_dims", "crop_both_sides", "value"), transposed((3, 4), dtype))


def test_constant_pad_of_empty():
    check_lowered({"pad_empty": lambda x: F.pad(x, (1, 1, 2, 0), value=3.5)}, data((0, 4)))


MODE_PAD: dict[str, Callable] = {  # input (2, 3, 5): reflect/replicate/circular decompose to index math
    "reflect_1d": lambda x: F.pad(x, (2, 3), mode="reflect"),
    "replicate_1d": lambda x: F.pad(x, (2, 3), mode="replicate"),
    "circular_1d": lambda x: F.pad(x, (1, 2), mode="circular"),
    "reflect_2d": lambda x: F.pad(x.unsqueeze(0), (1, 2, 2, 1), mode="reflect"),
    "replicate_2d": lambda x: F.pad(x.unsqueeze(0), (3, 0, 1, 2), mode="replicate"),
    "circular_2d": lambda x: F.pad(x.unsqueeze(0), (1, 1, 2, 0), mode="circular"),
    "replicate_3d": lambda x: F.pad(x[None, None], (1, 0, 1, 1, 0, 2), mode="replicate"),
}


def test_reflection_replication_circular_pads():
    check_lowered(MODE_PAD, transposed((2, 3, 5)))


# ---- flip, roll, repeat, tril/triu ---------------------------------------------------------------

MOVES: dict[str, Callable] = {  # input (3, 4)
    "flip": lambda x: x.flip(0),
    "flip_both_negative": lambda x: x.flip(-1, -2),
    "fliplr_of_view": lambda x: x.t()[1:].fliplr(),
    "rot90": lambda x: x.rot90(1, (0, 1)),
    "roll": lambda x: x.roll(1, 1),
    "roll_negative_two_dims": lambda x: x.roll((-1, 5), (0, 1)),
    "roll_flat": lambda x: x.roll(5),
    "repeat": lambda x: x.repeat(2, 3),
    "repeat_new_dims": lambda x: x.repeat(2, 1, 1),
    "tile": lambda x: x[:1].tile(3, 1),
    "repeat_interleave": lambda x: x.repeat_interleave(2, 0),
    "tril": lambda x: x.tril(),
    "tril_offset": lambda x: x.tril(1),
    "triu": lambda x: x.triu(),
    "triu_negative_offset": lambda x: x.triu(-1),
    "triu_batched": lambda x: x.unsqueeze(0).expand(2, 3, 4).triu(2),
}


@pytest.mark.parametrize("dtype", [f32, i64, b8], ids=dtype_id)
def test_flip_roll_repeat_tril_triu(dtype):
    ops = ops_for(dtype, MOVES, "flip_both_negative", "roll_negative_two_dims", "repeat", "triu_batched")
    check_lowered(ops, transposed((3, 4), dtype))


def test_0d_moves():
    ops = {"flip": lambda s: s.flip(0), "repeat": lambda s: s.repeat(2, 3), "roll": lambda s: s.roll(1)}
    check_lowered(ops, data(()))


# ---- gathers: gather, index_select, embedding, advanced indexing --------------------------------

GATHER: dict[str, Callable] = {  # x (3, 5), g (3, 2) in [0, 5), r (2,) in [0, 3)
    "dim1": lambda x, g, r: x.gather(1, g),
    "dim0": lambda x, g, r: x.gather(0, g.t() % 3),
    "negative_dim": lambda x, g, r: x.gather(-1, g[:1]),
    "index_transposed": lambda x, g, r: x.t().gather(0, g.t()),
    "index_expanded": lambda x, g, r: x.gather(1, g[:, :1].expand(3, 4)),
    "input_expanded": lambda x, g, r: x[:1].expand(3, 5).gather(1, g),
    "take_along_dim": lambda x, g, r: torch.take_along_dim(x, g - 5, 1),
    "3d": lambda x, g, r: x.view(3, 5, 1).expand(3, 5, 2).gather(1, g.unsqueeze(1)),
    "of_computed": lambda x, g, r: (x * 2).gather(1, g).sum(1),
    "index_from_argmax": lambda x, g, r: x.gather(1, x.argmax(1, keepdim=True)),
    "index_select_dim0": lambda x, g, r: x.index_select(0, r),
    "index_select_dim1": lambda x, g, r: x.index_select(-1, g[0]),
    "index_select_0d_index": lambda x, g, r: x.index_select(1, g[1, 0]),
    "index_select_transposed": lambda x, g, r: x.t().index_select(1, r),
    "embedding": lambda x, g, r: F.embedding(g, x.t()),
    "embedding_1d": lambda x, g, r: F.embedding(r, x),
    "embedding_padding_idx": lambda x, g, r: F.embedding(g.t(), x.t(), padding_idx=1),
}


@pytest.mark.parametrize("dtype", [f32, i64, b8], ids=dtype_id)
def test_gather_index_select_embedding(dtype):
    g = torch.tensor([[0, 4], [3, 3], [1, 2]])
    ops = ops_for(dtype, GATHER, "dim1", "take_along_dim", "index_select_dim1", "embedding")
    check_lowered(ops, transposed((3, 5), dtype), g, indices([2, 0]))


@pytest.mark.parametrize("index_dtype", [i64, i32], ids=dtype_id)
def test_int32_and_int64_indices(index_dtype):
    ops = {
        "gather": lambda x, g, r: x.gather(1, g),
        "index_select": lambda x, g, r: x.index_select(1, g[1]),
        "embedding": lambda x, g, r: F.embedding(g, x),
        "index": lambda x, g, r: x[r],
        "index_two": lambda x, g, r: x[r, g[:2, :1]],
    }
    check_lowered(ops, data((5, 5)), indices([[0, 4], [3, 3], [1, 2]], index_dtype), indices([-1, 2], index_dtype))


INDEX: dict[str, Callable] = {  # x (3, 4, 5); i (2,) with a negative value; j (3, 1); k (2, 2) negative
    "first_dim": lambda x, i, j, k: x[i],
    "middle_dim": lambda x, i, j, k: x[:, i],
    "last_dim": lambda x, i, j, k: x[..., i],
    "negative_only": lambda x, i, j, k: x[k],
    "broadcast_adjacent": lambda x, i, j, k: x[:, j, i],
    "broadcast_separated": lambda x, i, j, k: x[j, :, i],
    "all_dims": lambda x, i, j, k: x[j, i, k[0]],
    "2d_index": lambda x, i, j, k: x[:, k],
    "0d_index": lambda x, i, j, k: aten.index.Tensor(x, [None, i[1]]),  # x[:, i[1]] would call .item()
    "0d_and_vector": lambda x, i, j, k: aten.index.Tensor(x, [i[0], None, i]),
    "with_slices": lambda x, i, j, k: x[1:, i, ::2],
    "with_new_axis": lambda x, i, j, k: x[:, None, i],
    "constant_list": lambda x, i, j, k: x[:, [0, -1, 2]],
    "take": lambda x, i, j, k: torch.take(x, k * 7),
    "of_transposed": lambda x, i, j, k: x.transpose(0, 2)[i, j],
    "of_broadcast": lambda x, i, j, k: x[:1].expand(3, 4, 5)[j, i],
    "of_computed": lambda x, i, j, k: (x + 1)[i] * 2,
    "chained": lambda x, i, j, k: x[i][:, k],
}


@pytest.mark.parametrize("dtype", [f32, i64, b8], ids=dtype_id)
def test_advanced_indexing(dtype):
    check_lowered(
        ops_for(dtype, INDEX, "broadcast_separated", "negative_only", "with_slices"),
        transposed((3, 4, 5), dtype),
        indices([2, -3]),
        indices([[0], [2], [1]]),
        indices([[-1, 0], [1, -2]]),
    )


EMPTY: dict[str, Callable] = {  # x (3, 4), e (0, 3), i (2,): results with no elements
    "cat": lambda x, e, i: torch.cat([x[:, :0], e.t()], 1),
    "split_empty_piece": lambda x, e, i: x.split([0, 1, 3], -1)[0],
    "pad_to_empty": lambda x, e, i: F.pad(x, (-2, -2)),
    "pad_of_empty": lambda x, e, i: F.pad(e, (0, 0, 1, 1)),
    "repeat_zero": lambda x, e, i: x.repeat(0, 2),
    "gather_empty_index": lambda x, e, i: x.gather(1, i.view(2, 1)[:, :0]),
    "index_select_empty_index": lambda x, e, i: x.index_select(0, i[:0]),
    "index_empty_index": lambda x, e, i: x[i[:0]],
    "index_empty_input": lambda x, e, i: e.t()[i],
    "index_of_empty_dim": lambda x, e, i: e[:, i[:0]],
    "embedding_empty_indices": lambda x, e, i: F.embedding(i[:0], x),
}


def test_empty_results():
    """Kept apart from non-empty results: see the fusion note in the module docstring."""
    check_lowered(EMPTY, data((3, 4)), data((0, 3)), indices([0, 2]))


def test_0d_index_and_input():
    ops = {
        "gather_0d": lambda s, x, i: s.gather(0, i[0]),
        "index_select_0d_input": lambda s, x, i: s.index_select(0, i[:1]),
        "index_0d_index": lambda s, x, i: aten.index.Tensor(x, [i[1]]),
        "index_select_0d_index": lambda s, x, i: x.index_select(1, i[0]),
        "embedding_0d_index": lambda s, x, i: F.embedding(i[1], x),
    }
    check_lowered(ops, data(()), data((3, 4)), indices([0, 2]))


def test_gathers_read_their_inputs_in_place():
    """Inputs and index tensors are inlined, not copied: a chain of these ops is one kernel."""
    fn = lambda x, g, i: F.pad(torch.cat([(x * 2).gather(1, g)[i], x[:, :2] + 1]), (1, 1)).flip(0)  # noqa: E731
    check(fn, data((3, 5)), indices([[0, 4], [3, 3], [1, 2]]), indices([2, -3]))
    assert ember.metrics.kernels_generated == 1
    assert ember.metrics.fallback_calls == 0


# ---- scatters with known positions, masked_fill, where, clone -----------------------------------


def slice_assign(x, v):
    x = x.clone()
    x[:, 1:4:2] = v
    x[1:3, -1] = v[0, 0]
    return x


def select_assign(x, v):
    x = x.clone()
    x[1, :3] = v[:, 0]
    x[:, -1] = 0
    return x


ASSIGN: dict[str, Callable] = {  # x (3, 5), v (3, 2)
    "slice_assign": slice_assign,
    "select_assign": select_assign,
    "slice_scatter": lambda x, v: torch.slice_scatter(x.t(), v.t(), 0, 3),
    "slice_scatter_step": lambda x, v: torch.slice_scatter(x, v * 2, 1, 0, 5, 3),
    "slice_scatter_empty": lambda x, v: torch.slice_scatter(x, v[:, :0], 1, 4, 4),
    "select_scatter": lambda x, v: torch.select_scatter(x, v[:, 1], 1, -2),
    "masked_fill": lambda x, v: x.masked_fill(x > 0, -1),
    "masked_fill_broadcast_mask": lambda x, v: x.masked_fill(x[:1] > 0, 7),
    "masked_fill_0d_tensor": lambda x, v: x.masked_fill(x < 1, v[0, 0]),
    "where_broadcast": lambda x, v: torch.where(x[:, :1] > 0, x[:1], v[:1, :1]),
    "where_scalar": lambda x, v: torch.where(x > 0, x, 2),
    "clone": lambda x, v: x.clone(),
    "contiguous": lambda x, v: x.t().contiguous(),
    "clone_channels_last": lambda x, v: x.view(1, 3, 5, 1).clone(memory_format=torch.channels_last),
}


@pytest.mark.parametrize("dtype", [f32, i64], ids=dtype_id)
def test_assignments_masked_fill_where_clone(dtype):
    ops = ops_for(dtype, ASSIGN, "slice_assign", "select_assign", "masked_fill", "where_broadcast")
    check_lowered(ops, transposed((3, 5), dtype), data((3, 2), dtype, 1))


# ---- boolean masks (the scatters are in tests/test_scatter.py) ---------------------------------------


def test_boolean_mask_is_correct():
    """x[mask] has a data-dependent shape: dynamo breaks the graph there (ember would use aten)."""
    check(lambda x, m: (x[m], x[x > 0], x[:, m[0]]), data((6, 5)), data((6, 5), b8, 1))


# ---- out-of-range indices (Note: out-of-range indices in ember/lower/indexing.py) ------------------


def test_constant_index_out_of_range_raises_as_in_eager():
    fn = lambda x: x[:, [0, 7]]  # noqa: E731
    x = data((3, 5))
    with pytest.raises(IndexError):
        fn(x)
    with pytest.raises(IndexError):
        torch.compile(fn, backend="ember", dynamic=False)(x)


@pytest.mark.parametrize("op", ["index", "gather", "index_select", "embedding"])
def test_runtime_index_out_of_range_raises(op):
    fn = {
        "index": lambda x, i: x[i],
        "gather": lambda x, i: x.gather(0, i.unsqueeze(1)),
        "index_select": lambda x, i: x.index_select(0, i),
        "embedding": lambda x, i: F.embedding(i, x),
    }[op]
    x, i = data((3, 5)), indices([0, 3])
    with pytest.raises((IndexError, RuntimeError)):
        fn(x, i)
    compiled = torch.compile(fn, backend="ember", dynamic=False)
    with pytest.raises((IndexError, RuntimeError)):
        compiled(x, i)


@pytest.mark.parametrize("op", ["index", "gather", "index_select", "embedding"])
def test_index_into_a_dim_every_position_reads_alike_still_raises(op):
    # a dim of size 1 or of stride 0 (expanded) does not need the index to read: its check stays
    fn = {
        "index": lambda x, i: x[i, [1, 3]],
        "gather": lambda x, i: x.gather(0, i.unsqueeze(1).expand(2, 5)),
        "index_select": lambda x, i: x.index_select(0, i),
        "embedding": lambda x, i: F.embedding(i, x),
    }[op]
    for x in (data((1, 5)), data((1, 5)).expand(3, 5)):
        good, bad = indices([0, 0]), indices([0, x.shape[0]])
        compiled = torch.compile(fn, backend="ember", dynamic=False)
        torch.testing.assert_close(compiled(x, good), fn(x, good))
        with pytest.raises((IndexError, RuntimeError)):
            fn(x, bad)
        with pytest.raises((IndexError, RuntimeError)):
            compiled(x, bad)


def test_kernel_arguments_skip_an_index_tensor_no_read_needs():
    # the first index addresses a stride-0 dim: the kernel drops that tensor's load, and the
    # wrapper must not pass it (it shifted every later argument: wrong values)
    x = data((1, 5, 5)).expand(5, 5, 5)
    check(lambda x: x[[0, 2, 3], [1, 3, 3], [0, 0, 2]], x)
    check(lambda x, i, j, k: x[i, j, k] * 2, x, indices([0, 2, 3]), indices([1, 3, 3]), indices([0, 0, 2]))
