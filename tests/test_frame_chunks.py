"""The frontend runs AOTAutograd and torch's partitioner with room on the interpreter's frame
stack (Note: frame stack chunks, ember/frame_chunks.py), counted in page faults, not timed."""

import resource
import types

import torch

from ember import frontend
from ember.frame_chunks import call_with_frame_room
from tests.helpers import check

CALLS_PER_LEVEL = 400
LEVELS = 300  # a few hundred bytes of frame each: deeper than one 16 KiB chunk holds


def _leaf() -> None:
    return None


# a frame larger than a probe level's, so that some level finds too little of its chunk left for it
_large_leaf = types.FunctionType(_leaf.__code__.replace(co_stacksize=256), globals())


def _page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def probe_chunk_ends(levels: int, worst: list[int]) -> None:
    """Recurses `levels` deep and calls a leaf CALLS_PER_LEVEL times at each level; `worst` gets
    the most page faults one level's calls took. A level just short of a chunk's end maps, touches
    and unmaps a new chunk for every leaf call, so crossing a chunk end costs CALLS_PER_LEVEL faults."""
    if levels == 0:
        return
    before = _page_faults()
    for _ in range(CALLS_PER_LEVEL):
        _large_leaf()
    worst[0] = max(worst[0], _page_faults() - before)
    probe_chunk_ends(levels - 1, worst)


def test_the_probe_sees_a_chunk_end_without_room_and_none_with_it():
    without, within = [0], [0]
    probe_chunk_ends(LEVELS, without)
    call_with_frame_room(probe_chunk_ends, LEVELS, within)
    assert without[0] >= CALLS_PER_LEVEL  # the mechanism is real on this interpreter
    assert within[0] < CALLS_PER_LEVEL // 4


def test_the_partitioner_runs_with_room_on_the_frame_stack(monkeypatch):
    worst, partitions = [0], []
    partition = frontend.PARTITIONERS["min_cut"]

    def probing_partition(*args, **kwargs):
        partitions.append(1)
        probe_chunk_ends(LEVELS, worst)
        return partition(*args, **kwargs)

    monkeypatch.setitem(frontend.PARTITIONERS, "min_cut", probing_partition)

    def step(x, w):
        return (x @ w).tanh().sum()

    x, w = torch.randn(8, 16), torch.randn(16, 4, requires_grad=True)
    check(step, x, w)  # compiles forward and backward through the partitioner, and compares with eager
    assert partitions and worst[0] < CALLS_PER_LEVEL // 4
