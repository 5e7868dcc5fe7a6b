"""The IR's spec: what each op's sources, dtype and arg must be, stage by stage (STYLE 16).

`verify(sink, stage)` walks a kernel and raises `IRError` at the first UOp that breaks a rule,
naming the op, the stage and the rule, so a bad rewrite fails where it happens rather than as a
renderer's KeyError three stages later. compile_graph runs it after every codegen step when
`config.check_ir` is on (EMBER_CHECK_IR; always under EMBER_DEBUG and in the test suite).

Stages, in pipeline order:
    AST      the kernel AST of codegen/kernel.py: STOREs over RANGEs, REDUCE and SCAN, any dtype
    EARLY    after the early phases (codegen/phases.py): no ALU op or REDUCE computes on
             float16/bfloat16 (Note: low-precision floats); what a block backend renders
    LOWERED  after reduce lowering: accumulators (DEFINE_ACC, ACC_UPDATE, ACC_READ, ACC_RUNNING)
             instead of REDUCE and SCAN; what the linearizer takes
    BLOCKED  after block lowering (codegen/block_lowering.py): loops on the x axis are one x index
             (PROGRAM_ID, BLOCK_SIZE, ARANGE), REDUCE and SCAN are block reductions, block scans and
             accumulators (a tile accumulator may be read before its update, ACC_PRIOR, and its
             update replace it, AccUpdate.REPLACE); LOAD, STORE and CHECK take the mask of their
             active lanes; what the linearizer takes for a block backend
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from ember.uop.dtypes import dtypes
from ember.uop.ops import (
    ALU_OPS,
    BINARY_OPS,
    COMPARISON_OPS,
    UNARY_OPS,
    AccArg,
    AccBlock,
    AccUpdate,
    BlockArg,
    BlockAxis,
    BlockReduceArg,
    BufferArg,
    CheckArg,
    Ops,
    RangeArg,
    RangeKind,
    ScatterArg,
    UOp,
    VarArg,
)


class Stage(enum.Enum):
    AST = "ast"
    EARLY = "early"
    LOWERED = "lowered"
    BLOCKED = "blocked"


class IRError(ValueError):
    """A UOp that breaks the spec: which op, at which stage, which rule."""

    def __init__(self, stage: Stage, u: UOp, rule: str, after: str = ""):
        where = f"{stage.value} stage" + (f", after {after}" if after else "")
        super().__init__(f"IR spec ({where}): {u.op.name} {rule}: {u!r}")
        self.stage, self.uop, self.rule = stage, u, rule


ACCUMULATOR_OPS = frozenset({Ops.DEFINE_ACC, Ops.ACC_UPDATE, Ops.ACC_READ, Ops.ACC_RUNNING})
BLOCK_OPS = frozenset({Ops.PROGRAM_ID, Ops.BLOCK_SIZE, Ops.ARANGE, Ops.BLOCK_REDUCE, Ops.BLOCK_SCAN, Ops.PHILOX4,
                       Ops.WORD, Ops.ACC_PRIOR})  # fmt: skip
# ops that exist only in some stages (every other op may appear in all of them)
FORBIDDEN = {
    Stage.AST: ACCUMULATOR_OPS | BLOCK_OPS | {Ops.AXIS, Ops.ENDRANGE},
    Stage.EARLY: ACCUMULATOR_OPS | BLOCK_OPS | {Ops.AXIS, Ops.ENDRANGE},
    Stage.LOWERED: BLOCK_OPS | {Ops.REDUCE, Ops.SCAN, Ops.AXIS, Ops.ENDRANGE},
    Stage.BLOCKED: frozenset({Ops.REDUCE, Ops.SCAN, Ops.AXIS, Ops.ENDRANGE, Ops.PHILOX}),
}
LOW_PRECISION = (dtypes.float16, dtypes.bfloat16)
# ops that move or select 16-bit floats without computing on them (Note: low-precision floats)
MOVES_LOW_PRECISION = frozenset({Ops.BUFFER, Ops.INDEX, Ops.LOAD, Ops.STORE, Ops.CONST, Ops.CAST, Ops.BITCAST})
MOVES_LOW_PRECISION |= {Ops.WHERE, Ops.CHECK, Ops.SINK, Ops.BLOCK_REDUCE, Ops.BLOCK_SCAN}
REDUCE_COMBINES = frozenset({Ops.ADD, Ops.MUL, Ops.MAX, Ops.MIN})
SCAN_COMBINES = REDUCE_COMBINES | {Ops.LOGADDEXP}

Rule = Callable[[UOp], str | None]  # the broken rule, or None


def verify(sink: UOp, stage: Stage, after: str = "") -> UOp:
    """`sink`, unchanged, when every UOp of it meets the spec of `stage`; else IRError (naming
    the step `after` which the check ran)."""
    for u in sink.toposort:
        if (broken := check_uop(u, stage)) is not None:
            raise IRError(stage, u, broken, after)
    return sink


def check_uop(u: UOp, stage: Stage) -> str | None:
    if u.op in FORBIDDEN[stage]:
        return "does not exist at this stage"
    if stage is not Stage.AST and u.op not in MOVES_LOW_PRECISION and _computes_in_low_precision(u):
        return "computes on float16/bfloat16 (only loads, stores, casts and selects may, after low_precision)"
    rule = (BLOCKED_SPEC.get(u.op) if stage is Stage.BLOCKED else None) or SPEC.get(u.op)
    rule = rule or (_alu if u.op in ALU_OPS else None)
    return rule(u) if rule is not None else None


def _computes_in_low_precision(u: UOp) -> bool:
    if u.op in ACCUMULATOR_OPS:
        return u.dtype in LOW_PRECISION
    return u.dtype in LOW_PRECISION or any(s.dtype in LOW_PRECISION for s in u.src)


# ---- per-op rules ---------------------------------------------------------------------------


def _sources(u: UOp, *ops: Ops | None) -> str | None:
    """Exactly these sources by op (None: any op)."""
    if len(u.src) != len(ops):
        return f"takes {len(ops)} sources, has {len(u.src)}"
    for i, (s, op) in enumerate(zip(u.src, ops)):
        if op is not None and s.op is not op:
            return f"source {i} must be {op.name}, is {s.op.name}"
    return None


def _sink(u: UOp) -> str | None:
    if u.dtype is not dtypes.void:
        return "must be void"
    if not all(s.op is Ops.STORE for s in u.src):
        return "sources must be STOREs"
    return None


def _buffer(u: UOp) -> str | None:
    if u.src or not isinstance(u.arg, BufferArg) or u.dtype is dtypes.void:
        return "must be a typed parameter without sources, arg BufferArg"
    return None


def _index(u: UOp) -> str | None:
    if (broken := _sources(u, Ops.BUFFER, None)) is not None:
        return broken
    if u.dtype is not u.src[0].dtype:
        return f"dtype {u.dtype.name} differs from its buffer's {u.src[0].dtype.name}"
    return None if u.src[1].dtype.is_int else f"position must be an integer, is {u.src[1].dtype.name}"


def _load(u: UOp) -> str | None:
    if (broken := _sources(u, Ops.INDEX)) is not None:
        return broken
    return None if u.dtype is u.src[0].dtype else f"dtype {u.dtype.name} differs from its INDEX's"


def _store(u: UOp) -> str | None:
    if len(u.src) < 2 or u.src[0].op is not Ops.INDEX:
        return "sources must be (INDEX, value)"
    # an accumulating scatter also takes the loops it repeats over (codegen/kernel.py _repeated_loops)
    if len(u.src) > 2 and not (isinstance(u.arg, ScatterArg) and all(s.op is Ops.RANGE for s in u.src[2:])):
        return "sources past (INDEX, value) must be RANGEs of an accumulating scatter"
    if u.dtype is not dtypes.void or not (u.arg is None or isinstance(u.arg, ScatterArg)):
        return "must be void, arg None or ScatterArg"
    return None if u.src[1].dtype is u.src[0].dtype else f"stores {u.src[1].dtype.name} into {u.src[0].dtype.name}"


def _range(u: UOp) -> str | None:
    if not isinstance(u.arg, RangeArg) or u.dtype is not dtypes.index:
        return "must be an index with arg RangeArg"
    if u.arg.kind is RangeKind.BOUNDED:
        return "a BOUNDED range (an analysis placeholder) reached a kernel"
    size = u.src[0] if u.src else None
    if size is None or size.dtype is not dtypes.index or size.vmin < 0 or not _size_expression(size):
        return "source 0 must be its size: a non-negative index of CONSTs and DEFINE_VARs"
    if len(u.src) == 2 and (u.src[1].op is not Ops.RANGE or u.src[1].arg.kind is not RangeKind.TILE):
        return "an element loop's source 1 must be its TILE range"
    return "takes (size,) or (size, tile loop)" if len(u.src) > 2 else None


def _size_expression(size: UOp) -> bool:
    """A constant, or index math over size variables (Note: symbolic sizes, uop/variables.py)."""
    return all(x.op in SIZE_OPS for x in size.toposort)


SIZE_OPS = frozenset({Ops.CONST, Ops.DEFINE_VAR, Ops.ADD, Ops.SUB, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.MIN})


def _define_var(u: UOp) -> str | None:
    if u.src or u.dtype is not dtypes.index or not isinstance(u.arg, VarArg) or not 0 <= u.arg.vmin <= u.arg.vmax:
        return "must be an index with no sources and arg VarArg (0 <= vmin <= vmax)"
    return None


def _const(u: UOp) -> str | None:
    if u.src:
        return "takes no sources"
    kind = bool if u.dtype.is_bool else int if u.dtype.is_int else float if u.dtype.is_float else None
    return None if kind is None or type(u.arg) is kind else f"value {u.arg!r} is not a {u.dtype.name}"


def _ranges(u: UOp, start: int, what: str) -> str | None:
    for s in u.src[start:]:
        if s.op is not Ops.RANGE or not s.arg.reduce:
            return f"sources from {start} on must be reduce/scan/lane RANGEs ({what}), found {s.op.name}"
    return None


def _reduce(u: UOp) -> str | None:
    if len(u.src) < 2 or u.arg not in REDUCE_COMBINES:
        return "takes (value, *reduce ranges), arg ADD/MUL/MAX/MIN"
    if u.dtype is not u.src[0].dtype:
        return f"dtype {u.dtype.name} differs from its value's {u.src[0].dtype.name}"
    return _ranges(u, 1, "the ranges it folds")


def _scan(u: UOp) -> str | None:
    if len(u.src) < 2 or u.arg not in SCAN_COMBINES:
        return "takes (value, scanned range, *other ranges), arg ADD/MUL/MAX/MIN/LOGADDEXP"
    scanned = u.src[1]
    if not (scanned.op is Ops.CONST or (scanned.op is Ops.RANGE and scanned.arg.kind is RangeKind.SCAN)):
        return "source 1 must be a SCAN range (or CONST 0 for a dim of size 1)"
    return None if u.dtype is u.src[0].dtype else f"dtype {u.dtype.name} differs from its value's"


def _define_acc(u: UOp) -> str | None:
    if not isinstance(u.arg, AccArg) or not all(s.op is Ops.RANGE for s in u.src):
        return "sources must be the RANGEs it is declared in, arg AccArg"
    return None


def _acc_update(u: UOp) -> str | None:
    if u.arg is not None:
        return "combines (arg None) outside the block stage"
    return _acc_update_sources(u)


def _acc_update_sources(u: UOp) -> str | None:
    if len(u.src) < 3 or u.src[0].op is not Ops.DEFINE_ACC:
        return "takes (DEFINE_ACC, value, *reduce ranges)"
    if not u.dtype is u.src[0].dtype is u.src[1].dtype:
        return f"value {u.src[1].dtype.name} and accumulator {u.src[0].dtype.name} must have one dtype"
    return _ranges(u, 2, "the loops it updates in")


def _acc_read(u: UOp) -> str | None:
    lanes = isinstance(u.src[0].arg, AccArg) and u.src[0].arg.lanes > 1 if u.src else False
    if len(u.src) != 2 + lanes or u.src[0].op is not Ops.DEFINE_ACC or u.src[1].op is not Ops.ACC_UPDATE:
        return "takes (DEFINE_ACC, ACC_UPDATE) (and the lane it reads, for lane accumulators)"
    if u.src[1].src[0] is not u.src[0]:
        return "reads an accumulator its ACC_UPDATE does not update"
    return None if u.dtype is u.src[0].dtype else "dtype differs from its accumulator's"


def _check(u: UOp) -> str | None:
    if len(u.src) != 3 or not u.src[1].dtype.is_bool or not isinstance(u.arg, CheckArg):
        return "takes (value, ok: bool, reported), arg CheckArg"
    if not u.src[2].dtype.is_int:
        return "reports a value that is not an integer"
    return None if u.dtype is u.src[0].dtype else "dtype differs from its value's"


def _philox(u: UOp) -> str | None:
    if len(u.src) != 3 or u.dtype is not dtypes.uint32 or u.arg not in (0, 1, 2, 3):
        return "takes (seed, offset, position), gives uint32 word 0..3"
    return None


def _bitcast(u: UOp) -> str | None:
    if len(u.src) != 1 or u.dtype.itemsize != u.src[0].dtype.itemsize:
        return "reinterprets one source of the same itemsize"
    return None


def _alu(u: UOp) -> str | None:
    if u.op is Ops.CAST:
        return None if len(u.src) == 1 and u.dtype is not dtypes.void else "takes one source to a non-void dtype"
    if u.op is Ops.WHERE:
        if len(u.src) != 3 or not u.src[0].dtype.is_bool:
            return "takes (bool condition, if true, if false)"
        return None if u.dtype is u.src[1].dtype is u.src[2].dtype else "branches and result must share one dtype"
    arity = 1 if u.op in UNARY_OPS else 2 if u.op in BINARY_OPS else 3 if u.op is Ops.MULACC else len(u.src)
    if len(u.src) != arity:
        return f"takes {arity} sources, has {len(u.src)}"
    operand = u.src[0].dtype
    if any(s.dtype is not operand for s in u.src):
        return f"operands must share one dtype: {', '.join(s.dtype.name for s in u.src)}"
    expected = dtypes.bool if u.op in COMPARISON_OPS else operand
    return None if u.dtype is expected else f"gives {u.dtype.name}, should give {expected.name}"


SPEC: dict[Ops, Rule] = {
    Ops.SINK: _sink, Ops.BUFFER: _buffer, Ops.INDEX: _index, Ops.LOAD: _load, Ops.STORE: _store,
    Ops.RANGE: _range, Ops.CONST: _const, Ops.DEFINE_VAR: _define_var, Ops.REDUCE: _reduce, Ops.SCAN: _scan,
    Ops.DEFINE_ACC: _define_acc, Ops.ACC_UPDATE: _acc_update, Ops.ACC_READ: _acc_read, Ops.ACC_RUNNING: _acc_read,
    Ops.CHECK: _check, Ops.PHILOX: _philox, Ops.BITCAST: _bitcast,
}  # fmt: skip


# ---- the block stage (codegen/block_lowering.py) ---------------------------------------------


def _mask(u: UOp, i: int) -> str | None:
    return None if u.src[i].dtype is dtypes.bool else f"source {i} (the mask) must be bool, is {u.src[i].dtype.name}"


def _masked_load(u: UOp) -> str | None:
    if len(u.src) not in (1, 2) or u.src[0].op is not Ops.INDEX:
        return "takes (INDEX,) or (INDEX, mask)"
    if len(u.src) == 2 and (broken := _mask(u, 1)) is not None:
        return broken
    return None if u.dtype is u.src[0].dtype else f"dtype {u.dtype.name} differs from its INDEX's"


def _masked_store(u: UOp) -> str | None:
    if len(u.src) != 3 or u.src[0].op is not Ops.INDEX:
        return "takes (INDEX, value, mask) after block lowering"
    if u.dtype is not dtypes.void or not (u.arg is None or isinstance(u.arg, ScatterArg)):
        return "must be void, arg None or ScatterArg"
    if (broken := _mask(u, 2)) is not None:
        return broken
    return None if u.src[1].dtype is u.src[0].dtype else f"stores {u.src[1].dtype.name} into {u.src[0].dtype.name}"


def _masked_check(u: UOp) -> str | None:
    if len(u.src) != 4 or not u.src[1].dtype.is_bool or not isinstance(u.arg, CheckArg):
        return "takes (value, ok: bool, reported, mask) after block lowering, arg CheckArg"
    if (broken := _mask(u, 3)) is not None:
        return broken
    return None if u.dtype is u.src[0].dtype else "dtype differs from its value's"


def _block_leaf(u: UOp) -> str | None:
    if u.src or u.dtype is not dtypes.index:
        return "is an index without sources"
    if u.op is Ops.BLOCK_SIZE and not isinstance(u.arg, BlockAxis):
        return "arg must be a BlockAxis"
    if u.op is Ops.ARANGE and not (isinstance(u.arg, BlockArg) and u.arg.dims in (1, 2)):
        return "arg must be a BlockArg of 1 or 2 dims"
    return None


def _block_reduce(u: UOp) -> str | None:
    if len(u.src) != 1 or not isinstance(u.arg, BlockReduceArg) or u.arg.combine not in REDUCE_COMBINES:
        return "takes (block,), arg BlockReduceArg of ADD/MUL/MAX/MIN"
    return None if u.dtype is u.src[0].dtype else "dtype differs from its block's"


def _block_scan(u: UOp) -> str | None:
    if len(u.src) != 1 or u.arg not in SCAN_COMBINES:
        return "takes (block,), arg ADD/MUL/MAX/MIN/LOGADDEXP"
    return None if u.dtype is u.src[0].dtype else "dtype differs from its block's"


def _philox4(u: UOp) -> str | None:
    return (
        None if len(u.src) == 3 and u.dtype is dtypes.uint32 else "takes (seed, offset, position), gives uint32 words"
    )


def _word(u: UOp) -> str | None:
    if len(u.src) != 1 or u.src[0].op is not Ops.PHILOX4 or u.arg not in (0, 1, 2, 3):
        return "takes (PHILOX4,), arg word 0..3"
    return None if u.dtype is dtypes.uint32 else "must be uint32"


def _block_acc(u: UOp) -> str | None:
    if (broken := _define_acc(u)) is not None:
        return broken
    return None if u.arg.block is not None else "a block accumulator needs AccArg.block"


def _block_acc_update(u: UOp) -> str | None:
    """An update combines, or replaces a tile accumulator's value with one computed from its ACC_PRIOR
    (Note: a row's exponential sum in one pass, codegen/online_softmax.py)."""
    if u.arg is AccUpdate.REPLACE:
        acc = u.src[0] if u.src else None
        if acc is None or acc.op is not Ops.DEFINE_ACC or acc.arg.block not in (AccBlock.TILE, AccBlock.ROWS):
            return "replaces the value of a tile or row accumulator only"
    elif u.arg is not None:
        return "arg must be None (combine) or AccUpdate.REPLACE"
    return _acc_update_sources(u)


def _acc_prior(u: UOp) -> str | None:
    if len(u.src) != 2 or u.src[0].op is not Ops.DEFINE_ACC or u.src[1].op is not Ops.RANGE:
        return "takes (DEFINE_ACC, the loop RANGE it is read in)"
    if u.src[0].arg.block not in (AccBlock.TILE, AccBlock.ROWS):
        return "reads a tile or row accumulator only"
    return None if u.dtype is u.src[0].dtype else "dtype differs from its accumulator's"


BLOCKED_SPEC: dict[Ops, Rule] = {
    Ops.LOAD: _masked_load, Ops.STORE: _masked_store, Ops.CHECK: _masked_check, Ops.DEFINE_ACC: _block_acc,
    Ops.PROGRAM_ID: _block_leaf, Ops.BLOCK_SIZE: _block_leaf, Ops.ARANGE: _block_leaf,
    Ops.BLOCK_REDUCE: _block_reduce, Ops.BLOCK_SCAN: _block_scan, Ops.PHILOX4: _philox4, Ops.WORD: _word,
    Ops.ACC_UPDATE: _block_acc_update, Ops.ACC_PRIOR: _acc_prior,
}  # fmt: skip
