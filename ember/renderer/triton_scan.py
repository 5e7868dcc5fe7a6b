"""Stage `renderer` (GPU), scans: the spellings of block scans (BLOCK_SCAN, a carry's update) in Triton.

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
      and the new carry is the result's last position, picked by its bits (exact for NaN and
      -0.0). The carry starts at the combine's identity, -0.0 for float sums (-0.0 + x is x for
      every x, -0.0 too), so the first chunk's result is its scan, bit for bit.
    Block lowering (Note: block lowering, codegen/block_lowering.py) makes these BLOCK_SCAN and
    a carry accumulator (AccBlock.CARRY); the renderer spells them with the calls below.
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

from ember.renderer.triton_scatter import combine_text
from ember.uop.dtypes import DType
from ember.uop.ops import Ops

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


def scan_call(combine: Ops, tl_dtype: str, block: str) -> str:
    """The scan of `block` along the r axis, in the Triton type `tl_dtype`."""
    if combine is Ops.ADD:  # dtype given: tl.cumsum would widen narrow integers
        return f"tl.cumsum({block}, 1, dtype={tl_dtype})"
    if combine is Ops.MUL:
        return f"tl.cumprod({block}, 1)"
    if combine not in SCAN_CALLS:
        raise NotImplementedError(f"Triton renderer: no scan for combine {combine.name}")
    return f"tl.associative_scan({block}, 1, {SCAN_CALLS[combine]})"


def combine_call(combine: Ops, dtype: DType, a: str, b: str) -> str:
    """combine(a, b) for an accumulator's update: the reductions' combines and logcumsumexp's."""
    if combine is Ops.LOGADDEXP:
        return f"{SCAN_CALLS[combine]}({a}, {b})"
    return combine_text(combine, dtype, a, b)
