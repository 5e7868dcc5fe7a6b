"""Stage `renderer` (GPU), scans: a kernel AST with SCANs -> Triton, through tl.associative_scan.

Note: scans on blocks
    A scan kernel (Note: scans, lower/scans.py) has its loop ranges, flattened onto the x
    axis as in every kernel (rows in parallel across programs and within a block), and one
    scanned range, on the r axis; its stores vary with both. A SCAN is rendered on an
    [XBLOCK, RBLOCK] block of its value (positions past the row hold the combine's identity)
    as tl.associative_scan over axis 1 with the combine's jit function (tl.cumsum and
    tl.cumprod for sums and products, which the interpreter runs as numpy's).
    - persistent: the whole row in one block (RBLOCK >= the scanned extent): one scan.
    - looped: the row in RBLOCK chunks, in order. Each SCAN keeps a *carry* [XBLOCK, 1], the
      combination of the chunks before; a chunk's result is combine(carry, scan of the chunk),
      except in the first chunk (no identity is combined in, so -0.0 stays -0.0), and the new
      carry is the result's last position, picked by its bits (exact for NaN and -0.0).
    cummax/cummin's index is a second SCAN whose value reads the first (a running max of the
    positions where the element equals the running extreme or is NaN, eager's tie rule), so
    value and index are two scans that each keep their carry rather than one tuple scan: both
    backends share one lowering, and the looped variant needs no tuple carry.
    Accumulator types come from lowering: float sums, products and logcumsumexp in float64,
    integer ones in int64 (wrapping, as eager). Eager's CUDA cumsum accumulates float32 in
    float32 with a parallel scan; ember is at least as accurate. Bool scans (cummax of a bool
    tensor) run in int8, as Triton's max has no i1 form.
"""

from __future__ import annotations

from ember.renderer.triton import Phase, _Renderer, render_const, tl_type
from ember.renderer.triton_scatter import combine_text
from ember.uop.dtypes import DType, dtypes
from ember.uop.ops import Ops, UOp, reduce_identity

SCAN_PRELUDE = """

@triton.jit
def ember_logaddexp_combine(a, b):
    # log(e^a + e^b) = hi + log1p(e^(lo - hi)); lo - hi is NaN only for a NaN operand (NaN
    # results) or one infinity twice (that infinity results)
    hi = tl.where(a > b, a, b)
    lo = tl.where(a > b, b, a)
    same_infinity = (hi == lo) & ((hi - lo) != 0)
    return tl.where(same_infinity, hi, libdevice.log1p(tl.exp(lo - hi)) + hi)


@triton.jit
def ember_scan_last(x, is_last):
    # each row's element where `is_last`, by its bits: exact for NaN, infinities and -0.0
    bits_type = tl.core.get_int_dtype(x.dtype.primitive_bitwidth, signed=False)
    bits = x.to(bits_type, bitcast=True)
    picked = tl.sum(tl.where(is_last, bits, 0), 1, keep_dims=True)
    return picked.to(bits_type).to(x.dtype, bitcast=True)
"""

SCAN_CALLS = {Ops.MAX: "ember_max_combine", Ops.MIN: "ember_min_combine", Ops.LOGADDEXP: "ember_logaddexp_combine"}


def work_dtype(dtype: DType) -> DType:
    """The type a scan combines in: its own, but int8 for bools."""
    return dtypes.int8 if dtype.is_bool else dtype


class ScanRenderer(_Renderer):
    """_Renderer with SCAN (Note: scans on blocks); the scanned range's phase holds the stores."""

    prelude = SCAN_PRELUDE

    def _value(self, u: UOp, phase: Phase | None) -> str:
        if u.op is Ops.SCAN:
            if phase is None:
                raise RuntimeError("Triton renderer: a SCAN outside its scanned range's phase")
            return self.scan(u, phase)
        return super()._value(u, phase)

    def scan(self, scan: UOp, phase: Phase) -> str:
        combine, work = scan.arg, work_dtype(scan.dtype)
        identity = render_const(reduce_identity(combine, scan.dtype), scan.dtype)
        scope = phase.scope
        masked = f"tl.where({self.full_mask(phase)}, {self.value(scan.src[0], phase)}, {identity})"
        if work is not scan.dtype:
            masked += f".to({tl_type(work)})"
        block = self.emit(scope, masked)
        scanned = self.emit(scope, self.scan_call(combine, work, block))
        if not self.persistent:
            scanned = self.carried(combine, work, scanned, phase)
        return scanned if work is scan.dtype else self.emit(scope, f"({scanned} != 0)")

    @staticmethod
    def scan_call(combine: Ops, work: DType, block: str) -> str:
        if combine is Ops.ADD:  # dtype given: tl.cumsum would widen narrow integers
            return f"tl.cumsum({block}, 1, dtype={tl_type(work)})"
        if combine is Ops.MUL:
            return f"tl.cumprod({block}, 1)"
        if combine not in SCAN_CALLS:
            raise NotImplementedError(f"Triton renderer: no scan for combine {combine.name}")
        return f"tl.associative_scan({block}, 1, {SCAN_CALLS[combine]})"

    def carried(self, combine: Ops, work: DType, scanned: str, phase: Phase) -> str:
        """The chunk's scan with the carry of the chunks before combined in; updates the carry."""
        carry = f"carry{self.counter}"
        self.counter += 1
        identity = render_const(reduce_identity(combine, work), work)
        self.top.lines.append(f"    {carry} = tl.full([XBLOCK, 1], {identity}, {tl_type(work)})")
        joined = combine_call(combine, work, carry, scanned)
        running = self.emit(phase.scope, f"tl.where(roffset > 0, {joined}, {scanned})")
        last = f"{phase.index} == roffset + (RBLOCK - 1)"
        phase.scope.lines.append(f"{phase.scope.indent}{carry} = ember_scan_last({running}, {last})")
        return running


def combine_call(combine: Ops, dtype: DType, a: str, b: str) -> str:
    if combine is Ops.LOGADDEXP:
        return f"{SCAN_CALLS[combine]}({a}, {b})"
    return combine_text(combine, dtype, a, b)
