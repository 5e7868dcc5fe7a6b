"""Frontend helper: run a long compile step with the interpreter's frame stack far from a chunk end.

Note: frame stack chunks
    CPython (3.11 on) keeps the frames of Python calls on a per-thread stack made of chunks,
    16 KiB each by default. A call whose frame does not fit in what is left of the current
    chunk gets a new chunk (an mmap), and when that frame returns the chunk is unmapped at once
    (an munmap) — nothing keeps a spare one (CPython issue gh-142183). So a loop that calls a
    function many times from a frame sitting just short of a chunk's end pays a map, a page
    fault and an unmap on every call: about 4 us instead of a few tens of ns on this machine.
    Whether that happens is luck: it depends on how deep the caller sits. torch's min-cut
    partitioner (networkx's max-flow, hundreds of thousands of calls) and AOTAutograd's tracing
    hit it at the depth ember's backend runs them on GPT-2 training: 312k map/unmap pairs of
    the 500k in a whole-step AdamW compile came from under `ember_backend` (strace -c).

    `call_with_frame_room(fn, *args)` calls `fn` through a frame declared with a large value
    stack (`co_stacksize`, of which it uses a few slots). That frame cannot fit in a 16 KiB
    chunk, so CPython gives it a chunk of its own sized to the next power of two above it: the
    frame takes the first half and `fn` with everything it calls gets the second half, FRAME_ROOM
    bytes, with no chunk end in it unless the calls nest deeper than that. The unused slots are
    never written, so the chunk's pages that no frame reaches are never touched. One map per
    call of `fn` replaces one per inner call at an unlucky depth.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# the bytes of frame stack `fn` gets: some thousands of frames (a frame takes about 100 to 600
# bytes), deeper than Python's default recursion limit lets code nest
FRAME_ROOM = 1 << 20
_SLOT_BYTES = 8  # one value-stack slot is one object pointer


def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return fn(*args, **kwargs)


_roomy_call = types.FunctionType(_call.__code__.replace(co_stacksize=FRAME_ROOM // _SLOT_BYTES), _call.__globals__)


def call_with_frame_room(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, run at the start of a frame stack chunk with FRAME_ROOM bytes free
    (Note: frame stack chunks)."""
    return _roomy_call(fn, *args, **kwargs)
