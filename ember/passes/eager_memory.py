"""Stage `passes`: the memory an aten FX graph holds at each node when run one op at a time, as
eager runs it, so that a rewrite can tell whether a temporary of its own raises the peak.

Each node that computes allocates its result (every tensor of its fake value) and frees it after
the last node that reads it or a view of it; views allocate nothing; graph outputs stay to the
end. Inputs exist before the call: benchmarks/memory.py (Note: how peak memory is measured) does
not count them, but one that dies during the call lowers what is live after it, so they are
counted as well, dying at their last use, and the smaller headroom of the two is kept, unless
the caller is known to hold every input (`INPUTS_HELD`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from ember.uop.variables import size_hint

# GraphModule.meta key, set by the frontend on forward and inference graphs: the caller holds every
# input through the call (the module its parameters, the user's frame its arguments), so none dies
# in it. A backward's inputs are the forward's saved tensors, which AOTAutograd hands over and which
# die at their last use (wrapper/python.py, Note: inputs die at their last use). Part of the graph key.
INPUTS_HELD = "ember_inputs_held"


def headroom_bytes(graph: torch.fx.Graph, inputs_held: bool = False) -> dict[torch.fx.Node, int]:
    """For each computing node, how many bytes more than its result it may hold while it runs
    without raising the graph's peak: the peak less what is live once its result exists.

    `inputs_held`: the caller holds every input (`INPUTS_HELD`). Otherwise whether it keeps an
    input alive is unknown (a weight stays; a backward's saved activation dies at its last use),
    so both are tried and the smaller headroom is kept: with inputs dying, the peak may come
    early, while they are all live, leaving a later node less room than their staying would."""
    owner = _storage_owners(graph)
    last_use = _last_uses(graph, owner)
    kept = _headroom(graph, owner, last_use, inputs_die=False)
    if inputs_held:
        return kept
    dying = _headroom(graph, owner, last_use, inputs_die=True)
    return {node: min(room, dying[node]) for node, room in kept.items()}


def _headroom(graph: torch.fx.Graph, owner: dict, last_use: dict[torch.fx.Node, int], inputs_die: bool) -> dict:
    counted = ("call_function", "placeholder") if inputs_die else ("call_function",)
    frees: dict[int, list[torch.fx.Node]] = {}
    for node, index in last_use.items():
        if node.op in counted:
            frees.setdefault(index, []).append(node)
    live, peak, live_at = 0, 0, {}
    for index, node in enumerate(graph.nodes):
        if owner[node] is node and node.op in counted:
            live += _result_bytes(node)
            live_at[node] = live
        peak = max(peak, live)
        live -= sum(_result_bytes(n) for n in frees.get(index, ()))
    return {node: peak - at for node, at in live_at.items() if node.op == "call_function"}


def _storage_owners(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each node -> the node whose allocation it refers to (itself unless it is a view)."""
    owner: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        source = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        aliases = node.target is operator.getitem or _returns_view(node.target)
        owner[node] = owner[source] if source is not None and aliases else node
    return owner


def _returns_view(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _last_uses(graph: torch.fx.Graph, owner: dict[torch.fx.Node, torch.fx.Node]) -> dict[torch.fx.Node, int]:
    """Each allocating node -> the index of the last node that reads it; outputs are never freed."""
    last: dict[torch.fx.Node, int] = {}
    returned: set[torch.fx.Node] = set()
    for index, node in enumerate(graph.nodes):
        for value in node.all_input_nodes:
            last[owner[value]] = index
            if node.op == "output":
                returned.add(owner[value])
    return {n: i for n, i in last.items() if n not in returned and n.op in ("call_function", "placeholder")}


def _result_bytes(node: torch.fx.Node) -> int:
    if node.op not in ("call_function", "placeholder"):
        return 0
    values, _ = tree_flatten(node.meta.get("val"))
    # at the example's sizes where they are symbolic: headroom is an estimate (Note: symbolic sizes)
    return sum(size_hint(v.numel()) * v.element_size() for v in values if isinstance(v, torch.Tensor))
