"""Stage `renderer` (GPU): a kernel AST -> Triton source (one module, one or two variants).

The Triton renderer takes the AST after `codegen/phases.block_rewrite`: the shared phases but
not reduce lowering (which lowers REDUCE to scalar accumulators in CPU loops): Triton computes
on blocks, so a REDUCE stays a reduction over a block axis.

Note: blocks for a kernel AST
    The loop ranges a REDUCE varies with are the *outer* ranges; flattened, they index the
    x axis: program `pid` owns x positions pid*XBLOCK + arange(XBLOCK). A kernel with no
    REDUCE is all outer ranges (pointwise: blocks of shape [XBLOCK]). Otherwise blocks are
    [XBLOCK, RBLOCK]: each REDUCE is one *phase* over its own reduce ranges, flattened onto
    the r axis and reduced to [XBLOCK, 1]; then the stores that vary with the remaining
    loop ranges (the *inner* ranges: softmax's normalizing pass over the row) are one more
    phase over those. A value is computed in the scope of the ranges it varies with: outer
    values once per program, phase values inside their phase. The *persistent* variant
    takes a whole row in one block (RBLOCK >= every phase's extent), so the phases share
    one `rindex` and identical loads in two phases are one load (expressions are
    deduplicated by their text); the *looped* variant walks each phase in RBLOCK steps,
    with a block accumulator per REDUCE. The launcher (runtime/triton.py) times both.

Note: nested reductions
    A REDUCE whose source holds another REDUCE that varies with its reduce ranges (the mean
    over rows of each row's logsumexp: cross-entropy; multilabel_margin_loss) cannot be one
    block phase: the inner one needs the r axis for its own elements. The enclosing REDUCE is
    *sequential* instead: a `for` loop over its elements with a [XBLOCK, 1] accumulator, and
    the reductions inside run as ordinary phases in each iteration (persistent or looped), so
    nesting goes as deep as the AST does. A sequential REDUCE that varies with no loop (a
    loss: one number) is *chunked*: XBLOCK elements per iteration on the x lanes (nothing in it
    varies with x, so the lanes are free; masked by the loop's own bound instead of xmask),
    reduced over x at the end; the launcher sizes XBLOCK by that extent (`xextent`), the grid
    by xnumel. When the kernel also has an x axis (cross-entropy's loss fused with per-row
    outputs), every program computes the loss (redundant work, no extra kernel). A sequential
    REDUCE that varies with other loops walks one element (a scalar) per iteration. Phases
    form a chain (`Phase.parent`): a value is emitted in the innermost phase whose ranges it
    varies with, so per-row values are computed once per row, row-invariant ones once.

Note: kernel errors on the GPU
    As on the CPU (Note: kernel errors, renderer/cpp.py) a failed CHECK computes on with
    its safe value and stores its code (1 + position in `errors`) in `ember_error[0]`, a
    device int32 of the call's own (`GpuErrorFlags`, made per call, so threads running one
    graph never see each other's errors) the wrapper reads after the graph ran. Only active lanes report: masked
    tail lanes compute on padding and must not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ember.codegen.blocks import KernelShape, elements
from ember.renderer.triton_math import render_math
from ember.renderer.triton_scatter import ScatterStore, combine_text, scatter_store_lines
from ember.uop.dtypes import DType, bits_of, dtypes
from ember.uop.ops import CheckArg, Ops, ScatterArg, UOp, reduce_identity

TL_TYPES = {
    "bool": "tl.int1", "int8": "tl.int8", "int16": "tl.int16", "int32": "tl.int32", "int64": "tl.int64",
    "uint8": "tl.uint8", "uint16": "tl.uint16", "uint32": "tl.uint32", "float16": "tl.float16",
    "bfloat16": "tl.bfloat16", "float32": "tl.float32",
    "float64": "tl.float64", "index": "tl.int64",
}  # fmt: skip


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


def render_full(shape: str, value, dtype: DType) -> str:
    """A block of `shape` filled with the constant (Note: low-precision floats in Triton)."""
    if dtype is dtypes.bfloat16:
        return f"tl.full({shape}, {bits_of(dtype, value)}, tl.uint16).to(tl.bfloat16, bitcast=True)"
    return f"tl.full({shape}, {render_const(value, dtypes.float32 if dtype.is_float else dtype)}, {tl_type(dtype)})"


def render_const(value, dtype: DType) -> str:
    if dtype in LOW_PRECISION:
        return render_full("[]", value, dtype)
    if dtype.is_bool:
        return "True" if value else "False"
    if dtype.is_float:
        text = repr(float(value)) if math.isfinite(value) else f'float("{value}")'
        return text if dtype is dtypes.float32 else f"tl.full([], {text}, {tl_type(dtype)})"
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


# ---- rendering --------------------------------------------------------------------------


@dataclass
class Scope:
    """A block of statements; `names` maps an expression's text to the variable holding it
    (CSE), visible to inner scopes."""

    lines: list[str]
    indent: str
    parent: Scope | None = None
    names: dict[str, str] = field(default_factory=dict)

    def lookup(self, text: str) -> str | None:
        scope: Scope | None = self
        while scope is not None:
            if text in scope.names:
                return scope.names[text]
            scope = scope.parent
        return None


@dataclass
class Phase:
    """One pass over the r axis (Note: blocks for a kernel AST), or with `sequential` a loop
    over a reduction's elements one at a time (Note: nested reductions)."""

    ranges: tuple[UOp, ...]
    numel: int
    scope: Scope
    index: str  # the flattened r position's variable (a block), or the loop's (a scalar)
    parent: Phase | None = None  # the phase this one runs inside
    sequential: bool = False
    chunked: bool = False  # a sequential phase walking XBLOCK elements at a time on the x axis

    def chain(self):
        """This phase and those it runs inside, innermost first."""
        phase: Phase | None = self
        while phase is not None:
            yield phase
            phase = phase.parent


