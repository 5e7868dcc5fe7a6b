"""The one representation: an immutable, hash-consed UOp DAG.

A `UOp(op, dtype, src, arg)` is created once per distinct (op, dtype, src, arg); building an
equal UOp returns the existing object. So common subexpressions merge as they are built,
`a is b` is structural equality, and every kernel AST has a stable content hash.

Note: UOp interning
    The intern table is owned by `_UOpMeta` and holds weak references, so UOps nobody
    uses are collected. It is the only module-level mutable state in ember's core, and it
    is safe because UOps are immutable and a miss is looked up again and filled under a lock:
    two threads building one UOp at once get one object (else `is` would tell them apart).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from ember.uop.dtypes import DType, dtypes, is_low_precision, round_to


class Ops(enum.Enum):
    # structure
    SINK = enum.auto()  # src: the STOREs of a kernel
    BUFFER = enum.auto()  # a kernel parameter (global memory); arg: BufferArg
    INDEX = enum.auto()  # src: (BUFFER, linear element index)
    LOAD = enum.auto()  # src: (INDEX,)
    STORE = enum.auto()  # src: (INDEX, value)
    AXIS = enum.auto()  # lowering-time placeholder for output dimension `arg` of a tensor
    RANGE = enum.auto()  # a loop variable; src: (CONST size,) or (CONST size, its tile loop), arg: RangeArg
    CONST = enum.auto()  # arg: the Python value
    REDUCE = enum.auto()  # src: (value, *reduce RANGEs), arg: the combining Ops (ADD/MAX/MIN/MUL)
    DEFINE_ACC = enum.auto()  # accumulator declared where the REDUCE result lives; arg: AccArg
    ACC_UPDATE = enum.auto()  # src: (DEFINE_ACC, value, *reduce RANGEs); acc = combine(acc, value)
    ACC_READ = enum.auto()  # src: (DEFINE_ACC, ACC_UPDATE); the reduced value after the loop
    SCAN = enum.auto()  # src: (value, scan RANGE, *other ranges); the running reduction up to the range; arg: combine
    ACC_RUNNING = enum.auto()  # src: (DEFINE_ACC, ACC_UPDATE); the accumulator inside the loop, after the update
    LOGADDEXP = enum.auto()  # combining op of logcumsumexp's accumulator only: log(exp(a) + exp(b))
    # a lane accumulator (AccArg.lanes > 1, codegen/lanes.py) is an array: its ACC_UPDATE's last
    # RANGE is the lane it updates, and its ACC_READ has a third src, the lane index it reads
    ENDRANGE = enum.auto()  # linearizer only: closes src[0]
    # src: (value, ok, reported): the value, and a run-time error naming `reported` where `ok` is false
    CHECK = enum.auto()  # arg: CheckArg
    # unary
    NEG = enum.auto()
    NOT = enum.auto()  # logical not (bool) / bitwise not (int)
    ABS = enum.auto()
    EXP = enum.auto()
    EXP2 = enum.auto()
    EXPM1 = enum.auto()
    LOG = enum.auto()
    LOG2 = enum.auto()
    LOG10 = enum.auto()
    LOG1P = enum.auto()
    SQRT = enum.auto()
    SIN = enum.auto()
    COS = enum.auto()
    TAN = enum.auto()
    ASIN = enum.auto()
    ACOS = enum.auto()
    ATAN = enum.auto()
    SINH = enum.auto()
    COSH = enum.auto()
    TANH = enum.auto()
    ERF = enum.auto()
    FLOOR = enum.auto()
    CEIL = enum.auto()
    ROUND = enum.auto()  # half to even, as torch.round
    TRUNC = enum.auto()
    ISNAN = enum.auto()
    ISINF = enum.auto()
    CAST = enum.auto()
    # binary
    ADD = enum.auto()
    SUB = enum.auto()
    MUL = enum.auto()
    FDIV = enum.auto()  # true division (floats)
    IDIV = enum.auto()  # integer division truncating toward zero (C semantics); by 0: 0, by -1: -a (wrapped)
    MOD = enum.auto()  # integer remainder with the sign of the dividend (C semantics); by 0 or -1: 0
    FMOD = enum.auto()  # float remainder with the sign of the dividend
    MAX = enum.auto()  # NaN-propagating for floats, as torch.maximum
    MIN = enum.auto()
    POW = enum.auto()
    ATAN2 = enum.auto()
    CMPLT = enum.auto()
    CMPLE = enum.auto()
    CMPEQ = enum.auto()
    CMPNE = enum.auto()
    AND = enum.auto()
    OR = enum.auto()
    XOR = enum.auto()
    SHL = enum.auto()  # past the width: 0
    SHR = enum.auto()  # arithmetic for signed types; past the width: the sign (0 or -1)
    # (codegen/primitives.py rewrites the edge cases of IDIV/MOD/SHL/SHR and of CAST into plain
    # ops before rendering: Note: semantics written once)
    # ternary
    WHERE = enum.auto()
    MULACC = enum.auto()  # a * b + c rounded once (a fused multiply-add), as prims.fma; integers wrap
    # random numbers (Note: counter-based random numbers, lower/random.py)
    PHILOX = enum.auto()  # src: (seed int64, offset int64, position index); arg: word 0..3; the uint32 word of
    # Philox4x32-10 at counter offset + position
    BITCAST = enum.auto()  # src: (x,); the bits of x read as `dtype` (same itemsize)
    # math functions beyond the basic set (libm's; Note: special functions, lower/math_functions.py)
    ACOSH = enum.auto()
    ASINH = enum.auto()
    ATANH = enum.auto()
    ERFC = enum.auto()
    LGAMMA = enum.auto()
    SIGNBIT = enum.auto()  # bool: the sign bit of a float (true for -0.0 and -nan)
    COPYSIGN = enum.auto()
    NEXTAFTER = enum.auto()
    HYPOT = enum.auto()
    FMAX = enum.auto()  # max ignoring NaN (C fmax), as torch.fmax
    FMIN = enum.auto()
    # blocks (Note: block lowering, codegen/block_lowering.py): after `lower_blocks` only
    PROGRAM_ID = enum.auto()  # index: this program's position on the grid (x axis)
    BLOCK_SIZE = enum.auto()  # index: a block axis' size (XBLOCK, RBLOCK); arg: BlockAxis
    ARANGE = enum.auto()  # index block: 0, 1, ... along one block axis; arg: BlockArg
    BLOCK_REDUCE = enum.auto()  # src: (block,); the block folded along one axis, kept as size 1; arg: BlockReduceArg
    BLOCK_SCAN = enum.auto()  # src: (block,); the running combination along the r axis; arg: the combining Ops
    PHILOX4 = enum.auto()  # src: (seed, offset, position); the four uint32 words of one Philox4x32-10 call
    WORD = enum.auto()  # src: (PHILOX4,); word `arg` (0..3) of it
    # (last: an op's number is part of kernel hashes through reprs of Ops args; appending keeps them)
    DEFINE_VAR = enum.auto()  # a size known only at run time, a kernel argument; arg: VarArg (Note: symbolic sizes)
    # src: (DEFINE_ACC, its loop RANGE); a block accumulator inside its loop before this iteration's update, the
    # update reading it is an AccUpdate.REPLACE (Note: a row's exponential sum in one pass, codegen/online_softmax.py)
    ACC_PRIOR = enum.auto()


MATH_UNARY_OPS = frozenset({Ops.ACOSH, Ops.ASINH, Ops.ATANH, Ops.ERFC, Ops.LGAMMA, Ops.SIGNBIT})
MATH_BINARY_OPS = frozenset({Ops.COPYSIGN, Ops.NEXTAFTER, Ops.HYPOT, Ops.FMAX, Ops.FMIN})


UNARY_OPS = frozenset(
    {Ops.NEG, Ops.NOT, Ops.ABS, Ops.EXP, Ops.EXP2, Ops.EXPM1, Ops.LOG, Ops.LOG2, Ops.LOG10, Ops.LOG1P, Ops.SQRT}
    | {Ops.SIN, Ops.COS, Ops.TAN, Ops.ASIN, Ops.ACOS, Ops.ATAN, Ops.SINH, Ops.COSH, Ops.TANH, Ops.ERF}
    | {Ops.FLOOR, Ops.CEIL, Ops.ROUND, Ops.TRUNC, Ops.ISNAN, Ops.ISINF}
    | MATH_UNARY_OPS
)
BINARY_OPS = frozenset(
    {Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.IDIV, Ops.MOD, Ops.FMOD, Ops.MAX, Ops.MIN, Ops.POW, Ops.ATAN2}
    | {Ops.CMPLT, Ops.CMPLE, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR}
    | MATH_BINARY_OPS
)
COMPARISON_OPS = frozenset({Ops.CMPLT, Ops.CMPLE, Ops.CMPEQ, Ops.CMPNE, Ops.ISNAN, Ops.ISINF, Ops.SIGNBIT})
COMMUTATIVE_OPS = frozenset({Ops.ADD, Ops.MUL, Ops.MAX, Ops.MIN, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR})
ALU_OPS = UNARY_OPS | BINARY_OPS | {Ops.WHERE, Ops.MULACC, Ops.CAST}


@dataclass(frozen=True)
class BufferArg:
    """A kernel parameter: `name` is the wrapper's buffer name, `size` its element count
    (a UOp of size variables when it is symbolic: Note: symbolic sizes, uop/variables.py)."""

    name: str
    size: int | UOp


@dataclass(frozen=True)
class VarArg:
    """A DEFINE_VAR: a size variable (torch's symbol `name`) and the bounds it is known to keep."""

    name: str
    vmin: int
    vmax: int


class RangeKind(enum.Enum):
    """What a loop variable is for (STYLE 15: a kind is a type, never a band of integers).

    Ranges nest by kind first: loops (and tile loops) outermost, then reduce and scan loops,
    then lane copies; `RangeArg.order` orders ranges within that. The value is the prefix of the
    variable's name in generated source and dumps (`r0`, `red3`, `lane1`)."""

    LOOP = "r"  # an output dim's loop (or the element loop of a 2-D tiling)
    TILE = "tile"  # the tile loop of a 2-D tiling, stepping by `RangeArg.tile` (codegen/tiling.py)
    REDUCE = "red"  # a loop a REDUCE folds over
    SCAN = "scan"  # a scanned dim: a sequential loop inside the others (lower/scans.py)
    LANE = "lane"  # a lane copy of the innermost loop inside reduce loops (codegen/lanes.py)
    BOUNDED = "ax"  # an AXIS given its bound while simplifying (lowering, fusion); never in a kernel


# how deep each kind nests: a range of a lower rank is outside one of a higher rank
NESTING_RANK = {
    RangeKind.LOOP: 0, RangeKind.TILE: 0, RangeKind.BOUNDED: 0,
    RangeKind.REDUCE: 1, RangeKind.SCAN: 1, RangeKind.LANE: 2,
}  # fmt: skip
REDUCE_KINDS = frozenset({RangeKind.REDUCE, RangeKind.SCAN, RangeKind.LANE})


@dataclass(frozen=True)
class RangeArg:
    """A loop variable: its `kind`, its `order` among ranges of its nesting rank (smaller is
    outer), and `copy`, which tells apart copies of one range (a REDUCE read at two positions
    gets fresh ranges, codegen/phases.py)."""

    kind: RangeKind
    order: int
    copy: int = 0
    tile: int = 0  # > 0: the tile loop of a 2-D tiling, stepping by `tile` (Note: 2-D tiles, codegen/tiling.py)
    block: BlockAxis | None = None  # a loop over chunks, stepping by that axis' block size (Note: block lowering)

    @property
    def reduce(self) -> bool:
        """Whether the loop is inside the output loops, walking what one output folds or scans."""
        return self.kind in REDUCE_KINDS

    @property
    def nesting(self) -> tuple[int, int, int]:
        """Sort key: a range with a smaller key is opened outside one with a larger key."""
        return (NESTING_RANK[self.kind], self.order, self.copy)

    @property
    def name(self) -> str:
        return f"{self.kind.value}{self.order}" + (f"_{self.copy}" if self.copy else "")


@dataclass(frozen=True)
class AccArg:
    """An accumulator: its combining op and the identity it starts from."""

    combine: Ops
    identity: Any
    id: int
    lanes: int = 1  # > 1: an array of this many accumulators (Note: lane accumulators, codegen/lanes.py)
    block: AccBlock | None = None  # a block backend's accumulator (Note: block lowering); None: a scalar


class AccUpdate(enum.Enum):
    """An ACC_UPDATE's arg when it does not combine (arg None: acc = combine(acc, value))."""

    REPLACE = "replace"  # acc = value, a value computed from the accumulator's ACC_PRIOR (block accumulators only)


class BlockAxis(enum.Enum):
    """An axis of a block (Note: block lowering, codegen/block_lowering.py); the value is the
    name of its size, a constant the launcher picks."""

    X = "XBLOCK"  # output positions, across programs
    R = "RBLOCK"  # the elements one output folds, scans or stores in a row


class AccBlock(enum.Enum):
    """The shape and update of a block accumulator (Note: block lowering)."""

    TILE = "tile"  # [XBLOCK, RBLOCK]: combined element by element per chunk of a row, folded after the loop
    ROWS = "rows"  # [XBLOCK, 1]: combined once per element of a sequential loop (Note: nested reductions)
    CARRY = "carry"  # [XBLOCK, 1]: a scan's carry, the chunk's scan combined with it, then its last position

    @property
    def shape(self) -> str:
        return "[XBLOCK, RBLOCK]" if self is AccBlock.TILE else "[XBLOCK, 1]"


@dataclass(frozen=True)
class BlockArg:
    """An ARANGE: along `axis`, in a block of `dims` dimensions (1: pointwise kernels' [XBLOCK])."""

    axis: BlockAxis
    dims: int = 2


@dataclass(frozen=True)
class BlockReduceArg:
    """A BLOCK_REDUCE: `combine` (ADD/MUL/MAX/MIN) along `axis`, kept as a dimension of size 1."""

    combine: Ops
    axis: BlockAxis


@dataclass(frozen=True)
class ScatterArg:
    """A STORE at a position computed from data (Note: stores at computed positions, lower/scatter.py):
    `combine` (ADD, MUL, MAX, MIN) folds the value into the element, None overwrites it. With
    `atomic`, other iterations may write the same element; without, only iterations of the
    same outermost loop do (so one thread), and the store is a plain read-combine-write."""

    combine: Ops | None = None
    atomic: bool = True


@dataclass(frozen=True)
class CheckArg:
    """A run-time error a kernel reports: the Python exception type's name and its message. The
    CHECK's `reported` value (the offending index, as eager's messages name it) replaces
    `{value}` in the message when the error is raised."""

    error: str  # "IndexError" | "ZeroDivisionError" | "RuntimeError"
    message: str


class _UOpMeta(type):
    _interned: weakref.WeakValueDictionary[tuple, UOp] = weakref.WeakValueDictionary()
    _intern_lock = threading.RLock()

    def __call__(cls, op: Ops, dtype: DType = dtypes.void, src: tuple[UOp, ...] = (), arg: Any = None) -> UOp:
        # floats key by repr: 0.0 == -0.0 and nan != nan must not merge or split constants
        arg_key = repr(arg) if isinstance(arg, float) else arg
        key = (op, dtype, tuple(map(id, src)), arg_key, type(arg))
        if (found := _UOpMeta._interned.get(key)) is not None:
            return found
        with _UOpMeta._intern_lock:  # a miss: look again and make it as one step (Note: UOp interning)
            if (found := _UOpMeta._interned.get(key)) is not None:
                return found
            made = super().__call__(op, dtype, tuple(src), arg)
            _UOpMeta._interned[key] = made
            return made


class UOp(metaclass=_UOpMeta):
    """One node of the DAG. Never mutate one: build a new one (see Note: UOp interning)."""

    __slots__ = ("op", "dtype", "src", "arg", "__weakref__", "__dict__")

    def __init__(self, op: Ops, dtype: DType = dtypes.void, src: tuple[UOp, ...] = (), arg: Any = None):
        self.op, self.dtype, self.src, self.arg = op, dtype, src, arg

    def __reduce__(self):
        return (UOp, (self.op, self.dtype, self.src, self.arg))

    def __repr__(self) -> str:
        return pretty(self)

    # ---- construction helpers -------------------------------------------------------
    @staticmethod
    def const(dtype: DType, value: Any) -> UOp:
        if type(value) not in _NUMBERS:  # a symbolic size (Note: symbolic sizes), or a numpy/torch scalar
            if isinstance(value, UOp):
                return value.cast(dtype)
            if (size := _symbolic_size(value)) is not None:
                return size.cast(dtype)
        return UOp(Ops.CONST, dtype, (), normalize_const(dtype, value))

    @staticmethod
    def range(size: int | UOp, order: int, kind: RangeKind = RangeKind.LOOP) -> UOp:
        return UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, size),), RangeArg(kind, order))

    def const_like(self, value: Any) -> UOp:
        return UOp.const(self.dtype, value)

    def alu(self, op: Ops, *others: UOp) -> UOp:
        out_dtype = dtypes.bool if op in COMPARISON_OPS else self.dtype
        return UOp(op, out_dtype, (self, *others))

    def cast(self, dtype: DType) -> UOp:
        return self if dtype == self.dtype else UOp(Ops.CAST, dtype, (self,))

    def where(self, if_true: UOp, if_false: UOp) -> UOp:
        return UOp(Ops.WHERE, if_true.dtype, (self, if_true, if_false))

    def _lift(self, other: UOp | int | float) -> UOp:
        return other if isinstance(other, UOp) else self.const_like(other)

    @property
    def static_size(self) -> int | None:
        """A size UOp's value when it is a constant; None when it is symbolic."""
        return self.arg if self.op is Ops.CONST else None

    def __add__(self, other):
        return self.alu(Ops.ADD, self._lift(other))

    def __radd__(self, other):
        return self._lift(other).alu(Ops.ADD, self)

    def __sub__(self, other):
        return self.alu(Ops.SUB, self._lift(other))

    def __mul__(self, other):
        return self.alu(Ops.MUL, self._lift(other))

    def __rmul__(self, other):
        return self._lift(other).alu(Ops.MUL, self)

    def __floordiv__(self, other):  # index math only: operands are non-negative
        return self.alu(Ops.IDIV, self._lift(other))

    def __mod__(self, other):  # index math only: operands are non-negative
        return self.alu(Ops.MOD, self._lift(other))

    def __neg__(self):
        return self.alu(Ops.NEG)

    def lt(self, other) -> UOp:
        return self.alu(Ops.CMPLT, self._lift(other))

    # ---- analysis ---------------------------------------------------------------------
    @functools.cached_property
    def toposort(self) -> tuple[UOp, ...]:
        """Every UOp this one depends on, sources before users, this one last."""
        order: list[UOp] = []
        seen: set[int] = set()
        stack: list[tuple[UOp, bool]] = [(self, False)]
        while stack:
            u, expanded = stack.pop()
            if expanded:
                order.append(u)
                continue
            if id(u) in seen:
                continue
            seen.add(id(u))
            stack.append((u, True))
            stack.extend((s, False) for s in reversed(u.src) if id(s) not in seen)
        return tuple(order)

    @functools.cached_property
    def ranges(self) -> frozenset[UOp]:
        """The loop variables this value varies with (reduced ranges excluded)."""
        if self.op is Ops.RANGE:
            return frozenset({self})
        inner = frozenset().union(*(s.ranges for s in self.src)) if self.src else frozenset()
        if self.op is Ops.REDUCE:  # varies with everything but the ranges it reduces over
            return inner - set(self.src[1:])
        if self.op is Ops.ACC_READ:
            return inner - set(self.src[1].src[2:])
        return inner

    @property
    def key(self) -> str:
        """A content hash, stable across processes."""
        return self._bottom_up("_key", _content_key)

    @property
    def has_variables(self) -> bool:
        """Whether a size variable (DEFINE_VAR) is among this UOp's sources (Note: symbolic sizes)."""
        return self._bottom_up("_variables", lambda u: u.op is Ops.DEFINE_VAR or any(s.has_variables for s in u.src))

    @property
    def vmin(self) -> int | float:
        return self._bottom_up("_bounds", bounds)[0]

    @property
    def vmax(self) -> int | float:
        return self._bottom_up("_bounds", bounds)[1]

    def _bottom_up(self, slot: str, compute):
        """A per-UOp cached value computed sources first, so deep graphs never recurse."""
        if slot not in self.__dict__:
            for u in self.toposort:
                if slot not in u.__dict__:
                    u.__dict__[slot] = compute(u)
        return self.__dict__[slot]


