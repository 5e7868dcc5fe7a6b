"""Memory planning over the wrapper's lines (after TorchInductor's wrapper).

Walks the lines keeping a pool of freed buffers keyed by (dtype, storage bytes). An
Allocate that finds a buffer of its key in the pool takes it over (Reuse) and the old
buffer's FreeIfNotReused becomes Null — unless holding the old buffer from its free to
this allocation would raise the estimated peak (the live bytes between the two points
plus the buffer's size must stay within the peak). Graph inputs and outputs are never
freed, so they are never reused.
"""

from __future__ import annotations

from ember.wrapper import lines as L


def nbytes(buffer) -> int:
    return buffer.layout.storage_size * buffer.dtype.itemsize


def live_bytes(lines: list) -> list[int]:
    """Bytes held by wrapper-allocated buffers after each line."""
    live, timeline = 0, []
    for line in lines:
        if isinstance(line, L.Allocate):
            live += nbytes(line.buffer)
        elif isinstance(line, (L.ExternCall, L.Unpack)):
            live += sum(nbytes(b) for b in _extern_outputs(line))
        elif isinstance(line, L.FreeIfNotReused):
            live -= nbytes(line.buffer)
        timeline.append(live)
    return timeline


def _extern_outputs(line) -> list:
    if isinstance(line, L.Unpack):
        return [line.buffer]
    return line.outputs if line.single else []


def planned_peak(lines: list) -> int:
    return max(live_bytes(lines), default=0)


def plan_memory(lines: list) -> tuple[list, int]:
    """The lines with reuse applied, and their planned peak bytes."""
    lines = list(lines)
    timeline = live_bytes(lines)
    peak = max(timeline, default=0)
    pool: dict[tuple, list[int]] = {}  # key -> indices of FreeIfNotReused lines
    for i, line in enumerate(lines):
        if isinstance(line, L.FreeIfNotReused) and _reusable(line.buffer):
            pool.setdefault(_key(line.buffer), []).append(i)
        elif isinstance(line, L.Allocate) and pool.get(_key(line.buffer)):
            size = nbytes(line.buffer)
            for j in reversed(pool[_key(line.buffer)]):
                if max(timeline[j:i], default=0) + size <= peak:
                    pool[_key(line.buffer)].remove(j)
                    old = lines[j].buffer
                    lines[j] = L.Null()
                    lines[i] = L.Reuse(old, line.buffer)
                    timeline = live_bytes(lines)
                    break
    return lines, planned_peak(lines)


def _key(buffer) -> tuple:
    return (buffer.dtype, nbytes(buffer))


def _reusable(buffer) -> bool:
    return buffer.kind == "computed" and nbytes(buffer) > 0
