"""The table of lowerings: aten op -> function building UOps.

A lowering is `fn(ctx, node, *args, **kwargs)`: tensor arguments arrive as `TensorValue`s,
everything else as it is in the FX graph. It returns a `TensorValue` (or a tuple of them),
or raises `Unsupported` to hand the node to the fallback extern.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LOWERINGS: dict[Any, Callable] = {}


class Unsupported(Exception):
    """This call of a lowered op is outside what the lowering handles: use the fallback."""


def register(*ops: Any) -> Callable[[Callable], Callable]:
    """Register `fn` for each op: an OpOverloadPacket covers all its overloads."""

    def wrap(fn: Callable) -> Callable:
        for op in ops:
            LOWERINGS[op] = fn
        return fn

    return wrap


def lookup(target: Any) -> Callable | None:
    if target in LOWERINGS:
        return LOWERINGS[target]
    packet = getattr(target, "overloadpacket", None)
    return LOWERINGS.get(packet)
