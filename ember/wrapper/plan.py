"""Memory planning over the wrapper's lines (after TorchInductor's wrapper).

Walks the lines keeping a pool of freed buffers keyed by (dtype, storage bytes). An
Allocate that finds a buffer of its key in the pool takes it over (Reuse) and the old
buffer's FreeIfNotReused becomes Null — unless holding the old buffer from its free to
this allocation would raise the estimated peak (the live bytes between the two points
plus the buffer's size must stay within the peak). Graph inputs and outputs are never
freed, so they are never reused.

Note: the peak with dying inputs
    A backward's inputs (the forward's saved tensors) die at their last use (wrapper/python.py,
    Note: inputs die at their last use), so its real peak may come where its own buffers are
    not at theirs: in BERT's backward, where the first feed-forward gradients (3 MiB) appear
    while most saved activations still live. Holding a dead 4 KiB buffer over that point for
    a later reuse raised the step's peak above eager's. So a hold must fit under the peak of
    two timelines: the wrapper's buffers alone (inputs held by the caller, as in a forward),
    and those plus the inputs, each dropped at its `Del`. Declining a reuse never raises a peak:
    the old buffer is freed where it dies and the new one allocated where it is needed. A kernel
    writing over a donated input (Note: donated inputs, donation.py) makes the input's bytes the
    wrapper's from its Reuse line on, in both timelines.
"""

from __future__ import annotations

from ember.schedule.ranges import RangeMax
from ember.uop.variables import index_size, size_hint
from ember.wrapper import lines as L


def nbytes(buffer) -> int:
    """Bytes of a buffer; of a symbolic one, at the sizes the graph was compiled with (an estimate
    for the peak, never a reason to reuse: Note: symbolic sizes)."""
    return size_hint(buffer.layout.storage_size) * buffer.dtype.itemsize


def live_bytes(lines: list, inputs_die: bool = False) -> list[int]:
    """Bytes held by wrapper-allocated buffers after each line; with `inputs_die`, also by the
    graph's inputs, each until the `Del` of its name (Note: the peak with dying inputs)."""
    inputs = {line.buffer.name: nbytes(line.buffer) for line in lines if isinstance(line, L.AssertInput)}
    inputs = inputs if inputs_die else {}
    live, timeline = sum(inputs.values()), []
    for line in lines:
        if isinstance(line, L.Del):
            live -= sum(inputs.pop(name, 0) for name in line.names)
        elif isinstance(line, L.Allocate):
            live += nbytes(line.buffer)
        elif isinstance(line, (L.ExternCall, L.Unpack)):
            live += sum(nbytes(b) for b in _extern_outputs(line))
        elif isinstance(line, L.FreeIfNotReused):
            live -= nbytes(line.buffer)
        elif isinstance(line, L.Reuse) and line.old.kind == "input":  # a kernel's output over a donated input:
            live += nbytes(line.new) - inputs.pop(line.old.name, 0)  # its bytes are the wrapper's from here
        timeline.append(live)
    return timeline


def _extern_outputs(line) -> list:
    if isinstance(line, L.Unpack):
        return [line.buffer]
    return line.outputs if line.single else []


def planned_peak(lines: list) -> int:
    return max(live_bytes(lines), default=0)


def plan_memory(lines: list) -> tuple[list, int]:
    """The lines with reuse applied, and their planned peak bytes.

    A reuse of the buffer freed at line j by the allocation at line i (same bytes) holds it over
    lines j..i-1 and changes nothing after: both timelines get one range addition, and a
    candidate is checked with one range maximum (RangeMax, O(log n) each), so planning is
    near-linear in the wrapper's length."""
    lines = list(lines)
    timelines = [RangeMax(live_bytes(lines)), RangeMax(live_bytes(lines, inputs_die=True))]
    peaks = [t.max(0, len(lines) - 1) if lines else 0 for t in timelines]
    pool: dict[tuple, list[int]] = {}  # key -> indices of FreeIfNotReused lines
    for i, line in enumerate(lines):
        if isinstance(line, L.FreeIfNotReused) and _reusable(line.buffer):
            pool.setdefault(_key(line.buffer), []).append(i)
        elif isinstance(line, L.Allocate) and pool.get(_key(line.buffer)):
            size = nbytes(line.buffer)
            for j in reversed(pool[_key(line.buffer)]):
                if all(t.max(j, i - 1) + size <= peak for t, peak in zip(timelines, peaks)):
                    pool[_key(line.buffer)].remove(j)
                    old = lines[j].buffer
                    lines[j] = L.Null()
                    lines[i] = L.Reuse(old, line.buffer)
                    for t in timelines:
                        t.add(j, i - 1, size)
                    break
    return lines, planned_peak(lines)


def _key(buffer) -> tuple:
    return (buffer.dtype, index_size(buffer.layout.storage_size))  # a symbolic size: the same expression


def _reusable(buffer) -> bool:
    return buffer.kind == "computed" and nbytes(buffer) > 0
