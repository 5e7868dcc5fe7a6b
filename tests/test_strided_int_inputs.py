"""Integer inputs (indices, offsets, targets) that are not contiguous: step-sliced, transposed,
at a storage offset, expanded. Every op reading them gives eager's result. The class of bug:
lowering folds `clone(x, memory_format=contiguous)` (which AOTAutograd puts before aten ops
whose kernels assume contiguous inputs) into a read of x, so the extern got x's strides
(lower/context.py, Note: extern arguments in eager's strides)."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import check, compile_fn, data

W, X = data((10, 4), seed=1), data((5, 6), seed=2)
OFFSETS = torch.tensor([0, 3, 5])


def strided_variants(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors equal to `t` that are not contiguous or start at a storage offset."""
    flat = t.reshape(-1)
    spaced = torch.zeros(flat.numel() * 2, dtype=t.dtype)
    spaced[::2] = flat
    shifted = torch.zeros(flat.numel() + 3, dtype=t.dtype)
    shifted[3:] = flat
    found = {"step2": spaced[::2].view(t.shape) if t.dim() == 1 else None, "offset": shifted[3:].view(t.shape)}
    if t.dim() == 2:
        wide = torch.zeros(t.shape[0], t.shape[1] * 2, dtype=t.dtype)
        wide[:, ::2] = t
        found |= {"step2": wide[:, ::2], "transposed": t.t().contiguous().t()}
    if t.dim() == 1 and t.numel() > 1 and bool((t == t[0]).all()):
        found["expanded"] = t[:1].expand(t.shape)
    for name, v in found.items():
        assert v is None or (torch.equal(v, t) and (not v.is_contiguous() or v.storage_offset() > 0)), name
    return {k: v for k, v in found.items() if v is not None}


def on(like: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` on the device of `like` (a constant of the function under test)."""
    return t.to(like.device)


def index_of(bound: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, bound, shape, generator=torch.Generator().manual_seed(seed))


CASES = {  # each builds its other tensors on its input's device (check runs it on the test device)
    "embedding": (lambda i: F.embedding(i, on(i, W)) * 2, index_of(10, 8)),
    "embedding_2d": (lambda i: F.embedding(i, on(i, W)) * 2, index_of(10, 3, 4)),
    "embedding_bag_sum": (lambda i: F.embedding_bag(i, on(i, W), on(i, OFFSETS), mode="sum"), index_of(10, 8)),
    "embedding_bag_mean": (lambda i: F.embedding_bag(i, on(i, W), on(i, OFFSETS), mode="mean"), index_of(10, 8)),
    "embedding_bag_max": (lambda i: F.embedding_bag(i, on(i, W), on(i, OFFSETS), mode="max"), index_of(10, 8)),
    "embedding_bag_offsets": (
        lambda o: F.embedding_bag(torch.arange(8, device=o.device) % 10, on(o, W), o, mode="sum"),
        OFFSETS,
    ),
    "embedding_bag_2d": (lambda i: F.embedding_bag(i, on(i, W), mode="sum"), index_of(10, 3, 4)),
    "gather": (lambda i: torch.gather(on(i, X), 1, i) + 1, index_of(6, 5, 3)),
    "index_select": (lambda i: on(i, X).index_select(1, i) + 1, index_of(6, 8)),
    "take": (lambda i: torch.take(on(i, X), i) + 1, index_of(30, 8)),
    "index": (lambda i: on(i, X)[i] + 1, index_of(5, 8)),
    "index_put": (lambda i: on(i, X).index_put((i,), on(i, torch.ones(8, 6)), accumulate=True), index_of(5, 8)),
    "scatter_add": (lambda i: on(i, torch.zeros(5, 6)).scatter_add(1, i, on(i, torch.ones(5, 3))), index_of(6, 5, 3)),
    "scatter": (lambda i: on(i, torch.zeros(5, 6)).scatter(1, i, 2.0), index_of(6, 5, 3)),
    "index_add": (lambda i: on(i, X).index_add(0, i, on(i, torch.ones(8, 6))), index_of(5, 8)),
    "index_fill": (lambda i: on(i, X).index_fill(0, i, 3.0), index_of(5, 4)),
    "put": (lambda i: on(i, X).put(i, on(i, torch.ones(8)), accumulate=True), index_of(30, 8)),
    "bincount": (lambda i: torch.bincount(i, minlength=10), index_of(10, 8)),
    "one_hot": (lambda i: F.one_hot(i, 10) * 2, index_of(10, 8)),
    "nll_loss": (lambda t: F.nll_loss(F.log_softmax(on(t, data((8, 10))), 1), t), index_of(10, 8)),
    "cross_entropy": (lambda t: F.cross_entropy(on(t, data((8, 10))), t, reduction="none"), index_of(10, 8)),
    "searchsorted": (lambda v: torch.searchsorted(torch.arange(0, 20, 2, device=v.device), v), index_of(20, 8)),
    "cumsum": (lambda i: i.cumsum(0) + i.sum(), index_of(10, 8)),
    "sort": (lambda i: torch.sort(i).values * 2, index_of(10, 8)),
    "constant_index": (lambda i: F.embedding(i, on(i, W)), torch.full((6,), 7)),
}
PARAMS = [(name, variant) for name, (_, base) in CASES.items() for variant in strided_variants(base)]


@pytest.mark.parametrize("name,variant", PARAMS, ids=[f"{n}-{v}" for n, v in PARAMS])
def test_ops_read_strided_integer_inputs_as_eager(name, variant):
    fn, base = CASES[name]
    check(fn, strided_variants(base)[variant])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_bag_sample_with_step_sliced_indices(dtype):
    """The OpInfo sample the conformance sweep missed: int64 indices of stride 2, mode='sum',
    per_sample_weights; every element was wrong."""
    weight = data((10, 3), dtype, seed=3)
    indices = index_of(10, 16, seed=4)[::2]
    per_sample = data((8,), dtype, seed=5)
    fn = lambda w, i, o, p: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p)
    got = compile_fn(fn)(weight, indices, OFFSETS, per_sample)
    assert torch.equal(got, fn(weight, indices, OFFSETS, per_sample))  # the same aten kernel, the same input


def test_embedding_bag_gradient_with_strided_indices():
    weight = data((10, 4), seed=6).requires_grad_()
    indices = index_of(10, 3, 8, seed=7)[:, ::2]
    fn = lambda w, i: (F.embedding_bag(i, w, mode="mean") * torch.arange(4.0)).sum()
    (got,) = torch.autograd.grad(compile_fn(fn)(weight, indices), weight)
    (want,) = torch.autograd.grad(fn(weight, indices.contiguous()), weight)
    torch.testing.assert_close(got, want)


def test_a_copy_an_extern_needs_contiguous_is_kept():
    """view(dtype) of a different width needs a contiguous last dim: the copy before it stays."""
    x = data((4, 6))
    fn = lambda x: x.t().contiguous().view(torch.bfloat16).float() * 2
    torch.testing.assert_close(compile_fn(fn)(x), fn(x), rtol=0, atol=0, equal_nan=True)  # bits reinterpreted
