"""Frontend: which inputs of a backward graph AOTAutograd donates, read when the backward compiles.

Note: donated inputs
    A backward's inputs are mostly the forward's saved tensors. AOTAutograd (torch._functorch,
    `collect_bw_donated_buffer_idxs`) calls a saved tensor *donated* when its storage is shared
    with no forward input, no user output of the forward and no gradient the backward returns:
    nothing outside the backward can see it. It clears its own references before the call
    (`steal_args`), and refuses a later `backward(retain_graph=True)` on a graph compiled with
    donations (a retained graph gets none: it sets the list empty before the backward compiles).
    So the backward may free a donated input at its last use, and a kernel may write its output
    over it (codegen/kernel.py `choose_inplace`): cross-entropy's gradient over the saved logits,
    the largest buffer of a language model's step.

    The list is `TracingContext.fw_metadata.bw_donated_idxs`, placeholder positions of the
    backward graph, readable while it compiles (torch >= 2.5; absent or None reads as none). It is
    read here once, by the compiler AOTAutograd calls, and kept by placeholder name in
    `gm.meta[DONATED_INPUTS]` (part of the graph key), never read again later (a graph compiled
    per shape at a later call would find another graph's context). Two inputs on one storage (two
    saved views of one tensor) are each donated by torch's rule but not dying with either's last
    use, so ember drops both.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

# GraphModule.meta key: the names of the backward's placeholders AOTAutograd donates (Note: donated inputs)
DONATED_INPUTS = "ember_donated_inputs"


def mark_donated_inputs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
    """Records in `gm.meta` the placeholders of this backward that AOTAutograd donates."""
    positions = donated_positions()
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if not positions or len(placeholders) != len(example_inputs):
        return
    keys = [_storage_key(x) if isinstance(x, torch.Tensor) else None for x in example_inputs]
    shared = {k for k, n in Counter(keys).items() if n > 1}
    donated = [placeholders[i] for i in positions
               if 0 <= i < len(keys) and keys[i] is not None and keys[i] not in shared]  # fmt: skip
    if donated:
        gm.meta[DONATED_INPUTS] = tuple(sorted(donated))


def donated_positions() -> list[int]:
    """`bw_donated_idxs` of the graph AOTAutograd is compiling, or none where torch has no such field."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    found = getattr(metadata, "bw_donated_idxs", None)
    return [i for i in found if isinstance(i, int)] if isinstance(found, (list, tuple)) else []


def _storage_key(x: torch.Tensor) -> int | None:
    """Which storage `x` lies on; None where it has none we can tell (a tensor subclass): never donated."""
    try:
        return x.untyped_storage()._cdata
    except Exception:
        return None
