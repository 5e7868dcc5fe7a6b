"""Cache hints for loads (codegen/eviction.py, Note: cache hints for loads), on block programs
built without a device."""

from ember.codegen.eviction import DROP, KEEP, eviction_hints
from ember.codegen.phases import block_rewrite
from ember.uop.dtypes import dtypes
from ember.uop.ops import Ops, RangeKind, UOp
from tests.test_block_lowering import _buffer, _load, _store, programs, softmax


def scaled_row_sums(rows: int, width: int) -> UOp:
    """out[i] = sum_j x[i, j] * w[j]: w is the same row for every program."""
    x, w, out = _buffer("p1", rows * width), _buffer("p2", width), _buffer("p0", rows)
    i, j = UOp.range(rows, 0), UOp.range(width, 0, RangeKind.REDUCE)
    total = UOp(Ops.REDUCE, dtypes.float32, (_load(x, i * width + j) * _load(w, j), j), Ops.ADD)
    return block_rewrite(UOp(Ops.SINK, dtypes.void, (_store(out, i, total),)), check=True)


def hints_by_buffer(program: list[UOp]) -> list[tuple[str, str | None]]:
    hints = eviction_hints(program)
    return [(u.src[0].src[0].arg.name, hints.get(u)) for u in program if u.op is Ops.LOAD]


def test_a_row_every_program_reads_is_kept_and_a_streamed_one_is_not():
    for program in programs(scaled_row_sums(64, 4096)).values():
        assert hints_by_buffer(program) == [("p1", None), ("p2", KEEP)]


def test_a_looped_pass_that_reads_its_row_again_keeps_it_and_the_last_pass_drops_it():
    found = programs(softmax(64, 4096))
    assert hints_by_buffer(found["looped"]) == [("p1", KEEP), ("p1", DROP)]
    assert hints_by_buffer(found["persistent"]) == [("p1", None)]  # one load: nothing to keep it for


def test_hints_reach_the_rendered_loads():
    from ember.renderer.triton import render_body

    program = programs(softmax(64, 4096))["looped"]
    lines = "\n".join(render_body(program, [], 32))
    assert lines.count("eviction_policy='evict_last'") == 1 and lines.count("eviction_policy='evict_first'") == 1
