"""Room on Python's frame stack for a compile (frontend: AOTAutograd and every ember stage).

Note: room on Python's frame stack
    CPython 3.11 and 3.12 keep a thread's Python frames in chunks of memory (16 KiB and more),
    each taken from the OS (mmap) when a call does not fit in the current one and given back
    (munmap) when the first frame in it returns. A loop that calls a function from a frame just
    below a chunk's end takes a chunk and gives it back on every call, and each fresh chunk
    faults its pages in again (CPython's gh-142183; 3.13 and 3.14 keep one chunk spare). Where
    the ends fall is an accident of how deep the caller is: compiling a 12-layer GPT-2 training
    step, torch's min-cut partitioner (networkx's max-flow, called from AOTAutograd in
    ember's backend) ran across one, with 420,000 mmap/munmap pairs and 2.4 s of CPU, 1.6 s of it
    the kernel's page faults, for a cut that takes 0.2 s at another depth (under inductor, too).

    `with_stack_room` calls a function from a frame that asks for ROOM_SLOTS slots of evaluation
    stack it never uses. That frame does not fit in a 16 KiB chunk, so it starts a chunk of its
    own, sized to hold it with as much again behind it, and every frame of the call lives in
    that room: no chunk end is crossed until the call is ROOM_SLOTS * 8 bytes (512 KiB, some
    2,000 frames) deep. The cost is one mmap per call and the few pages the frames touch.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

Result = TypeVar("Result")

ROOM_SLOTS = 1 << 16


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    return fn(*args, **kwargs)


# the same function with a frame ROOM_SLOTS slots larger (CPython sizes a frame by co_stacksize)
_call_with_room = types.FunctionType(
    _call.__code__.replace(co_stacksize=_call.__code__.co_stacksize + ROOM_SLOTS), {}, "call_with_room"
)


def with_stack_room(fn: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
    """`fn(*args, **kwargs)`, with its frames in a stack chunk of their own (Note: room on
    Python's frame stack)."""
    return _call_with_room(fn, args, kwargs)
