"""The table of lowerings: aten op -> function building UOps.

A lowering is `fn(ctx, node, *args, **kwargs)`: tensor arguments arrive as `TensorValue`s,
everything else as it is in the FX graph. It returns a `TensorValue` (or a tuple of them),
or raises `Unsupported` to hand the node to the fallback extern. An op registered with
`register_extern` has no lowering: its calls are extern kernels by design, not fallbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LOWERINGS: dict[Any, Callable] = {}
# Lowerings of ops that exist only once some part of torch has defined them (prims.fma comes with
# torch._inductor.inductor_prims, which dynamo imports when it first rewrites addcmul_): keyed by
# the schema's name ("prims::fma"), so ember never imports what defines them.
LOWERINGS_BY_NAME: dict[str, Callable] = {}
# Ops with no lowering by design: every call is an extern kernel running the aten op, and is
# not counted as a fallback (Note: special functions, lower/math_functions.py).
EXTERN_BY_DESIGN: set[Any] = set()
# Lowerings that handle float16/bfloat16 wrongly or not at all: those calls go to aten.
FULL_PRECISION_ONLY: set[Callable] = set()


class Unsupported(Exception):
    """This call of a lowered op is outside what the lowering handles: use the fallback."""


def register(*ops: Any, low_precision: bool = True) -> Callable[[Callable], Callable]:
    """Register `fn` for each op: an OpOverloadPacket covers all its overloads. With
    `low_precision=False`, calls touching float16/bfloat16 use the fallback instead."""

    def wrap(fn: Callable) -> Callable:
        for op in ops:
            LOWERINGS[op] = fn
        if not low_precision:
            FULL_PRECISION_ONLY.add(fn)
        return fn

    return wrap


def register_by_name(*names: str) -> Callable[[Callable], Callable]:
    """Register `fn` for the ops whose schema is named `names` (every overload)."""

    def wrap(fn: Callable) -> Callable:
        for name in names:
            LOWERINGS_BY_NAME[name] = fn
        return fn

    return wrap


def register_extern(*packets: Any) -> None:
    """Declare that every overload of each packet runs as an aten extern kernel, on every backend."""
    EXTERN_BY_DESIGN.update(packets)


def lookup(target: Any) -> Callable | None:
    if target in LOWERINGS:
        return LOWERINGS[target]
    packet = getattr(target, "overloadpacket", None)
    if packet in LOWERINGS:
        return LOWERINGS[packet]
    schema = getattr(target, "_schema", None)
    return LOWERINGS_BY_NAME.get(schema.name) if schema is not None else None
