"""Fake-tensor metadata for nodes that passes build or change.

Lowering reads each node's `meta["val"]` (a FakeTensor: shape, dtype, strides), so a pass
that inserts a node, or changes what a node's inputs look like (a different layout), must
recompute it. `call` builds a node with its metadata; `repropagate` recomputes the nodes
downstream of a layout change. Both run the op on the fake values of its arguments, under the fake
mode AOTAutograd traced with: no real computation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ember.ir import same_sizes


def fake_value(node: torch.fx.Node) -> Any:
    # A getitem's only input is a tuple of fake tensors (max_pool2d_with_indices'); detect_fake_mode
    # looks inside it. Under AOTAutograd the tracing context names the mode anyway, but a graph
    # specialized per shape at its call (shape_specialization.py) has only its nodes' values.
    metas = [n.meta.get("val") for n in node.all_input_nodes]
    fake_mode = detect_fake_mode(metas)
    if fake_mode is None:
        raise ValueError(f"no fake tensor among the arguments of {node.target} ({node.name})")
    with unset_fake_temporarily():
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _fake_of(n, fake_mode))
        with fake_mode:
            return node.target(*args, **kwargs)  # type: ignore[operator]


def cpu_float32(*nodes: Any) -> bool:
    """Every one of `nodes` is an FX node whose value is a float32 tensor on the CPU."""
    for node in nodes:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.device.type != "cpu":
            return False
    return True


def _fake_of(node: torch.fx.Node, fake_mode: Any) -> Any:
    """A node's fake value; a constant (get_attr) that has none gets one from its tensor."""
    if "val" not in node.meta and node.op == "get_attr" and node.graph.owning_module is not None:
        value = getattr(node.graph.owning_module, node.target)  # type: ignore[arg-type]
        node.meta["val"] = fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
    return node.meta.get("val")


def call(graph: torch.fx.Graph, target: Any, args: tuple, kwargs: dict | None = None, like: Any = None
         ) -> torch.fx.Node:  # fmt: skip
    """A new call_function node (at the graph's insertion point) with its fake value; `like`:
    the fake value of a node it replaces that computes the same tensor (same shape, dtype and
    strides), which saves running the op under fake mode (milliseconds per new op)."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = fake_value(node) if like is None else like
    return node


def repropagate(graph: torch.fx.Graph, changed: set[torch.fx.Node]) -> None:
    """Recompute the fake value of every call downstream of `changed` (nodes whose value
    changed), in order; a node whose recomputed value has its old layout stops the spread."""
    changed = set(changed)
    for node in graph.nodes:
        if node.op != "call_function" or (node not in changed and not changed.intersection(node.all_input_nodes)):
            continue
        old, node.meta["val"] = node.meta.get("val"), _fake_value_of_moved(node)
        if node not in changed and _same_layouts(old, node.meta["val"]):
            continue
        changed.add(node)


# views whose new input layout may not be viewable as asked, and the op that gives the same values
VIEW_OR_COPY = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
                torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}  # fmt: skip


def _fake_value_of_moved(node: torch.fx.Node) -> Any:
    """`node`'s fake value over inputs whose layout changed. A view the new layout cannot give (an
    NHWC activation flattened to (N * C, H * W), which eager viewed in NCHW) becomes a reshape:
    the same values, copied where no view has them; lowering reads either as index math."""
    try:
        return fake_value(node)
    except (RuntimeError, ValueError):  # (torch raises either, by version and path)
        if node.target not in VIEW_OR_COPY:
            raise
        node.target = VIEW_OR_COPY[node.target]  # type: ignore[index]
        return fake_value(node)


def _same_layouts(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_layouts(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return same_layout(a, b) and same_sizes((a.storage_offset(),), (b.storage_offset(),))
    return True


def same_layout(a: Any, b: Any) -> bool:
    """Same shape, dtype, device and strides (a value can stand in for the other); a symbolic size
    equals only the same expression (Note: symbolic sizes)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return (a.dtype, a.device) == (b.dtype, b.device) and same_sizes(tuple(a.shape), tuple(b.shape)) and \
        same_sizes(_strides(a), _strides(b))  # fmt: skip


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides that matter: a dim of size 1 may have any stride."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if not (type(n) is int and n == 1))
