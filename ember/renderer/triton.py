"""Stage `renderer` (GPU): a linearized block program -> the body of a Triton kernel.

The Triton renderer is a table, as renderer/cpp.py is: one spelling per op of the program that
codegen made (block lowering, codegen/block_lowering.py; the linearizer, codegen/linearize.py),
each UOp one statement, its loops Python `for`s. Where a value is computed, which values are
shared and what is masked were decided before (Note: block lowering); the renderer only spells.
renderer/triton_module.py assembles the module.

Note: kernel errors on the GPU
    As on the CPU (Note: kernel errors, renderer/cpp.py) a failed CHECK computes on with
    its safe value, stores its code k (1 + position in `errors`) in `ember_error[0]` and the
    value it reports in `ember_error[k]`: the kernel's row of device int64s of the call's own
    (`GpuErrorFlags`, made per call, so threads running one graph never see each other's
    errors) the wrapper reads after the graph ran. Only active lanes report (the CHECK's
    mask): masked tail lanes compute on padding and must not.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from ember.codegen.eviction import eviction_hints
from ember.renderer.triton_math import render_math
from ember.renderer.triton_scan import combine_call, scan_call
from ember.renderer.triton_scatter import ScatterStore, scatter_store_lines
from ember.schedule.host_scalars import scalar_carrier
from ember.uop.dtypes import DType, bits_of, dtypes
from ember.uop.ops import AccBlock, AccUpdate, BlockAxis, CheckArg, Ops, ScatterArg, UOp
from ember.uop.variables import SizeSpelling, spell_size

TL_TYPES = {
    "bool": "tl.int1", "int8": "tl.int8", "int16": "tl.int16", "int32": "tl.int32", "int64": "tl.int64",
    "uint8": "tl.uint8", "uint16": "tl.uint16", "uint32": "tl.uint32", "float16": "tl.float16",
    "bfloat16": "tl.bfloat16", "float32": "tl.float32",
    "float64": "tl.float64", "index": "tl.int64",
}  # fmt: skip


# a loop bound of size arguments (Note: symbolic blocks, codegen/blocks.py); sizes are never
# negative, so Triton's truncating `//` and `%` are floor division and remainder
TRITON_SIZES = SizeSpelling(
    "Triton", {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.IDIV: "//", Ops.MOD: "%"},
    lambda op, a, b: f"tl.{op}imum({a}, {b})", negates=False, error=NotImplementedError,
)  # fmt: skip


def tl_type(dtype: DType) -> str:
    if dtype.name not in TL_TYPES:
        raise NotImplementedError(f"Triton renderer: no Triton type for {dtype.name}")
    return TL_TYPES[dtype.name]


# ---- the op table ------------------------------------------------------------------------

# IDIV and MOD truncate, as C; their divisors are never 0 or -1 and shift amounts are within the
# width: codegen/primitives.py guards them (Note: semantics written once).
INFIX = {
    Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.CMPLT: "<", Ops.CMPLE: "<=", Ops.CMPEQ: "==",
    Ops.CMPNE: "!=", Ops.AND: "&", Ops.OR: "|", Ops.XOR: "^", Ops.IDIV: "//", Ops.MOD: "%", Ops.SHL: "<<",
    Ops.SHR: ">>",
}  # fmt: skip

# tl.math where Triton has the function; libdevice (CUDA's libm; a numpy shim under the
# interpreter, runtime/triton_interpret.py) for the rest.
UNARY_CALLS = {
    Ops.EXP: "tl.exp", Ops.EXP2: "tl.exp2", Ops.LOG: "tl.log", Ops.LOG2: "tl.log2", Ops.SQRT: "tl.sqrt_rn",
    Ops.SIN: "tl.sin", Ops.COS: "tl.cos", Ops.ERF: "tl.erf", Ops.FLOOR: "tl.floor", Ops.CEIL: "tl.ceil",
    Ops.EXPM1: "libdevice.expm1", Ops.LOG10: "libdevice.log10", Ops.LOG1P: "libdevice.log1p",
    Ops.TAN: "libdevice.tan", Ops.ASIN: "libdevice.asin", Ops.ACOS: "libdevice.acos", Ops.ATAN: "libdevice.atan",
    Ops.SINH: "libdevice.sinh", Ops.COSH: "libdevice.cosh", Ops.TANH: "libdevice.tanh",
    Ops.ROUND: "libdevice.nearbyint", Ops.TRUNC: "libdevice.trunc",
}  # fmt: skip

# Note: low-precision floats in Triton
#     As in C++ kernels (codegen/low_precision.py), float16/bfloat16 values are only loaded,
#     stored, selected, cast and constants: every op computes in float32 and rounds back.
#     Pointers and loaded values have the native types. float16 converts natively to and from
#     float32 (correctly rounded both on the GPU, cvt.rn, and in the interpreter, numpy).
#     bfloat16 converts through its bits, in UOps every backend shares (Note: semantics written
#     once, codegen/primitives.py), and its constants are bits too: the interpreter keeps
#     bfloat16 as uint16 and its own float conversion truncates, so the bit formulas are what
#     runs the same, and right, under the interpreter and on the GPU.
LOW_PRECISION = (dtypes.float16, dtypes.bfloat16)


# tl.full builds every zero as +0.0 (a null value), so a -0.0 is filled in by its bits
NEGATIVE_ZERO_BITS = {2: ("tl.int16", -(2**15)), 4: ("tl.int32", -(2**31)), 8: ("tl.int64", -(2**63))}


def _negative_zero(value, dtype: DType) -> bool:
    return dtype.is_float and value == 0 and math.copysign(1.0, value) < 0


def render_full(shape: str, value, dtype: DType) -> str:
    """A block of `shape` filled with the constant (Note: low-precision floats in Triton)."""
    if dtype is dtypes.bfloat16:
        return f"tl.full({shape}, {bits_of(dtype, value)}, tl.uint16).to(tl.bfloat16, bitcast=True)"
    if _negative_zero(value, dtype):
        int_type, bits = NEGATIVE_ZERO_BITS[dtype.itemsize]
        return f"tl.full({shape}, {bits}, {int_type}).to({tl_type(dtype)}, bitcast=True)"
    return f"tl.full({shape}, {render_const(value, dtypes.float32 if dtype.is_float else dtype)}, {tl_type(dtype)})"


def render_const(value, dtype: DType) -> str:
    if dtype in LOW_PRECISION or _negative_zero(value, dtype):
        return render_full("[]", value, dtype)
    if dtype.is_bool:
        return "True" if value else "False"
    if dtype.is_float:
        text = repr(float(value)) if math.isfinite(value) else f'float("{value}")'
        return text if dtype is dtypes.float32 else render_full("[]", value, dtype)
    if dtype is dtypes.index or dtype is dtypes.int32:
        return str(value) if -(2**31) <= value < 2**31 or dtype is dtypes.index else f"tl.full([], {value}, tl.int32)"
    return f"tl.full([], {value}, {tl_type(dtype)})"


def _binary(u: UOp, a: str, b: str) -> str:
    operand = u.src[0].dtype
    if u.op in INFIX:
        return f"({a} {INFIX[u.op]} {b})"
    if u.op is Ops.FDIV:  # IEEE division, as eager (Triton's float32 `/` is approximate)
        return f"ember_div_rn({a}, {b})" if operand is dtypes.float32 else f"({a} / {b})"
    if u.op is Ops.FMOD:
        return f"libdevice.fmod({a}, {b})"
    if u.op in (Ops.MAX, Ops.MIN):
        fn = "tl.maximum" if u.op is Ops.MAX else "tl.minimum"
        nan = ", propagate_nan=tl.PropagateNan.ALL" if operand.is_float else ""
        return f"{fn}({a}, {b}{nan})"
    if u.op is Ops.POW:
        return f"libdevice.pow({a}, {b})" if operand.is_float else f"ember_ipow({a}, {b})"
    if u.op is Ops.ATAN2:
        return f"libdevice.atan2({a}, {b})"
    raise NotImplementedError(f"Triton renderer: no rendering for {u.op.name}")


def _unary(u: UOp, x: str) -> str:
    source = u.src[0].dtype
    if u.op is Ops.BITCAST:
        return f"{x}.to({tl_type(u.dtype)}, bitcast=True)"
    if u.op is Ops.CAST:  # one Triton does as eager (Note: semantics written once leaves no other)
        return x if source is u.dtype else f"{x}.to({tl_type(u.dtype)})"
    if u.op is Ops.NEG:  # Triton's unary minus is 0 - x, which loses the sign of zero
        return f"(0 - {x})" if not source.is_float else f"({x} * -1.0)"
    if u.op is Ops.NOT:
        return f"({x} == 0)" if source.is_bool else f"(~{x})"
    if u.op is Ops.ABS:
        return f"tl.abs({x})"
    if u.op is Ops.ISNAN:
        return f"({x} != {x})"
    if u.op is Ops.ISINF:
        return f"(tl.abs({x}) == float('inf'))"
    if u.op is Ops.SQRT and source is not dtypes.float32:
        return f"tl.sqrt({x})"
    fn = UNARY_CALLS.get(u.op)
    if fn is None:
        raise NotImplementedError(f"Triton renderer: no rendering for {u.op.name}")
    return f"{fn}({x})"


def render_alu(u: UOp, srcs: list[str]) -> str:
    if (special := render_math(u, srcs)) is not None:  # libdevice functions (renderer/triton_math.py)
        return special
    if u.op is Ops.WHERE:
        return f"tl.where({srcs[0]}, {srcs[1]}, {srcs[2]})"
    if u.op is Ops.MULACC and u.dtype.is_float:  # one rounding, as C++'s fma
        return f"tl.fma({srcs[0]}, {srcs[1]}, {srcs[2]})"
    if u.op is Ops.MULACC:
        return f"({srcs[0]} * {srcs[1]} + {srcs[2]})"
    if len(srcs) == 2:
        return _binary(u, *srcs)
    return _unary(u, srcs[0])


TYPED_OPERANDS = frozenset({Ops.MAX, Ops.MIN, Ops.POW, Ops.ATAN2, Ops.FMOD, Ops.FDIV, Ops.SHL, Ops.SHR, Ops.COPYSIGN,
                            Ops.NEXTAFTER, Ops.HYPOT, Ops.FMAX, Ops.FMIN})  # fmt: skip

REDUCE_CALLS = {Ops.ADD: "tl.sum", Ops.MAX: "ember_max", Ops.MIN: "ember_min", Ops.MUL: "ember_prod"}


# ---- the program -------------------------------------------------------------------------


def render_body(program: list[UOp], errors: list[CheckArg], index_bits: int,
                scalars: frozenset[str] = frozenset(), part: PartNaming | None = None) -> list[str]:  # fmt: skip
    """The statements of one @triton.jit function: one per UOp of the linearized block program
    (Note: block lowering, codegen/block_lowering.py), loops as Python `for`s. `index_bits`: the
    width of index math (codegen/blocks.py); `scalars`: one-element buffers passed by value;
    `part`: how a part of a horizontal kernel names things (renderer/triton_horizontal.py)."""
    body = _Body(errors, index_bits, scalars, part or PartNaming(), eviction_hints(program))
    for u in program:
        body.emit(u)
    return body.lines


@dataclass(frozen=True)
class PartNaming:
    """A part of a horizontal kernel (Note: horizontal fusion, schedule/horizontal.py): its
    parameters' names in the kernel, a prefix for its own names (the parts share one function
    scope), and its program id (an offset into the kernel's)."""

    rename: dict[str, str] = field(default_factory=dict)
    prefix: str = ""
    program_id: str = "tl.program_id(0)"


class _Body:
    """The names given so far and the lines written; each op's spelling is one method."""

    def __init__(self, errors: list[CheckArg], index_bits: int, scalars: frozenset[str], part: PartNaming,
                 hints: dict[UOp, str]):  # fmt: skip
        self.errors, self.scalars, self.part = errors, scalars, part
        self.hints = hints  # Note: cache hints for loads (codegen/eviction.py)
        self.widen = "" if index_bits == 32 else ".to(tl.int64)"
        self.names: dict[UOp, str] = {}
        self.lines: list[str] = []
        self.depth = 1
        self.counter = itertools.count()

    def ref(self, u: UOp) -> str:
        if u.op is Ops.CONST:
            return render_const(u.arg, u.dtype)
        if u.op is Ops.BUFFER:
            return self.part.rename.get(u.arg.name, u.arg.name)
        if u.op is Ops.BLOCK_SIZE:
            return u.arg.value
        if u.op is Ops.DEFINE_VAR:  # a size argument (Note: symbolic blocks, codegen/blocks.py)
            return u.arg.name
        return self.names[u]

    def line(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    def fresh(self, kind: str) -> str:
        return f"{self.part.prefix}{kind}{next(self.counter)}"

    def assign(self, u: UOp, text: str) -> None:
        name = self.fresh("t")
        self.line(f"{name} = {text}")
        self.names[u] = name

    def emit(self, u: UOp) -> None:
        handler = SPELLINGS.get(u.op)
        if handler is not None:
            handler(self, u)
        else:
            self.assign(u, self.expression(u))

    def expression(self, u: UOp) -> str:
        if u.op is Ops.WORD:
            return f"{self.ref(u.src[0])}[{u.arg}]"
        srcs = [self.ref(s) for s in u.src]
        if u.op in TYPED_OPERANDS:  # Triton functions want tensors, not Python numbers
            srcs = [t if s.op is not Ops.CONST or t.startswith("tl.full") else f"tl.full([], {t}, {tl_type(s.dtype)})"
                    for t, s in zip(srcs, u.src)]  # fmt: skip
        if u.src and all(s.op is Ops.CONST for s in u.src):  # a literal has no .to() and computes in Python
            srcs = [render_full("[]", s.arg, s.dtype) for s in u.src]
        return render_alu(u, srcs)

    # -- loops --
    def open_loop(self, r: UOp) -> None:
        """A loop over chunks of a block axis (its variable is the chunk's offset) or over
        elements one at a time."""
        name, numel = self.part.prefix + r.arg.name, spell_size(r.src[0], TRITON_SIZES)
        if r.src[0].op is not Ops.CONST:  # of size arguments (Note: symbolic blocks, triton_prelude.py)
            numel = f"ember_loop_bound({numel})"
        if r.arg.block is not None:
            self.line(f"for {name} in range(0, {numel}, {r.arg.block.value}):")
        else:
            self.line(f"for {name} in range({numel}):")
        self.depth += 1
        self.names[r] = name
        if r.arg.block is None and self.widen:
            self.names[r] = f"{name}_wide"
            self.line(f"{name}_wide = tl.cast({name}, tl.int64)")

    def close_loop(self, u: UOp) -> None:
        self.depth -= 1

    # -- blocks --
    def program_id(self, u: UOp) -> None:
        self.assign(u, f"{self.part.program_id}{self.widen}")

    def arange(self, u: UOp) -> None:
        axis, dims = u.arg.axis, u.arg.dims
        where = "" if dims == 1 else "[:, None]" if axis is BlockAxis.X else "[None, :]"
        self.assign(u, f"tl.arange(0, {axis.value}){where}{self.widen}")

    def block_reduce(self, u: UOp) -> None:
        call, value = REDUCE_CALLS[u.arg.combine], self.ref(u.src[0])
        if u.arg.axis is BlockAxis.R:
            self.assign(u, f"{call}(tl.broadcast_to({value}, [XBLOCK, RBLOCK]), 1, keep_dims=True)")
        else:  # a chunked loop's lanes, folded, for every x lane
            self.assign(u, f"tl.broadcast_to({call}({value}, 0, keep_dims=True), [XBLOCK, 1])")

    def block_scan(self, u: UOp) -> None:
        self.assign(u, scan_call(u.arg, tl_type(u.dtype), self.ref(u.src[0])))

    # -- memory --
    def index(self, u: UOp) -> None:
        self.names[u] = f"{self.ref(u.src[0])} + {self.ref(u.src[1])}"

    def load(self, u: UOp) -> None:
        buffer = u.src[0].src[0]
        if buffer.arg.name in self.scalars:  # a one-element buffer passed by value (the seed, an offset)
            if u.dtype.is_float:  # its bits (Note: host scalars by value)
                carrier = tl_type(scalar_carrier(u.dtype))
                self.assign(u, f"{self.ref(buffer)}.to({carrier}).to({tl_type(u.dtype)}, bitcast=True)")
            else:
                self.names[u] = self.ref(buffer)
            return
        mask = f", mask={self.ref(u.src[1])}" if len(u.src) > 1 else ""
        hint = f", eviction_policy='{self.hints[u]}'" if u in self.hints else ""
        self.assign(u, f"tl.load({self.ref(u.src[0])}{mask}{hint})")

    def store(self, u: UOp) -> None:
        index, value, mask = u.src
        if isinstance(u.arg, ScatterArg):
            self.scatter_store(u)
            return
        pointer = f"tl.broadcast_to({self.ref(index)}, {self.ref(mask)}.shape)"
        self.line(f"tl.store({pointer}, {self.ref(value)}, mask={self.ref(mask)})")

    def scatter_store(self, store: UOp) -> None:
        """Note: stores at computed positions on the GPU (renderer/triton_scatter.py)."""
        (buffer, position), value, mask = store.src[0].src, store.src[1], store.src[2]
        shape = f"{self.ref(mask)}.shape"
        stored = self.ref(value)
        if value.op is Ops.CONST:  # a literal has no block shape (nor .to())
            literal = render_const(value.arg, dtypes.float32 if value.dtype.is_float else value.dtype)
            stored = f"tl.full({shape}, {literal}, {tl_type(buffer.dtype)})"
        spec = ScatterStore(store.arg, buffer.dtype, tl_type(buffer.dtype), buffer.arg.name, self.ref(position),
                            stored, self.ref(mask), shape, self.fresh("s") + "_", "    " * self.depth)  # fmt: skip
        self.lines += scatter_store_lines(spec)

    def check(self, u: UOp) -> None:
        """Note: kernel errors on the GPU: active lanes whose check failed report its code."""
        value, ok, reported, mask = (self.ref(s) for s in u.src)
        failed = self.fresh("t")
        self.line(f"{failed} = ({ok} == 0) & {mask}")
        code = self.errors.index(u.arg) + 1
        self.line(f"tl.store(tl.broadcast_to(ember_error + {code}, {failed}.shape), {reported}, mask={failed})")
        self.line(f"tl.store(tl.broadcast_to(ember_error + 0, {failed}.shape), {code}, mask={failed})")
        self.names[u] = value

    def philox(self, u: UOp) -> None:
        """tl.randint4x(seed, offset + position): the C++ renderer's ember_philox, bit for bit, four
        words a call (Note: counter-based random numbers, lower/random.py). The counter is an int64
        (the offset, a scalar argument, may be an int32 while the sum is not)."""
        seed, offset, position = u.src
        if position.op is Ops.CONST:  # a 0-d random op: randint4x wants a tensor offset
            at = f"tl.full([], {position.arg}, tl.int64)"
        else:
            at = f"{self.ref(position)}.to(tl.int64)"
        self.assign(u, f"tl.randint4x({self.ref(seed)}, {self.ref(offset)}.to(tl.int64) + {at})")

    # -- accumulators --
    def define_acc(self, u: UOp) -> None:
        name = f"{self.part.prefix}acc{u.arg.id}"
        self.line(f"{name} = {render_full(u.arg.block.shape, u.arg.identity, u.dtype)}")
        self.names[u] = name

    def acc_update(self, u: UOp) -> None:
        acc, value = self.ref(u.src[0]), self.ref(u.src[1])
        combine = u.src[0].arg.combine
        if u.arg is AccUpdate.REPLACE:  # Note: a row's exponential sum in one pass (codegen/online_softmax.py)
            self.line(f"{acc} = {value}")
            self.names[u] = acc
            return
        if u.src[0].arg.block is not AccBlock.CARRY:
            self.line(f"{acc} = {combine_call(combine, u.dtype, acc, value)}")
            self.names[u] = acc
            return
        # Note: scans on blocks: the chunk's scan with the carry combined in; its last position carries on
        self.assign(u, combine_call(combine, u.dtype, acc, value))
        self.line(f"{acc} = ember_scan_last({self.names[u]}, tl.arange(0, RBLOCK)[None, :] == RBLOCK - 1)")

    def acc_prior(self, u: UOp) -> None:
        """The accumulator before this iteration's update: a name of its own, kept when the update
        rebinds the accumulator's."""
        self.assign(u, self.ref(u.src[0]))

    def acc_read(self, u: UOp) -> None:
        self.names[u] = self.ref(u.src[0])

    def acc_running(self, u: UOp) -> None:
        self.names[u] = self.ref(u.src[1])


SPELLINGS = {
    Ops.RANGE: _Body.open_loop, Ops.ENDRANGE: _Body.close_loop, Ops.PROGRAM_ID: _Body.program_id,
    Ops.ARANGE: _Body.arange, Ops.BLOCK_REDUCE: _Body.block_reduce, Ops.BLOCK_SCAN: _Body.block_scan,
    Ops.INDEX: _Body.index, Ops.LOAD: _Body.load, Ops.STORE: _Body.store, Ops.CHECK: _Body.check,
    Ops.PHILOX4: _Body.philox, Ops.DEFINE_ACC: _Body.define_acc, Ops.ACC_UPDATE: _Body.acc_update,
    Ops.ACC_READ: _Body.acc_read, Ops.ACC_RUNNING: _Body.acc_running, Ops.ACC_PRIOR: _Body.acc_prior,
}  # fmt: skip