_NUMBERS = (int, float, bool)


def _symbolic_size(value: Any) -> UOp | None:
    """torch's SymInt, or a SymFloat computed from sizes, as a UOp of size variables (Note:
    symbolic sizes); None for other values."""
    from ember.uop.variables import symbolic_value

    return symbolic_value(value)


def normalize_const(dtype: DType, value: Any) -> Any:
    """Consts are stored as the Python type of their dtype, so 1 and 1.0 never intern apart."""
    if dtype.is_bool:
        return bool(value)
    if dtype.is_int:
        return int(value)
    if dtype.is_float:
        # a float16/bfloat16 constant is the value it rounds to (Note: low-precision floats)
        return round_to(dtype, value) if is_low_precision(dtype) else float(value)
    return value


def _content_key(u: UOp) -> str:
    parts = [u.op.name, u.dtype.name, repr(u.arg), *(s.key for s in u.src)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def bounds(u: UOp) -> tuple[int | float, int | float]:
    """Inclusive (min, max) of an index expression, from its structure."""
    if u.op is Ops.CONST:
        return (u.arg, u.arg)
    if u.op is Ops.RANGE:
        return (0, u.src[0].vmax - 1)
    if u.op is Ops.DEFINE_VAR:
        return (u.arg.vmin, u.arg.vmax)
    if u.op is Ops.AXIS:
        return (0, dtypes.index.max)
    if (remainder := _less_own_quotient(u)) is not None:
        return remainder
    s = [(x.vmin, x.vmax) for x in u.src]
    if u.op is Ops.ADD:
        return (s[0][0] + s[1][0], s[0][1] + s[1][1])
    if u.op is Ops.SUB:
        return (s[0][0] - s[1][1], s[0][1] - s[1][0])
    if u.op is Ops.NEG:
        return (-s[0][1], -s[0][0])
    if u.op is Ops.MUL:
        products = [a * b for a in s[0] for b in s[1] if not (math.isinf(a) or math.isinf(b))]
        if len(products) == 4:
            return (min(products), max(products))
    if u.op is Ops.IDIV and s[1][0] > 0 and s[0][0] >= 0:
        return (s[0][0] // s[1][1], s[0][1] // s[1][0])
    if u.op is Ops.MOD and s[1][0] > 0 and s[0][0] >= 0:
        return (0, min(s[0][1], s[1][1] - 1))
    if u.op in (Ops.MAX, Ops.MIN):
        pick = max if u.op is Ops.MAX else min
        return (pick(s[0][0], s[1][0]), pick(s[0][1], s[1][1]))
    if u.op is Ops.WHERE:
        return (min(s[1][0], s[2][0]), max(s[1][1], s[2][1]))
    if u.op in COMPARISON_OPS or u.dtype.is_bool:
        return (0, 1)
    if u.op is Ops.CHECK:  # the value it passes on (an index clamped in range: Note: kernel errors)
        return s[0]
    if u.op is Ops.CAST and u.dtype.is_int and u.src[0].dtype.is_int | u.src[0].dtype.is_bool:
        if u.dtype.min <= s[0][0] and s[0][1] <= u.dtype.max:  # a cast that changes no value in range
            return s[0]
    return (u.dtype.min, u.dtype.max)


def _less_own_quotient(u: UOp) -> tuple[int, int] | None:
    """Bounds of x - m*(x//c) for x >= 0 and 0 < m <= c (`n - n//2`, the length of `x[n//2:]`).
    Interval arithmetic takes the two terms as independent and gives a negative minimum; but the
    value is (x % c) + (c - m)*(x//c): for m = 1 it never decreases as x grows, so its ends are
    exact; for a larger m, x % c is only known to lie in [0, c)."""
    if u.op is Ops.SUB:
        x, quotient, m = u.src[0], u.src[1], 1
    elif u.op is Ops.ADD and u.src[1].op is Ops.MUL and u.src[1].src[1].op is Ops.CONST:
        x, quotient, m = u.src[0], u.src[1].src[0], -u.src[1].src[1].arg
    else:
        return None
    if quotient.op is Ops.MUL and quotient.src[1].op is Ops.CONST:
        quotient, m = quotient.src[0], m * quotient.src[1].arg
    if quotient.op is not Ops.IDIV or quotient.src[0] is not x or quotient.src[1].op is not Ops.CONST:
        return None
    c = quotient.src[1].arg
    if not (x.dtype.is_int and 0 < m <= c and x.vmin >= 0):
        return None
    if m == 1:
        return (x.vmin - x.vmin // c, x.vmax - x.vmax // c)
    return ((c - m) * (x.vmin // c), c - 1 + (c - m) * (x.vmax // c))


def substitute(root: UOp, mapping: dict[UOp, UOp]) -> UOp:
    """`root` with every occurrence of a key of `mapping` replaced by its value."""
    done: dict[UOp, UOp] = dict(mapping)
    replaced = done.__getitem__
    for u in root.toposort:
        if u in done:
            continue
        new_src = tuple(map(replaced, u.src))
        # UOps compare by identity, so == on the tuples asks whether every source is the same object
        done[u] = u if new_src == u.src else UOp(u.op, u.dtype, new_src, u.arg)
    return done[root]


def pretty(u: UOp, depth: int = 6) -> str:
    if u.op is Ops.CONST:
        return f"{u.arg!r}"
    if u.op is Ops.RANGE:
        return u.arg.name
    if u.op is Ops.AXIS:
        return f"ax{u.arg}"
    if u.op in (Ops.BUFFER, Ops.DEFINE_VAR):
        return u.arg.name
    if depth == 0:
        return f"{u.op.name}(…)"
    inner = ", ".join(pretty(s, depth - 1) for s in u.src)
    arg = "" if u.arg is None else f", {u.arg!r}"
    return f"{u.op.name}({inner}{arg})"


def reduce_identity(combine: Ops, dtype: DType) -> int | float | bool:
    """The value that leaves `combine` unchanged: a reduction's start, a tail lane's padding."""
    if combine is Ops.ADD:
        return 0
    if combine is Ops.MUL:
        return 1
    if combine is Ops.MAX:
        return dtype.min
    if combine is Ops.MIN:
        return dtype.max
    if combine is Ops.LOGADDEXP:
        return -math.inf
    raise ValueError(f"no identity for reduction {combine}")
