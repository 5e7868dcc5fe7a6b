"""A small pattern matcher over aten FX graphs: `FxPat` patterns, `FxPatternMatcher` tables.

The FX counterpart of uop/pattern.py. A pass is a table of `(FxPat, function)` rules; the
function receives the pattern's named captures as keyword arguments (plus `graph` and
`node`, the matched root, when it names them) and returns the node that replaces `node`
(an existing one, or one it built), or None to decline. New nodes a rule builds with
`graph.call_function` are inserted before the matched node, and meta.py's `call` fills in their
fake-tensor metadata, which lowering reads. `FxPatternMatcher.apply` walks the graph in
order, replaces, and repeats until nothing changes.

    pm_example = FxPatternMatcher([
        (FxPat(aten.mul.Tensor, FxPat.var("x"), 1), lambda x: x),   # x*1 -> x
    ])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx

Rule = tuple["FxPat", Callable[..., Any]]

MAX_ROUNDS = 16


class FxPat:
    """Matches an FX node calling `target` (an OpOverload, an OpOverloadPacket for every
    overload, or a tuple of them) whose arguments match `args` position by position: a
    sub-pattern, or a literal compared with ==. `name` captures the matched node or value;
    `one_user` requires the node to have exactly one user (a rewrite that absorbs it must
    not leave other readers without it)."""

    def __init__(self, target: Any = None, *args: Any, name: str | None = None, one_user: bool = False,
                 **kwargs: Any):  # fmt: skip
        self.targets = None if target is None else (target if isinstance(target, tuple) else (target,))
        self.args, self.kwargs, self.name, self.one_user = args, kwargs, name, one_user

    @staticmethod
    def var(name: str | None = None) -> FxPat:
        """Anything: a node, a literal, None."""
        return FxPat(name=name)

    def match(self, value: Any, captures: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Every way `value` matches, as the extended capture dicts."""
        if self.targets is not None:
            if not isinstance(value, torch.fx.Node) or value.op != "call_function":
                return
            if not any(_same_target(value.target, t) for t in self.targets):
                return
            if self.one_user and len(value.users) != 1:
                return
        if self.name is not None:
            if self.name in captures and captures[self.name] is not value:
                return
            captures = {**captures, self.name: value}
        if self.targets is None:
            yield captures
            return
        yield from _match_args(self, value, captures)


def _same_target(target: Any, wanted: Any) -> bool:
    if isinstance(wanted, torch._ops.OpOverloadPacket):
        return getattr(target, "overloadpacket", None) is wanted
    return target is wanted


def _match_args(pattern: FxPat, node: torch.fx.Node, captures: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Positional patterns against the node's positional args; keyword patterns against
    its kwargs (a keyword the node does not pass does not match)."""
    if len(pattern.args) > len(node.args) or any(k not in node.kwargs for k in pattern.kwargs):
        return
    pairs = list(zip(pattern.args, node.args)) + [(p, node.kwargs[k]) for k, p in pattern.kwargs.items()]
    yield from _match_pairs(pairs, captures)


def _match_pairs(pairs: list[tuple[Any, Any]], captures: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if not pairs:
        yield captures
        return
    (pattern, value), rest = pairs[0], pairs[1:]
    if isinstance(pattern, FxPat):
        for extended in pattern.match(value, captures):
            yield from _match_pairs(rest, extended)
    elif not isinstance(value, torch.fx.Node) and _same_literal(pattern, value):
        yield from _match_pairs(rest, captures)


def _same_literal(pattern: Any, value: Any) -> bool:
    """1 matches 1 and 1.0, but never True: bools are flags, not numbers, in aten calls."""
    if isinstance(pattern, bool) or isinstance(value, bool):
        return pattern is value
    return bool(pattern == value)


class FxPatternMatcher:
    """A table of rules, tried in order on each node; the first that returns a value wins."""

    def __init__(self, rules: list[Rule]):
        self.rules = [(pattern, fn, set(inspect.signature(fn).parameters)) for pattern, fn in rules]

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node) -> Any:
        """The replacement for `node`, or None when no rule applies."""
        for pattern, fn, wants in self.rules:
            for captures in pattern.match(node, {}):
                extra = {k: v for k, v in (("graph", graph), ("node", node)) if k in wants}
                with graph.inserting_before(node):
                    result = fn(**{k: v for k, v in captures.items() if k in wants}, **extra)
                if result is not None:
                    return result
        return None

    def apply(self, graph: torch.fx.Graph) -> int:
        """Rewrite `graph` in place until no rule applies (at most MAX_ROUNDS sweeps);
        returns how many nodes were replaced."""
        replaced = 0
        for _ in range(MAX_ROUNDS):
            changed = 0
            for node in list(graph.nodes):
                if node.graph is not graph or node.op != "call_function":
                    continue  # erased by an earlier rewrite in this sweep
                result = self.rewrite(graph, node)
                if result is None or result is node:
                    continue
                node.replace_all_uses_with(result)
                graph.erase_node(node)
                changed += 1
            replaced += changed
            if not changed:
                break
        return replaced
