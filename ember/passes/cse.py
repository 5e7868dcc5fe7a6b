"""Common subexpressions: calls of the aten graph that compute the same value become one call.

AOTAutograd's partitioner merges equal calls in training graphs only; an inference graph
reaches ember as dynamo traced it, repeats and all. Models repeat work per layer that does
not depend on the layer: T5's attention bias `position_bias.contiguous()` once per layer (six
copies of one 8 x 128 x 128 gather at batch 1, each an ember kernel), LLaMA's mask conversion
per layer. A call is merged into an earlier one with the same target, the same arguments (the
same nodes, equal constants of the same type) and the same keyword arguments.

Never merged:
  - impure calls (`Node.is_impure`: mutations, random draws, asserts) and everything in a
    graph that mutates anything: there two equal calls may read different values (noops.py
    `mutates`);
  - two calls that the graph both returns (directly or through views): the caller would get
    two outputs sharing storage where eager gives two tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ember.passes.noops import mutates, returned


def eliminate_common_subexpressions(graph: torch.fx.Graph) -> int:
    """Merges equal pure calls (module docstring); returns how many calls were removed."""
    if mutates(graph):
        return 0
    first: dict[Any, torch.fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):  # topological: a merge rewrites the arguments of later calls first
        if node.op != "call_function" or node.is_impure():
            continue
        key = _call_key(node)
        if key is None:
            continue
        kept = first.setdefault(key, node)
        if kept is node or (returned(kept) and returned(node)):
            continue
        node.replace_all_uses_with(kept)
        graph.erase_node(node)
        merged += 1
    return merged


def _call_key(node: torch.fx.Node) -> Any:
    """What identifies the value of a pure call, or None where an argument has no exact key."""
    try:
        return node.target, _exact(node.args), _exact(tuple(sorted(node.kwargs.items())))
    except _NoKey:
        return None


class _NoKey(Exception):
    pass


def _exact(value: Any) -> Any:
    """`value` as a hashable key that equals another only for the same argument: nodes by
    identity; constants with their type (1, 1.0 and True promote differently) and floats by
    their bits (0.0 and -0.0 are equal in Python, not in a result)."""
    if isinstance(value, torch.fx.Node):
        return value
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_exact(v) for v in value)
    if isinstance(value, float):
        return float, value.hex()
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):  # fmt: skip
        return type(value), value
    raise _NoKey(type(value).__name__)
