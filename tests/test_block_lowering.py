"""Block lowering (codegen/block_lowering.py, Note: block lowering): a kernel AST and its block
plan as block UOps, checked against the spec's block stage and linearized, without a device."""

import pytest

from ember.codegen.blocks import BlockLimits, plan_blocks
from ember.codegen.linearize import linearize
from ember.codegen.phases import block_lowering, block_rewrite
from ember.uop.dtypes import dtypes
from ember.uop.ops import BlockAxis, BufferArg, Ops, RangeKind, UOp
from ember.uop.spec import IRError, Stage, verify


def _buffer(name, size):
    return UOp(Ops.BUFFER, dtypes.float32, (), BufferArg(name, size))


def _load(buffer, index):
    return UOp(Ops.LOAD, buffer.dtype, (UOp(Ops.INDEX, buffer.dtype, (buffer, index)),))


def _store(buffer, index, value):
    return UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, buffer.dtype, (buffer, index)), value))


def softmax(rows: int, width: int) -> UOp:
    """out[i, k] = exp(x[i, k] - max_j x[i, j]) / sum_j exp(x[i, j] - max): three phases over one row."""
    x, out = _buffer("p1", rows * width), _buffer("p0", rows * width)
    i, k = UOp.range(rows, 0), UOp.range(width, 1)
    j0, j1 = UOp.range(width, 0, RangeKind.REDUCE), UOp.range(width, 1, RangeKind.REDUCE)
    top = UOp(Ops.REDUCE, dtypes.float32, (_load(x, i * width + j0), j0), Ops.MAX)
    total = UOp(Ops.REDUCE, dtypes.float32, ((_load(x, i * width + j1) - top).alu(Ops.EXP), j1), Ops.ADD)
    value = (_load(x, i * width + k) - top).alu(Ops.EXP).alu(Ops.FDIV, total)
    return block_rewrite(UOp(Ops.SINK, dtypes.void, (_store(out, i * width + k, value),)), check=True)


def programs(sink: UOp) -> dict[str, list[UOp]]:
    plan = plan_blocks(sink, BlockLimits())
    return {variant: linearize(block_lowering(sink, plan, variant, check=True)) for variant in plan.variants}


def test_persistent_phases_share_their_loads_and_looped_ones_walk_chunks():
    found = programs(softmax(13, 300))
    assert set(found) == {"persistent", "looped"}
    persistent, looped = found["persistent"], found["looped"]
    # one row in one block: the max, the sum and the stores read x through one LOAD
    assert sum(u.op is Ops.LOAD for u in persistent) == 1
    assert not any(u.op in (Ops.RANGE, Ops.DEFINE_ACC) for u in persistent)
    assert sum(u.op is Ops.BLOCK_REDUCE for u in persistent) == 2
    # looped: a loop over RBLOCK chunks per phase, each with its own load; two block accumulators, the
    # sum's rescaled as the max grows in the max's own loop (Note: a row's exponential sum in one pass)
    loops = [u for u in looped if u.op is Ops.RANGE]
    assert len(loops) == 2 and all(r.arg.block is BlockAxis.R for r in loops)
    assert sum(u.op is Ops.LOAD for u in looped) == 2
    assert sum(u.op is Ops.DEFINE_ACC for u in looped) == 2
    assert sum(u.op is Ops.ACC_PRIOR for u in looped) == 2
    for program in found.values():
        assert all(len(u.src) == 2 for u in program if u.op is Ops.LOAD)  # every load masked
        assert not any(u.op in (Ops.REDUCE, Ops.SCAN) for u in program)


def test_pointwise_loops_are_one_masked_x_index():
    x, out = _buffer("p1", 6 * 7), _buffer("p0", 6 * 7)
    i, j = UOp.range(6, 0), UOp.range(7, 1)
    sink = block_rewrite(UOp(Ops.SINK, dtypes.void, (_store(out, i * 7 + j, _load(x, j * 6 + i) * 2.0),)))
    (program,) = programs(sink).values()
    assert sum(u.op is Ops.PROGRAM_ID for u in program) == 1
    assert not any(u.op is Ops.RANGE for u in program)  # no loop: each lane is one element
    store = next(u for u in program if u.op is Ops.STORE)
    assert store.src[2].op is Ops.CMPLT  # the x mask


def test_a_contiguous_pointwise_kernel_indexes_by_its_block_position():
    """The flattened x index split into the loops' dims and rejoined ((x//7)*7 + x%7) is x
    again: the program divides nothing, while a transposed read still does."""
    x, out = _buffer("p1", 6 * 7), _buffer("p0", 6 * 7)
    i, j = UOp.range(6, 0), UOp.range(7, 1)
    contiguous = block_rewrite(UOp(Ops.SINK, dtypes.void, (_store(out, i * 7 + j, _load(x, i * 7 + j) * 2.0),)))
    (program,) = programs(contiguous).values()
    assert not any(u.op in (Ops.IDIV, Ops.MOD) for u in program)
    transposed = block_rewrite(UOp(Ops.SINK, dtypes.void, (_store(out, i * 7 + j, _load(x, j * 6 + i) * 2.0),)))
    (program,) = programs(transposed).values()
    assert any(u.op is Ops.IDIV for u in program) and any(u.op is Ops.MOD for u in program)


def test_the_block_stage_wants_masks_and_no_reductions():
    sink = softmax(4, 8)
    with pytest.raises(IRError, match="blocked stage.*REDUCE does not exist"):
        verify(sink, Stage.BLOCKED)
    plan = plan_blocks(sink, BlockLimits())
    lowered = block_lowering(sink, plan, "persistent", check=True)
    store = lowered.src[0]
    unmasked = UOp(Ops.SINK, dtypes.void, (UOp(Ops.STORE, dtypes.void, store.src[:2]),))
    with pytest.raises(IRError, match=r"STORE takes \(INDEX, value, mask\)"):
        verify(unmasked, Stage.BLOCKED)
