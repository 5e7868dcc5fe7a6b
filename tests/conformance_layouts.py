"""Layout variants of OpInfo samples for the conformance sweep (tests/conformance.py), and the
one table of ops the sweep skips on purpose.

A variant rewrites every strided tensor of a sample (input, args, kwargs) into a tensor of
the same shape, dtype and values, but another memory layout:

    contiguous     the sample as OpInfo makes it
    transposed     ndim >= 2: the last two dims stored swapped (t.mT.contiguous().mT)
    sliced         every 2nd element along each dim of a base twice as large (strides x2)
    expanded       stride 0: each size-1 dim gets stride 0, and the first dim longer than 1
                   becomes an expand of its first slice (the values change: eager sees the
                   same expanded tensor, so the comparison stays fair)
    offset         a nonzero storage offset (the tensor starts 3 elements into its storage)
    channels_last  4-d (5-d) tensors in channels-last (channels-last-3d) memory format

A variant that changes no tensor's layout in a sample (a 1-d sample "transposed") is not run:
it would repeat the contiguous run.

Note: skips in one place
    Every op, dtype or variant the sweep leaves out on purpose is an entry of `SKIPS` with its
    reason; nothing else in the sweep skips by name. What the sweep skips by rule (eager raises
    on the sample, outputs that are not tensors) is decided per sample and counted in the
    report under its own reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

VARIANTS = ("contiguous", "transposed", "sliced", "expanded", "offset", "channels_last")


def transposed(t: torch.Tensor) -> torch.Tensor | None:
    if t.dim() < 2 or t.shape[-1] <= 1 or t.shape[-2] <= 1:
        return None
    return t.mT.contiguous().mT


def sliced(t: torch.Tensor) -> torch.Tensor | None:
    if t.dim() == 0 or t.numel() == 0:
        return None
    base = torch.zeros([2 * n for n in t.shape], dtype=t.dtype, device=t.device)
    view = base[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


def expanded(t: torch.Tensor) -> torch.Tensor | None:
    if t.dim() == 0 or t.numel() == 0:
        return None
    longer = [d for d, n in enumerate(t.shape) if n > 1]
    if longer:
        d = longer[0]
        t = t.narrow(d, 0, 1).clone().expand(t.shape)
    stride = [0 if n == 1 else s for n, s in zip(t.shape, t.stride())]
    return t.as_strided(t.shape, stride, t.storage_offset())


def offset(t: torch.Tensor, by: int = 3) -> torch.Tensor | None:
    if t.numel() == 0:
        return None
    base = torch.zeros(t.numel() + by, dtype=t.dtype, device=t.device)
    view = base[by:].view(t.shape)
    view.copy_(t)
    return view


def channels_last(t: torch.Tensor) -> torch.Tensor | None:
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    if t.dim() not in formats:
        return None
    out = t.contiguous(memory_format=formats[t.dim()])
    return out if out.stride() != t.stride() else None


MAKERS: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {
    "transposed": transposed,
    "sliced": sliced,
    "expanded": expanded,
    "offset": offset,
    "channels_last": channels_last,
}


def relayout(tree, variant: str) -> tuple[object, bool]:
    """`tree` with each strided tensor in `variant`'s layout; and whether any tensor changed."""
    if variant == "contiguous":
        return tree, True
    make, changed = MAKERS[variant], []

    def one(x):
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.is_complex():
            return x
        with torch.no_grad():
            y = make(x.detach())
        if y is None:
            return x
        changed.append(True)
        return y.requires_grad_(x.requires_grad) if x.requires_grad else y

    return tree_map(one, tree), bool(changed)


# ---- Note: skips in one place ----------------------------------------------------------------


@dataclass(frozen=True)
class Skip:
    reason: str
    variants: tuple[str, ...] = VARIANTS  # the variants skipped (all by default)
    dtypes: tuple[torch.dtype, ...] | None = None  # None: every dtype
    when: Callable[[Any], bool] | None = None  # the OpInfo samples skipped (None: every sample)


# Which of several equal elements a median's index names is unspecified (torch's docs: "not
# necessarily the first occurrence"), and eager's own answer changes with the layout: on the
# expanded sample 10 of median, eager gives index 1 on the expanded input and 2 on its
# contiguous copy. The expanded layout repeats values on purpose, so its index outputs are ties.
TIE_INDICES = "ties by construction: which equal element's index is returned is unspecified (eager's varies by layout)"

# Training-mode batch norm writes its running statistics in place; expanded (stride 0) they
# overlap, and dynamo's fake-tensor run of the write raises before any backend sees a graph
# (aot_eager too), while eager's kernel writes them anyway. embedding(max_norm=) renormalizes
# its weight rows in place: AOTAutograd's write-back into the overlapping weight raises in
# torch's meta copy_ before the graph reaches a backend (aot_eager raises the same).
OVERLAPPING_WRITE = "writes an input in place that the expanded layout makes overlap: torch.compile itself raises"

# torch 2.11's dynamo runs view_copy's fake-tensor kernel as a view, which raises ("Cannot view a
# tensor with shape ... and strides ...") for strides no view can express, before any backend
# sees a graph; eager copies. torch 2.13's dynamo traces it. Probed, not assumed by version.
UNTRACEABLE_VIEW_COPY = "dynamo itself raises on view_copy of a layout no view can express (torch 2.11)"


@functools.cache
def dynamo_rejects_view_copy_of_any_layout() -> bool:
    try:
        torch.compile(lambda x: torch.view_copy(x, (25, 5)), backend="eager")(torch.ones(5, 5, 5).mT)
    except Exception:
        return True
    finally:
        torch._dynamo.reset()
    return False


# by OpInfo key (`name` or `name.variant`)
SKIPS: dict[str, Skip] = {
    "view_copy": Skip(
        UNTRACEABLE_VIEW_COPY,
        ("transposed", "sliced", "expanded"),
        when=lambda s: dynamo_rejects_view_copy_of_any_layout(),
    ),  # fmt: skip
    "native_batch_norm": Skip(OVERLAPPING_WRITE, ("expanded",)),
    "_native_batch_norm_legit": Skip(OVERLAPPING_WRITE, ("expanded",)),
    "_batch_norm_with_update": Skip(OVERLAPPING_WRITE, ("expanded",)),
    "nn.functional.batch_norm": Skip(OVERLAPPING_WRITE, ("expanded",)),
    "nn.functional.embedding": Skip(OVERLAPPING_WRITE, ("expanded",), when=lambda s: "max_norm" in s.kwargs),
    "nn.functional.embedding_bag": Skip(OVERLAPPING_WRITE, ("expanded",), when=lambda s: "max_norm" in s.kwargs),
    "median": Skip(TIE_INDICES, ("expanded",)),
    "nanmedian": Skip(TIE_INDICES, ("expanded",)),
}


def skip_reason(key: str, dtype: torch.dtype, variant: str, sample: Any = None) -> str | None:
    """Why the sweep leaves (op, dtype, variant) out, or None when it runs it; with `sample`, the
    same for that one sample (a skip with a `when` leaves only the samples it names out)."""
    skip = SKIPS.get(key)
    if skip is None or variant not in skip.variants or (skip.dtypes is not None and dtype not in skip.dtypes):
        return None
    if skip.when is not None and (sample is None or not skip.when(sample)):
        return None
    return skip.reason
