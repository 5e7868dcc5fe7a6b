"""No-op removal: calls whose result is their input, replaced by that input.

x + 0, x - 0, x * 1, x / 1, x ** 1, a clone or a dtype conversion that changes nothing, and
any chain of views that ends where it began (a view to the same shape, permutes or
transposes that cancel, unsqueeze then squeeze, a full slice). Every rule checks the
fake-tensor metadata: the input must have the result's shape, dtype, device, strides and
offset, so a broadcast, a type promotion or a layout change is never removed.

Two things a value-only view would miss, both guarded:
  - a copy (clone, x + 0) is a snapshot: in a graph that mutates anything the pass does
    nothing at all;
  - a copy of a graph input returned by the graph is a fresh tensor in eager; replacing it
    with the input would hand the caller its own input back, so that copy stays.
"""

from __future__ import annotations

import torch
import torch.fx

from ember.passes.matcher import FxPat, FxPatternMatcher
from ember.passes.meta import same_layout

aten = torch.ops.aten

VIEWS = (
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default, aten.t.default,
    aten.transpose.int, aten.expand.default, aten.slice.Tensor, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.unsqueeze.default, aten.alias.default,
)  # fmt: skip


def copy_of(node: torch.fx.Node, x: object) -> torch.fx.Node | None:
    """`x` in place of a call that copies it, when nothing can tell the difference. A clone
    that names a memory format is a layout request (layout.py) that lowering honours: kept."""
    if "memory_format" in node.kwargs or not isinstance(x, torch.fx.Node) or not _same_value(node, x):
        return None
    if _input_view(x) and returned(node):
        return None
    return x


def view_of_itself(node: torch.fx.Node) -> torch.fx.Node | None:
    """The first view ancestor (through views only) that is the very same tensor view."""
    source = node.args[0]
    while isinstance(source, torch.fx.Node):
        if _same_value(node, source):
            return source
        if source.op != "call_function" or source.target not in VIEWS:
            return None
        source = source.args[0]
    return None


def _same_value(node: torch.fx.Node, x: torch.fx.Node) -> bool:
    a, b = node.meta.get("val"), x.meta.get("val")
    return same_layout(a, b) and a.storage_offset() == b.storage_offset()  # type: ignore[union-attr]


def _input_view(node: torch.fx.Node) -> bool:
    while node.op == "call_function" and node.target in VIEWS and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node.op == "placeholder"


def returned(node: torch.fx.Node) -> bool:
    """Does the graph return `node`, or a view of it?"""
    for user in node.users:
        if user.op == "output" or (user.op == "call_function" and user.target in VIEWS and returned(user)):
            return True
    return False


x = FxPat.var("x")
pm_noops = FxPatternMatcher([
    (FxPat(aten.add.Tensor, x, 0), copy_of),            # x + 0 -> x
    (FxPat(aten.sub.Tensor, x, 0), copy_of),            # x - 0 -> x
    (FxPat(aten.mul.Tensor, x, 1), copy_of),            # x * 1 -> x
    (FxPat(aten.div.Tensor, x, 1), copy_of),            # x / 1 -> x
    (FxPat(aten.pow.Tensor_Scalar, x, 1), copy_of),     # x ** 1 -> x
    (FxPat(aten.clone.default, x), copy_of),            # clone(x) -> x (same layout)
    (FxPat(aten._to_copy.default, x), copy_of),         # x.to(x.dtype) -> x
    (FxPat(VIEWS), view_of_itself),                     # view(...view(x)) -> x when it is x again
])  # fmt: skip


def mutates(graph: torch.fx.Graph) -> bool:
    """Does any call write to one of its arguments (copy_, an in-place op, an out= op)?"""
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.is_mutable:
            return True
    return False


def remove_noops(graph: torch.fx.Graph) -> int:
    """Returns how many calls were removed."""
    if mutates(graph):
        return 0
    return pm_noops.apply(graph)
