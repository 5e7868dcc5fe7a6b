"""Semantics written once (codegen/primitives.py) and block plans (codegen/blocks.py), without a
device: the rewritten UOps are evaluated by a small numpy interpreter and compared with eager
(bfloat16 conversions bit for bit) and with Python's integer arithmetic (division and shifts
at every sign, zero, -1 and the type's extremes); what reaches a renderer holds only casts and
divisions both languages do as eager."""

import numpy as np
import pytest
import torch

from ember.codegen.blocks import BlockLimits, plan_blocks
from ember.codegen.phases import block_rewrite, full_rewrite
from ember.codegen.primitives import primitive_ops
from ember.uop.dtypes import LOW_PRECISION, dtypes
from ember.uop.ops import BufferArg, Ops, RangeKind, UOp

NUMPY = {
    dtypes.bool: np.bool_, dtypes.int8: np.int8, dtypes.int16: np.int16, dtypes.int32: np.int32,
    dtypes.int64: np.int64, dtypes.uint8: np.uint8, dtypes.uint16: np.uint16, dtypes.uint32: np.uint32,
    dtypes.float32: np.float32, dtypes.float64: np.float64, dtypes.bfloat16: np.uint16,
}  # fmt: skip
BINARY = {
    Ops.ADD: np.add, Ops.SUB: np.subtract, Ops.MUL: np.multiply, Ops.AND: np.bitwise_and, Ops.OR: np.bitwise_or,
    Ops.SHL: np.left_shift, Ops.SHR: np.right_shift, Ops.CMPLT: np.less, Ops.CMPEQ: np.equal,
    Ops.CMPNE: np.not_equal, Ops.MOD: np.fmod,
}  # fmt: skip


def _load(name: str, dtype):
    buffer = UOp(Ops.BUFFER, dtype, (), BufferArg(name, 1))
    return UOp(Ops.LOAD, dtype, (UOp(Ops.INDEX, dtype, (buffer, UOp.const(dtypes.index, 0))),))


def evaluate(root: UOp, inputs: dict[str, np.ndarray], seen: list[UOp] | None = None) -> np.ndarray:
    """`root` on numpy arrays, with C's (and Triton's) semantics for the primitive ops. `seen`
    collects every IDIV/MOD/SHL/SHR with its operands' values, for the checks on them."""
    values: dict[UOp, np.ndarray] = {}
    with np.errstate(all="ignore"):
        for u in root.toposort:
            src = [values.get(s) for s in u.src]
            values[u] = _evaluate_one(u, src, inputs)
            if seen is not None and u.op in (Ops.IDIV, Ops.MOD, Ops.SHL, Ops.SHR):
                seen.append((u, src[0], src[1]))
    return values[root]


def _evaluate_one(u: UOp, src: list, inputs: dict[str, np.ndarray]):
    kind = NUMPY.get(u.dtype)
    if u.op is Ops.LOAD:
        return inputs[u.src[0].src[0].arg.name]
    if u.op in (Ops.BUFFER, Ops.INDEX):
        return None
    if u.op is Ops.CONST:
        return np.array(u.arg, dtype=kind)
    if u.op is Ops.BITCAST:
        return src[0].view(kind)
    if u.op is Ops.CAST:
        return src[0].astype(kind)
    if u.op is Ops.WHERE:
        return np.where(src[0], src[1], src[2]).astype(kind)
    if u.op is Ops.NEG:
        return (0 - src[0]).astype(kind)
    if u.op is Ops.IDIV:  # truncating, as C
        return ((src[0] - np.fmod(src[0], src[1])) // src[1]).astype(kind)
    return BINARY[u.op](src[0], src[1]).astype(kind)


def _primitive(u: UOp) -> UOp:
    return primitive_ops(UOp(Ops.SINK, dtypes.void, (u,))).src[0]


# ---- bfloat16 conversions, bit for bit --------------------------------------------------------


def test_float32_to_bfloat16_rounds_as_eager():
    rng = np.random.default_rng(0)
    # zeros, infinities, NaNs, ties to even both ways, extremes
    edges = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x3F808000, 0x3F818000,
             0x7F7FFFFF, 0x00000001, 0x807FFFFF]  # fmt: skip
    random = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([random, np.array(edges, np.uint32)])
    x = _load("x", dtypes.float32)
    got = evaluate(_primitive(x.cast(dtypes.bfloat16)), {"x": bits.view(np.float32)})
    want = torch.from_numpy(bits.view(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(bits.view(np.float32))
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert (got[nan] & 0x7FFF == 0x7FC0).all()  # every NaN becomes the quiet NaN (its sign kept or not)


def test_bfloat16_to_float32_and_wider_types_are_exact():
    bits = np.arange(2**16, dtype=np.uint16)
    x = _load("x", dtypes.bfloat16)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    for target in (dtypes.float32, dtypes.float64):
        got = evaluate(_primitive(x.cast(target)), {"x": bits})
        expected = want.to(torch.float32 if target is dtypes.float32 else torch.float64).numpy()
        np.testing.assert_array_equal(got, expected)  # NaN where eager has NaN, every other value equal
        np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))