class _Renderer:
    prelude = ""  # jit helpers this kind of kernel calls, beyond PRELUDE

    def __init__(self, sink: UOp, shape: KernelShape, errors: list[CheckArg], persistent: bool, bits: int,
                 scalars: frozenset[str] = frozenset()):  # fmt: skip
        self.sink, self.shape, self.errors, self.persistent = sink, shape, errors, persistent
        self.bits, self.scalars = bits, scalars
        self.top = Scope([], "    ")
        self.counter = 0
        self.memo: dict[tuple[int, UOp], str] = {}  # (id of phase or 0, uop) -> name
        self.phases: list[Phase] = []  # every phase opened, alive while their ids key `memo`

    # -- structure --
    def render(self) -> list[str]:
        top = self.top
        xdims = "" if self.shape.pointwise else "[:, None]"
        offset = "tl.program_id(0)" + ("" if self.bits == 32 else ".to(tl.int64)")
        top.lines += [f"    xindex = {offset} * XBLOCK + tl.arange(0, XBLOCK){xdims}",
                      f"    xmask = xindex < {self.shape.xnumel}"]  # fmt: skip
        for red in self.shape.reduces:
            if not any(r.arg.reduce for r in red.ranges):  # nested ones render inside their loop
                self.value(red, None)
        stores = [s for s in self.sink.src if s.op is Ops.STORE]
        outer_set = set(self.shape.outer)
        outer_stores = [s for s in stores if s.ranges <= outer_set]
        for store in outer_stores:
            self.store(store, None)
        inner_stores = [s for s in stores if s not in outer_stores]
        if inner_stores:
            phase = self.open_phase(self.shape.inner, None)
            for store in inner_stores:
                self.store(store, phase)
            self.close_phase(phase)
        return top.lines

    def open_phase(self, ranges: tuple[UOp, ...], parent: Phase | None) -> Phase:
        numel, outside = elements(ranges), self.scope_of(parent)
        if self.persistent:
            # one flat scope: phases share rindex and their loads (Note: blocks)
            if "rbase" not in self.top.names:
                self.top.names["rbase"] = "rbase"
                self.top.lines.append("    rbase = tl.arange(0, RBLOCK)[None, :]" + self._widen())
            return self._keep(Phase(ranges, numel, outside, "rbase", parent))
        pad = outside.indent + "    "
        scope = Scope([f"{outside.indent}for roffset in range(0, {numel}, RBLOCK):"], pad, outside)
        scope.lines.append(f"{pad}rindex = roffset + tl.arange(0, RBLOCK)[None, :]{self._widen()}")
        return self._keep(Phase(ranges, numel, scope, "rindex", parent))

    def open_loop(self, ranges: tuple[UOp, ...], parent: Phase | None, chunked: bool) -> Phase:
        """A sequential phase: a loop over `ranges`, one element (a scalar) or XBLOCK of them
        (a [XBLOCK, 1] block) at a time (Note: nested reductions)."""
        outside, name, numel = self.scope_of(parent), f"e{self.counter}", elements(ranges)
        self.counter += 1
        pad = outside.indent + "    "
        if chunked:
            scope = Scope([f"{outside.indent}for {name}_offset in range(0, {numel}, XBLOCK):"], pad, outside)
            scope.lines.append(f"{pad}{name} = {name}_offset + tl.arange(0, XBLOCK)[:, None]{self._widen()}")
            return self._keep(Phase(ranges, numel, scope, name, parent, sequential=True, chunked=True))
        scope = Scope([f"{outside.indent}for {name} in range({numel}):"], pad, outside)
        index = name if self.bits == 32 else f"tl.cast({name}, tl.int64)"
        return self._keep(Phase(ranges, numel, scope, index, parent, sequential=True))

    def _keep(self, phase: Phase) -> Phase:
        self.phases.append(phase)
        return phase

    def scope_of(self, phase: Phase | None) -> Scope:
        return phase.scope if phase is not None else self.top

    def _widen(self) -> str:
        return "" if self.bits == 32 else ".to(tl.int64)"

    def close_phase(self, phase: Phase) -> None:
        if phase.sequential or not self.persistent:
            self.scope_of(phase.parent).lines += phase.scope.lines

    def emit(self, scope: Scope, text: str) -> str:
        if (name := scope.lookup(text)) is not None:
            return name
        name = f"t{self.counter}"
        self.counter += 1
        scope.lines.append(f"{scope.indent}{name} = {text}")
        scope.names[text] = name
        return name

    # -- values --
    def value(self, u: UOp, phase: Phase | None) -> str:
        """The name (or inline text) of `u`'s value, emitted into the scope it varies in."""
        here = next((p for p in phase.chain() if u.ranges & set(p.ranges)), None) if phase is not None else None
        key = (id(here) if here is not None else 0, u)
        if key in self.memo:
            return self.memo[key]
        text = self._value(u, here)
        self.memo[key] = text
        return text

    def _value(self, u: UOp, phase: Phase | None) -> str:
        scope = self.scope_of(phase)
        if u.op is Ops.CONST:
            return render_const(u.arg, u.dtype)
        if u.op is Ops.RANGE:
            return self.range_text(u, phase)
        if u.op is Ops.LOAD:
            return self.emit(scope, self.load_text(u.src[0], phase))
        if u.op is Ops.REDUCE:
            return self.reduce(u, phase)
        if u.op is Ops.CHECK:
            return self.check(u, phase)
        if u.op is Ops.PHILOX:
            return self.philox(u, phase)
        srcs = [self.value(s, phase) for s in u.src]
        if u.op in TYPED_OPERANDS:  # Triton functions want tensors, not Python numbers
            srcs = [t if s.op is not Ops.CONST or t.startswith("tl.full") else f"tl.full([], {t}, {tl_type(s.dtype)})"
                    for t, s in zip(srcs, u.src)]  # fmt: skip
        if all(s.op is Ops.CONST for s in u.src):  # a literal has no .to() and computes in Python
            shape = self.block_shape(None)
            srcs = [render_full(shape, s.arg, s.dtype) for s in u.src]
        return self.emit(scope, render_alu(u, srcs))

    def range_text(self, r: UOp, phase: Phase | None) -> str:
        if r in self.shape.outer:
            return _decompose("xindex", self.shape.outer, r)
        owner = next((p for p in phase.chain() if r in p.ranges), None) if phase is not None else None
        if owner is None:
            raise RuntimeError(f"Triton renderer: range {r.arg.name} used outside its phase")
        return _decompose(owner.index, owner.ranges, r)

    def mask(self, index: UOp, phase: Phase | None) -> str | None:
        ranges = {r for r in index.toposort if r.op is Ops.RANGE}
        parts = []
        if ranges & set(self.shape.outer):
            parts.append("xmask")
        for p in phase.chain() if phase is not None else ():
            if (p.chunked or not p.sequential) and ranges & set(p.ranges):
                parts.append(f"({p.index} < {p.numel})")
        return " & ".join(parts) if parts else None

    def load_text(self, index: UOp, phase: Phase | None) -> str:
        buffer, position = index.src
        if buffer.arg.name in self.scalars:  # a one-element buffer passed by value (the seed)
            return buffer.arg.name
        mask = self.mask(position, phase)
        pointer = f"{buffer.arg.name} + {self.value(position, phase)}"
        return f"tl.load({pointer}, mask={mask})" if mask else f"tl.load({pointer})"

    def full_mask(self, phase: Phase | None) -> str:
        """The lanes that compute real elements: x lanes (or a chunked loop's), r lanes."""
        chunk = next((p for p in phase.chain() if p.chunked), None) if phase is not None else None
        lanes = "xmask" if chunk is None else f"({chunk.index} < {chunk.numel})"
        block = self.block_phase(phase)
        return lanes if block is None else f"{lanes} & ({block.index} < {block.numel})"

    def block_phase(self, phase: Phase | None) -> Phase | None:
        """The phase over the r axis that `phase` is or runs in (a sequential one runs in none)."""
        return next((p for p in phase.chain() if not p.sequential), None) if phase is not None else None

    def block_shape(self, phase: Phase | None) -> str:
        if self.shape.pointwise:
            return "[XBLOCK]"
        return "[XBLOCK, 1]" if self.block_phase(phase) is None else "[XBLOCK, RBLOCK]"

    def store(self, store: UOp, phase: Phase | None) -> None:
        index, value = store.src[:2]  # (a scatter may add ranges it repeats over: codegen/kernel.py)
        buffer, position = index.src
        scope = self.scope_of(phase)
        pointer = f"tl.broadcast_to({buffer.arg.name} + {self.value(position, phase)}, {self.block_shape(phase)})"
        stored = self.value(value, phase)
        if value.dtype != buffer.dtype:
            stored = f"{stored}.to({tl_type(buffer.dtype)})"
        if isinstance(store.arg, ScatterArg):
            self.scatter_store(store, stored, phase)
            return
        scope.lines.append(f"{scope.indent}tl.store({pointer}, {stored}, mask={self.full_mask(phase)})")

    def scatter_store(self, store: UOp, stored: str, phase: Phase | None) -> None:
        """Note: stores at computed positions on the GPU (renderer/triton_scatter.py)."""
        (buffer, position), value = store.src[0].src, store.src[1]
        scope, shape = self.scope_of(phase), self.block_shape(phase)
        if value.op is Ops.CONST:  # a literal has no block shape (nor .to())
            literal = render_const(value.arg, dtypes.float32 if value.dtype.is_float else value.dtype)
            stored = f"tl.full({shape}, {literal}, {tl_type(buffer.dtype)})"
        spec = ScatterStore(store.arg, buffer.dtype, tl_type(buffer.dtype), buffer.arg.name,
                            self.value(position, phase), stored, self.full_mask(phase), shape,
                            f"s{self.counter}_", scope.indent)  # fmt: skip
        self.counter += 1
        scope.lines += scatter_store_lines(spec)

    def check(self, u: UOp, phase: Phase | None) -> str:
        scope = self.scope_of(phase)
        value, ok = self.value(u.src[0], phase), self.value(u.src[1], phase)
        code = self.errors.index(u.arg) + 1
        pointer = f"tl.broadcast_to(ember_error + 0, {self.block_shape(phase)})"
        line = f"{scope.indent}tl.store({pointer}, {code}, mask=({ok} == 0) & {self.full_mask(phase)})"
        if line not in scope.lines:
            scope.lines.append(line)
        return value

    def philox(self, u: UOp, phase: Phase | None) -> str:
        """Word `u.arg` of tl.randint4x(seed, counter): the C++ renderer's ember_philox, bit for
        bit (Note: counter-based random numbers, lower/random.py). The four words of one
        counter come from one call (the call's text is deduplicated)."""
        scope = phase.scope if phase is not None else self.top
        seed, counter = u.src
        offset = self.value(counter, phase)
        if counter.op is Ops.CONST:  # a 0-d random op: randint4x wants a tensor offset
            offset = f"tl.full([], {counter.arg}, tl.int64)"
        words = self.emit(scope, f"tl.randint4x({self.value(seed, phase)}, {offset})")
        return self.emit(scope, f"{words}[{u.arg}]")

    def reduce(self, red: UOp, parent: Phase | None) -> str:
        if red in self.shape.sequential:
            return self.sequential_reduce(red, parent)
        combine, dtype = red.arg, red.dtype
        identity = render_const(reduce_identity(combine, dtype), dtype)
        outside = self.scope_of(parent)
        phase = self.open_phase(red.src[1:], parent)
        value = self.value(red.src[0], phase)
        mask = self.full_mask(phase)
        call = REDUCE_CALLS[combine]
        if self.persistent:
            masked = self.emit(outside, f"tl.where({mask}, {value}, {identity})")
            return self.emit(outside, f"{call}(tl.broadcast_to({masked}, [XBLOCK, RBLOCK]), 1, keep_dims=True)")
        acc = f"acc{self.counter}"
        self.counter += 1
        outside.lines.append(f"{outside.indent}{acc} = tl.full([XBLOCK, RBLOCK], {identity}, {tl_type(dtype)})")
        masked = f"tl.where({mask}, {value}, {identity})"
        phase.scope.lines.append(f"{phase.scope.indent}{acc} = {combine_text(combine, dtype, acc, masked)}")
        self.close_phase(phase)
        return self.emit(outside, f"{call}({acc}, 1, keep_dims=True)")

    def sequential_reduce(self, red: UOp, parent: Phase | None) -> str:
        """Note: nested reductions. A [XBLOCK, 1] accumulator updated once per element, or,
        chunked, once per XBLOCK elements and then reduced over x."""
        combine, dtype = red.arg, red.dtype
        identity = render_const(reduce_identity(combine, dtype), dtype)
        outside = self.scope_of(parent)
        acc = f"acc{self.counter}"
        self.counter += 1
        outside.lines.append(f"{outside.indent}{acc} = tl.full([XBLOCK, 1], {identity}, {tl_type(dtype)})")
        loop = self.open_loop(red.src[1:], parent, chunked=red in self.shape.chunked)
        value = self.value(red.src[0], loop)
        if loop.chunked:
            value = f"tl.where({loop.index} < {loop.numel}, {value}, {identity})"
        loop.scope.lines.append(f"{loop.scope.indent}{acc} = {combine_text(combine, dtype, acc, value)}")
        self.close_phase(loop)
        if not loop.chunked:
            return acc
        return self.emit(outside, f"tl.broadcast_to({REDUCE_CALLS[combine]}({acc}, 0, keep_dims=True), [XBLOCK, 1])")


def _decompose(index: str, ranges: tuple[UOp, ...], r: UOp) -> str:
    """Range `r`'s value at the flattened position `index` over `ranges` (last fastest)."""
    i = ranges.index(r)
    stride = elements(ranges[i + 1 :])
    text = index if stride == 1 else f"({index} // {stride})"
    return text if i == 0 else f"({text} % {r.src[0].arg})"
