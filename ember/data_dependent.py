"""Frontend check: graphs whose tensor sizes depend on tensor values, refused with a reason.

Note: data-dependent sizes
    With `torch._dynamo.config.capture_dynamic_output_shape_ops` (or `capture_scalar_outputs`
    and a value used as a size), dynamo keeps ops such as `nonzero`, `masked_select` or
    `x[mask]` in the graph, and the sizes they give are *unbacked* symbols (u0, u1, ...): no
    input tells their value, only running the op does. ember sizes every kernel, buffer and
    memory plan from the inputs (Note: symbolic sizes, compile_symbolic.py), so it compiles no
    such graph. Before this check, lowering stopped at the first question about the size with
    torch's "Could not guard on data-dependent expression Eq(u0, 0)", and a later call at new
    shapes crashed in the per-shape path (shape_specialization.py), which re-ran `nonzero` on
    fake tensors. Now the graph is refused up front, naming the op that makes the size and the
    user's line, and (unless strict) runs eagerly with one warning. With those dynamo options off
    (torch's default), dynamo splits the graph at such an op and ember compiles the parts.
    A value taken out of a tensor (`.item()`) that is only computed with, never a size, is no
    data-dependent size: such graphs are not refused here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_flatten

from ember.debug.provenance import op_name, user_line


def data_dependent_size(gm: torch.fx.GraphModule) -> tuple[str, str] | None:
    """(the op, the reason) for the first tensor of `gm` whose sizes depend on tensor values,
    or None: the op named is the one that makes the size (`nonzero`, `.item()`'s
    `_local_scalar_dense`), which may come before the tensor that has it."""
    made_by: dict[Any, torch.fx.Node] = {}  # unbacked symbol -> the first node whose value holds it
    for node in gm.graph.nodes:
        values = tree_flatten(node.meta.get("val"))[0]
        for value in values:
            for symbol in _unbacked(value, sizes_only=False):
                made_by.setdefault(symbol, node)
        sized = sorted((s for v in values for s in _unbacked(v, sizes_only=True)), key=str)
        if sized:
            origin = made_by[sized[0]]
            op = op_name(origin.target).removesuffix(".default")
            described = ".item() (_local_scalar_dense)" if op == "_local_scalar_dense" else op
            line = user_line(origin) or user_line(node)
            at = f", at {line}" if line else ""
            return op, (f"{described} gives a size that depends on tensor values ({sized[0]}){at}: ember compiles no "
                        "graph with data-dependent sizes. With torch._dynamo.config."
                        "capture_dynamic_output_shape_ops and capture_scalar_outputs off (torch's default), "
                        "dynamo splits the graph at such an op and ember compiles the rest.")  # fmt: skip
    return None


def _unbacked(value: Any, sizes_only: bool) -> set:
    """The unbacked symbols in a tensor's sizes, strides and offset; unless `sizes_only`, also
    those of a symbolic scalar."""
    if isinstance(value, torch.Tensor):
        return free_unbacked_symbols((*value.shape, *value.stride(), value.storage_offset()))
    if not sizes_only and isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return free_unbacked_symbols(value)
    return set()
