"""Buffer lifetimes over an ordered schedule: last uses, and the peak of live bytes.

The same simulation answers "where is each buffer freed" (for the wrapper) and "would this
fusion raise peak memory" (for the fusion loop): allocate a step's stored outputs when it
runs, free each buffer after the last step that reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def last_use_positions(steps: Sequence, reads: Callable, writes: Callable, keep: set[str]) -> dict[str, int]:
    """For each buffer not in `keep`, the index of the last step that touches it."""
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in [*reads(step), *writes(step)]:
            if name not in keep:
                last[name] = i
    return last


def peak_bytes(steps: Sequence, reads: Callable, writes: Callable, nbytes: Callable, never_freed: set[str]) -> int:
    """Peak of live bytes of the buffers the steps write; those in `never_freed` (outputs)
    stay live to the end."""
    frees_at: dict[int, list[str]] = {}
    for name, i in last_use_positions(steps, reads, writes, never_freed).items():
        frees_at.setdefault(i, []).append(name)
    live = peak = 0
    allocated: set[str] = set()
    for i, step in enumerate(steps):
        for b in writes(step):
            if b not in allocated:
                allocated.add(b)
                live += nbytes(b)
        peak = max(peak, live)
        for b in frees_at.get(i, []):
            if b in allocated:
                live -= nbytes(b)
    return peak
