"""Note: room on Python's frame stack (ember/stack_room.py): a loop calling a function from
just below the end of a frame-stack chunk takes and gives back a chunk per call (CPython 3.11
and 3.12), each faulting in a fresh page; under `with_stack_room` no depth does. Counted in page
faults of this thread, never timed."""

import resource
import sys
import types

from ember.stack_room import with_stack_room

CALLS = 500
DEPTHS = range(0, 400)  # a chunk holds some 80 of these frames: several chunk ends


def _leaf() -> None:
    return None


# a frame larger than faults_calling_at's, so that for each chunk end some depth leaves too little
# room for it (a frame's size is its code's co_stacksize plus its locals)
leaf = types.FunctionType(_leaf.__code__.replace(co_stacksize=200), {})


def faults_calling_at(depth: int) -> int:
    """Page faults of CALLS calls of `leaf` made from `depth` frames further down."""
    if depth:
        return faults_calling_at(depth - 1)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(CALLS):
        leaf()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_no_depth_takes_a_chunk_per_call_with_stack_room():
    faults_with_room = max(with_stack_room(faults_calling_at, depth) for depth in DEPTHS)
    assert faults_with_room < CALLS // 10, faults_with_room
    if sys.version_info < (3, 13):  # the interpreter that thrashes without it (CPython gh-142183)
        faults_without = max(faults_calling_at(depth) for depth in DEPTHS)
        assert faults_without >= CALLS, faults_without


def test_with_stack_room_passes_arguments_and_results_and_errors():
    assert with_stack_room(lambda a, b=0: (a, b), 1, b=2) == (1, 2)
    try:
        with_stack_room(int, "not a number")
    except ValueError as e:
        assert "not a number" in str(e)
    else:
        raise AssertionError("the error did not pass through")


def test_ember_compiles_with_stack_room(tmp_path, monkeypatch):
    """The frontend gives a compile its room: a graph pass (run inside compile_graph) loops at
    every depth without taking a chunk per call."""
    import torch

    import ember

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    seen = []
    compiled = ember.compile(lambda x: x.sin() + 1, dynamic=False, strict=True,
                             pre_passes=(lambda graph: seen.append(max(map(faults_calling_at, DEPTHS))),))  # fmt: skip
    x = torch.randn(8)
    torch.testing.assert_close(compiled(x), x.sin() + 1)
    assert len(seen) == 1 and seen[0] < CALLS // 10, seen
