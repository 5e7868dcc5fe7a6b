"""The IR spec (uop/spec.py): good kernels pass at their stage, bad UOps are rejected with a
message naming the op, the stage and the rule."""

import pytest

from ember.codegen.phases import block_rewrite, full_rewrite
from ember.uop.dtypes import dtypes
from ember.uop.ops import AccArg, BufferArg, Ops, RangeArg, RangeKind, UOp
from ember.uop.spec import IRError, Stage, verify


def _buffer(name, dtype=dtypes.float32, size=64):
    return UOp(Ops.BUFFER, dtype, (), BufferArg(name, size))


def _load(buffer, index):
    return UOp(Ops.LOAD, buffer.dtype, (UOp(Ops.INDEX, buffer.dtype, (buffer, index)),))


def _store(buffer, index, value):
    return UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, buffer.dtype, (buffer, index)), value))


def _sink(*stores):
    return UOp(Ops.SINK, dtypes.void, stores)


def _row_sum():
    """out[i] = sum_j x[i*8 + j]: a REDUCE, lowered by the C++ steps, kept by Triton's."""
    i, j = UOp.range(8, 0), UOp.range(8, 0, RangeKind.REDUCE)
    x, out = _buffer("p1"), _buffer("p0", size=8)
    total = UOp(Ops.REDUCE, dtypes.float32, (_load(x, i * 8 + j), j), Ops.ADD)
    return _sink(_store(out, i, total))


def test_a_kernel_meets_the_spec_at_every_step_of_both_backends():
    sink = verify(_row_sum(), Stage.AST)
    lowered = full_rewrite(sink, check=True)
    assert not any(u.op is Ops.REDUCE for u in lowered.toposort)
    verify(lowered, Stage.LOWERED)
    blocks = block_rewrite(sink, check=True)
    assert any(u.op is Ops.REDUCE for u in blocks.toposort)
    verify(blocks, Stage.EARLY)


def _rejected(sink, stage, *words):
    with pytest.raises(IRError) as info:
        verify(sink, stage)
    message = str(info.value)
    assert f"{stage.value} stage" in message and all(w in message for w in words), message
    return info.value


def test_ops_a_stage_does_not_have_are_rejected():
    _rejected(_row_sum(), Stage.LOWERED, "REDUCE", "does not exist")
    acc = UOp(Ops.DEFINE_ACC, dtypes.float32, (), AccArg(Ops.ADD, 0.0, 0))
    _rejected(_sink(_store(_buffer("p0"), UOp.const(dtypes.index, 0), acc)), Stage.AST, "DEFINE_ACC")
    axis = UOp(Ops.AXIS, dtypes.index, (), 0)
    _rejected(_sink(_store(_buffer("p0"), axis, UOp.const(dtypes.float32, 1.0))), Stage.AST, "AXIS")


def test_sources_and_dtypes_are_checked():
    out, i = _buffer("p0"), UOp.range(64, 0)
    x = _load(_buffer("p1"), i)
    # mixed operand dtypes: an ADD of float32 and int32
    mixed = UOp(Ops.ADD, dtypes.float32, (x, UOp.const(dtypes.int32, 1)))
    _rejected(_sink(_store(out, i, mixed)), Stage.AST, "ADD", "operands must share one dtype")
    # a comparison that does not give bool
    compare = UOp(Ops.CMPLT, dtypes.float32, (x, x))
    _rejected(_sink(_store(out, i, compare)), Stage.AST, "CMPLT", "should give bool")
    # a store of another dtype than its buffer's
    _rejected(_sink(_store(out, i, x.cast(dtypes.float64))), Stage.AST, "STORE", "stores float64 into float32")
    # WHERE with a float condition
    where = UOp(Ops.WHERE, dtypes.float32, (x, x, x))
    _rejected(_sink(_store(out, i, where)), Stage.AST, "WHERE", "bool condition")
    # a REDUCE over a loop range rather than a reduce range
    total = UOp(Ops.REDUCE, dtypes.float32, (x, i), Ops.ADD)
    _rejected(_sink(_store(_buffer("p0", size=1), UOp.const(dtypes.index, 0), total)), Stage.AST, "REDUCE", "reduce")
    # a LOAD straight from a BUFFER
    bad_load = UOp(Ops.LOAD, dtypes.float32, (out,))
    _rejected(_sink(_store(out, i, bad_load)), Stage.AST, "LOAD", "source 0 must be INDEX")


def test_analysis_placeholders_and_16_bit_math_are_rejected_in_kernels():
    out = _buffer("p0")
    bounded = UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, 64),), RangeArg(RangeKind.BOUNDED, 0))
    _rejected(_sink(_store(out, bounded, UOp.const(dtypes.float32, 0.0))), Stage.AST, "RANGE", "BOUNDED")
    half, i = _buffer("p0", dtypes.bfloat16), UOp.range(64, 0)
    x = _load(half, i)
    doubled = x + x  # fine before low_precision, not after
    verify(_sink(_store(half, i, doubled)), Stage.AST)
    _rejected(_sink(_store(half, i, doubled)), Stage.EARLY, "ADD", "float16/bfloat16")


def test_a_bad_rewrite_is_named_by_its_step():
    sink = _row_sum()
    store = sink.src[0]
    broken = _sink(UOp(Ops.STORE, dtypes.void, (store.src[0], store.src[1].cast(dtypes.int32))))
    with pytest.raises(IRError, match=r"ast stage, after build_kernel_ast\): STORE stores int32 into float32"):
        full_rewrite(broken, check=True)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_the_suite_checks_every_kernel_it_compiles(backend, monkeypatch, tmp_path):
    """conftest turns EMBER_CHECK_IR on: each kernel is verified before its first codegen step and
    after every one, on both backends."""
    import torch

    import ember
    from ember.codegen import phases

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))  # no graph cache hit: codegen runs
    on_gpu = backend == "triton" and torch.cuda.is_available()  # else Triton's interpreter on CPU tensors
    if not on_gpu:
        monkeypatch.setenv("EMBER_BACKEND", backend)
    stages = []
    real_verify = phases.verify
    monkeypatch.setattr(
        phases, "verify", lambda sink, stage, after="": stages.append(after) or real_verify(sink, stage, after)
    )
    x = torch.randn(8, 32, device="cuda" if on_gpu else "cpu")
    got = torch.compile(lambda x: torch.softmax(x, -1) + x.cumsum(0), backend="ember")(x)
    torch.testing.assert_close(got, torch.softmax(x, -1) + x.cumsum(0))
    kernels = ember.metrics.kernels_generated
    assert kernels >= 1 and stages.count("build_kernel_ast") == kernels
    assert {"low_precision", "order_loops", "number_ranges"} <= set(stages)
    assert ("lower_reduce" in stages) == (backend == "cpp")
    assert ("lower_blocks" in stages) == (backend == "triton")