def test_renderers_see_only_casts_both_languages_do_as_eager():
    sources = [_load(f"x{i}", d) for i, d in enumerate((dtypes.bool, dtypes.int32, dtypes.float64, dtypes.bfloat16,
                                                        dtypes.float16))]  # fmt: skip
    targets = (dtypes.bool, dtypes.int64, dtypes.float32, dtypes.float64, dtypes.bfloat16, dtypes.float16)
    for source in sources:
        for target in targets:
            for u in _primitive(source.cast(target)).toposort:
                if u.op is not Ops.CAST:
                    continue
                a, b = u.src[0].dtype, u.dtype
                assert b is not dtypes.bool and a is not dtypes.bfloat16 and b is not dtypes.bfloat16, (a, b)
                assert not (a.is_bool and b.is_float), (a, b)
                assert (a in LOW_PRECISION or b in LOW_PRECISION) <= (dtypes.float32 in (a, b)), (a, b)


# ---- integer division and shifts ------------------------------------------------------------


def _wrapped(value: int, bits: int, signed: bool) -> int:
    return (value + 2 ** (bits - 1)) % 2**bits - 2 ** (bits - 1) if signed else value % 2**bits


def _c_division(a: int, b: int, op: Ops, bits: int, signed: bool) -> int:
    """Eager's integer division and remainder as kernels compute them: truncating, 0 for a zero
    divisor (a CHECK reports it), wrapped negation for -1."""
    if b == 0 or (b == -1 and op is Ops.MOD):
        return 0
    quotient = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)
    return _wrapped(quotient if op is Ops.IDIV else a - quotient * b, bits, signed)


def _shifted(a: int, b: int, op: Ops, bits: int, signed: bool) -> int:
    if b < 0 or b >= bits:
        return 0 if op is Ops.SHL or a >= 0 else -1
    return _wrapped(a << b if op is Ops.SHL else a >> b, bits, signed)


@pytest.mark.parametrize("dtype", [dtypes.int8, dtypes.uint8, dtypes.int32, dtypes.int64], ids=lambda d: d.name)
@pytest.mark.parametrize("op", [Ops.IDIV, Ops.MOD, Ops.SHL, Ops.SHR], ids=lambda op: op.name)
def test_division_and_shifts_at_every_edge(dtype, op):
    bits = 8 * dtype.itemsize
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    edges = [low, low + 1, -7, -2, -1, 0, 1, 2, 3, 7, bits - 1, bits, bits + 1, high - 1, high]
    a, b = np.meshgrid(np.array(edges, np.int64), np.array(edges, np.int64))
    kind = NUMPY[dtype]
    seen: list = []
    got = evaluate(_primitive(_load("a", dtype).alu(op, _load("b", dtype))), {"a": a.astype(kind), "b": b.astype(kind)},
                   seen)  # fmt: skip
    reference = _c_division if op in (Ops.IDIV, Ops.MOD) else _shifted
    signed = dtype.kind == "int"
    want = np.vectorize(lambda x, y: reference(int(x), int(y), op, bits, signed))(a.astype(kind), b.astype(kind))
    np.testing.assert_array_equal(got.astype(np.int64), want)
    for _, _, rhs in seen:  # what the plain op computes on is defined in C and Triton alike
        assert (not np.isin(rhs, (0, -1)).any()) if op in (Ops.IDIV, Ops.MOD) else ((rhs >= 0) & (rhs < bits)).all()


