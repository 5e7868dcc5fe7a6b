"""Python's cyclic garbage collector paused while ember compiles (frontend and compile_graph).

Note: no garbage collection while compiling
    A compile allocates millions of small objects (UOps, FX nodes, fake tensors) that stay alive
    until it ends, and each full collection walks every object of the process: the model, its
    FX graphs, torch's own state. Full collections come at a rate set by allocations, so their
    total cost grew faster than the graph (a 24-layer GPT-2 training step spent 4.6x the
    12-layer one's collection time inside compile_graph). Cycles made while compiling are
    collected by the first collection after it. Pausing is process-wide state, counted under a
    lock: nested or concurrent compiles pause once, the last one out resumes, and a collector
    the user turned off stays off.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_paused = 0  # compiles running with the collector paused
_resume = False  # whether the collector was on when the first of them began


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    global _paused, _resume
    with _lock:
        if _paused == 0:
            _resume = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _lock:
            _paused -= 1
            if _paused == 0 and _resume:
                gc.enable()