def test_bounded_operands_stay_one_op():
    x = _load("x", dtypes.int32)
    assert _primitive(x.alu(Ops.IDIV, x.const_like(4))).op is Ops.IDIV
    assert _primitive(x.alu(Ops.SHL, x.const_like(3))).op is Ops.SHL
    i = UOp.range(10, 0)
    assert _primitive(i.alu(Ops.MOD, i.const_like(3))).op is Ops.MOD  # index math


# ---- block plans ----------------------------------------------------------------------------


def _row_reduction(rows: int, width: int, scan: bool = False) -> UOp:
    i, j = UOp.range(rows, 0), UOp.range(width, 0, RangeKind.SCAN if scan else RangeKind.REDUCE)
    x = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg("p1", rows * width))
    out = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg("p0", rows * (width if scan else 1)))
    value = UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, dtypes.float32, (x, i * width + j)),))
    if scan:
        result, position = UOp(Ops.SCAN, dtypes.float32, (value, j, i), Ops.ADD), i * width + j
    else:
        result, position = UOp(Ops.REDUCE, dtypes.float32, (value, j), Ops.ADD), i
    store = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, dtypes.float32, (out, position)), result))
    return block_rewrite(UOp(Ops.SINK, dtypes.void, (store,)))


def test_block_plans_follow_the_backends_limits():
    limits = BlockLimits(persistent_row=1024, persistent_scan_row=256)
    assert plan_blocks(_row_reduction(8, 1024), limits).variants == ("persistent", "looped")
    assert plan_blocks(_row_reduction(8, 1025), limits).variants == ("looped",)
    assert plan_blocks(_row_reduction(8, 256, scan=True), limits).variants == ("persistent", "looped")
    assert plan_blocks(_row_reduction(8, 257, scan=True), limits).variants == ("looped",)
    plan = plan_blocks(_row_reduction(8, 1025), limits)
    assert (plan.shape.xnumel, plan.shape.rnumel, plan.index_bits) == (8, 1025, 32)
    assert plan_blocks(_row_reduction(2**16, 2**16), limits).index_bits == 64  # positions past 2^31


def _gather_rows(rows: int, width: int, table_rows: int) -> UOp:
    """out[i, j] = table[clamp(idx[i]), j]: an embedding's gather, its position checked."""
    from ember.uop.ops import CheckArg

    i, j = UOp.range(rows, 0), UOp.range(width, 1)
    ids = UOp(Ops.BUFFER, dtypes.int64, (), BufferArg("p1", rows))
    table = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg("p2", table_rows * width))
    out = UOp(Ops.BUFFER, dtypes.float32, (), BufferArg("p0", rows * width))
    position = UOp(Ops.LOAD, dtypes.int64, (UOp(Ops.INDEX, dtypes.int64, (ids, i)),)).cast(dtypes.index)
    clamped = position.alu(Ops.MAX, UOp.const(dtypes.index, 0)).alu(Ops.MIN, UOp.const(dtypes.index, table_rows - 1))
    ok = position.lt(UOp.const(dtypes.index, table_rows))
    row = UOp(Ops.CHECK, dtypes.index, (clamped, ok, position), CheckArg("IndexError", "index {value}"))
    value = UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, dtypes.float32, (table, row * width + j)),))
    store = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, dtypes.float32, (out, i * width + j)), value))
    return block_rewrite(UOp(Ops.SINK, dtypes.void, (store,)))


def test_a_gather_indexes_in_32_bits_when_its_positions_fit():
    """Note: data-derived indexes: the loaded position, any int64 before its clamp, is computed
    in int64 whatever the kernel's width, so it does not make the kernel's own index math wide."""
    limits = BlockLimits()
    assert plan_blocks(_gather_rows(4096, 1024, 32000), limits).index_bits == 32
    assert plan_blocks(_gather_rows(2**16, 2**16, 8), limits).index_bits == 64  # output positions past 2^31


def test_a_gpu_converts_bfloat16_itself_and_the_interpreter_through_the_bits():
    """Note: semantics written once: float32 <-> bfloat16 stay CASTs only where the target rounds
    to nearest even itself (a GPU); elsewhere they become the bit formulas."""
    x = _load("x", dtypes.bfloat16)
    out = UOp(Ops.BUFFER, dtypes.bfloat16, (), BufferArg("p0", 1))
    doubled = x.cast(dtypes.float32).alu(Ops.MUL, UOp.const(dtypes.float32, 2.0)).cast(dtypes.bfloat16)
    store = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, dtypes.bfloat16, (out, UOp.const(dtypes.index, 0))), doubled))
    sink = UOp(Ops.SINK, dtypes.void, (store,))

    def bfloat16_casts(u: UOp) -> int:
        return sum(1 for v in u.toposort if v.op is Ops.CAST and dtypes.bfloat16 in (v.dtype, v.src[0].dtype))

    assert bfloat16_casts(block_rewrite(sink, check=True, native_bfloat16=True)) == 2
    assert bfloat16_casts(block_rewrite(sink, check=True)) == 0
    # an integer keeps the formulas: a GPU fuses int -> float32 -> bfloat16 into one rounding
    ints = _load("i", dtypes.int64).cast(dtypes.bfloat16)
    store = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, dtypes.bfloat16, (out, UOp.const(dtypes.index, 0))), ints))
    assert bfloat16_casts(block_rewrite(UOp(Ops.SINK, dtypes.void, (store,)), check=True, native_bfloat16=True)) == 0


def test_cpp_and_triton_steps_both_end_in_primitive_ops():
    x = _load("x", dtypes.int32)
    out = UOp(Ops.BUFFER, dtypes.int32, (), BufferArg("p0", 1))
    store = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, dtypes.int32, (out, UOp.const(dtypes.index, 0))),
                                         x.alu(Ops.IDIV, _load("y", dtypes.int32))))  # fmt: skip
    for rewrite in (full_rewrite, block_rewrite):
        sink = rewrite(UOp(Ops.SINK, dtypes.void, (store,)), check=True)
        assert any(u.op is Ops.CHECK for u in sink.toposort)  # a zero divisor is still reported
        divisions = [u for u in sink.toposort if u.op is Ops.IDIV]
        assert divisions and all(d.src[1].op is Ops.WHERE for d in divisions)


def test_bool_sums_and_products_are_logic():
    a, b = np.meshgrid(np.array([False, True]), np.array([False, True]))
    x, y = _load("a", dtypes.bool), _load("b", dtypes.bool)
    for op, torch_op in ((Ops.ADD, torch.add), (Ops.MUL, torch.mul)):
        rewritten = _primitive(x.alu(op, y))
        assert not any(u.op in (Ops.ADD, Ops.MUL) for u in rewritten.toposort)
        want = torch_op(torch.from_numpy(a), torch.from_numpy(b)).numpy()
        np.testing.assert_array_equal(evaluate(rewritten, {"a": a, "b": b}), want)


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.float64], ids=lambda d: d.name)
def test_sign_bit_is_the_top_bit(dtype):
    x = np.array([-0.0, 0.0, np.nan, -np.nan, -1.0, 2.0, -np.inf, np.inf, -1e-45, 5e-324], NUMPY[dtype])
    rewritten = _primitive(_load("x", dtype).alu(Ops.SIGNBIT))
    assert not any(u.op is Ops.SIGNBIT for u in rewritten.toposort)
    np.testing.assert_array_equal(evaluate(rewritten, {"x": x}), np.signbit(x))
