"""Stage `renderer` (GPU): stores at computed positions (a STORE with a `ScatterArg`) as Triton.

Note: stores at computed positions on the GPU
    The lanes of a Triton block run at once, so even a store with an owner dim (which the
    C++ renderer makes a plain read-combine-write, Note: stores at computed positions,
    lower/scatter.py) may meet another lane of its own block at one element: every combining
    store is atomic here, whatever `ScatterArg.atomic` says.
    - Overwrites (no combine) are plain masked stores: aligned elements never tear, and with
      duplicate positions one of the values lands, as in eager (unspecified there too).
    - Sums of 32- and 64-bit integers and floats are `tl.atomic_add`; max/min of 32- and
      64-bit integers are `tl.atomic_max`/`tl.atomic_min` (relaxed: nothing orders on them).
      Float sums then add in a run-dependent order, as eager's CUDA scatter_add does.
    - Everything else is a compare-and-swap loop on the element's bits: products (Triton has
      no atomic multiply), float max/min (Triton's float atomic_max compares bit patterns,
      which drops NaN; eager's propagates it), and any combine on 8- or 16-bit elements (bool,
      int8, uint8, int16: no atomics that narrow), which swap the aligned 32-bit word holding
      the element. The loop runs while a lane of the block has not landed its update; a lane
      that has (or is masked off) swaps a value for itself, which changes nothing, because
      `tl.atomic_cas` takes no mask. Masked-off lanes point at element 0 (a store has at
      least one element, lower/scatter.py `store_at`), so no lane reads out of bounds.
    Positions read from data are clamped and CHECKed in lowering, so a bad index raises
    eager's exception through the device error flag (Note: kernel errors on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.uop.dtypes import DType
from ember.uop.ops import Ops, ScatterArg

ATOMIC_CALLS = {Ops.ADD: "tl.atomic_add", Ops.MAX: "tl.atomic_max", Ops.MIN: "tl.atomic_min"}
FULL_WIDTH_BITS = {4: "tl.int32", 8: "tl.int64"}  # itemsize -> the integer type a CAS swaps


@dataclass(frozen=True)
class ScatterStore:
    """What the renderer knows of one store, as Triton text."""

    arg: ScatterArg
    dtype: DType  # the element's (the buffer's) dtype
    tl_dtype: str
    buffer: str  # the pointer parameter
    offset: str  # the element's position (a block, or a literal)
    value: str  # a block of the values, already of `dtype`
    mask: str  # the active lanes
    shape: str  # the block shape, e.g. "[XBLOCK]"
    prefix: str  # a unique prefix for the loop's variables
    indent: str


def scatter_store_lines(s: ScatterStore) -> list[str]:
    """The statements of one store at computed positions (Note: stores at computed positions on the GPU)."""
    combine = s.arg.combine
    pointer = f"tl.broadcast_to({s.buffer} + {s.offset}, {s.shape})"
    if combine is None:
        return [f"{s.indent}tl.store({pointer}, {s.value}, mask={s.mask})"]
    if _has_atomic(combine, s.dtype):
        call = ATOMIC_CALLS[combine]
        return [f'{s.indent}{call}({pointer}, {s.value}, mask={s.mask}, sem="relaxed")']
    if s.dtype.itemsize in FULL_WIDTH_BITS:
        return _cas_loop(s)
    return _cas_loop_in_word(s)


def _has_atomic(combine: Ops, dtype: DType) -> bool:
    if dtype.is_bool or dtype.itemsize not in FULL_WIDTH_BITS or combine not in ATOMIC_CALLS:
        return False
    return combine is Ops.ADD or not dtype.is_float  # float max/min: the CAS loop keeps NaN


def combine_text(combine: Ops, dtype: DType, a: str, b: str) -> str:
    """combine(a, b) as eager's reductions, scans and scatter reductions compute it: bools as logic,
    NaN propagating (every Triton accumulator and atomic update combines with it)."""
    if dtype.is_bool:
        return f"({a} | {b})" if combine in (Ops.ADD, Ops.MAX) else f"({a} & {b})"
    if combine in (Ops.ADD, Ops.MUL):
        return f"({a} {'+' if combine is Ops.ADD else '*'} {b})"
    fn = "tl.maximum" if combine is Ops.MAX else "tl.minimum"
    nan = ", propagate_nan=tl.PropagateNan.ALL" if dtype.is_float else ""
    return f"{fn}({a}, {b}{nan})"


def _safe_pointer(s: ScatterStore) -> str:
    return f"tl.broadcast_to({s.buffer} + tl.where({s.mask}, {s.offset}, 0), {s.shape})"


def _loop_head(s: ScatterStore, current: str) -> list[str]:
    """What both compare-and-swap loops start with: the value, the lanes still to store, the
    memory's `current` contents at `ptr`, and a loop while any lane is left."""
    p, pad = s.prefix, s.indent
    return [
        f"{pad}{p}value = {s.value}",
        f"{pad}{p}todo = tl.broadcast_to({s.mask}, {s.shape})",
        f"{pad}{p}{current} = tl.load({p}ptr, mask={p}todo, other=0)",
        f"{pad}while tl.sum({p}todo.to(tl.int32)) > 0:",
    ]


def _cas_loop(s: ScatterStore) -> list[str]:
    """A compare-and-swap loop on a 32- or 64-bit element's bits."""
    p, pad, bits = s.prefix, s.indent, FULL_WIDTH_BITS[s.dtype.itemsize]
    assert s.arg.combine is not None
    new = combine_text(s.arg.combine, s.dtype, f"{p}old", f"{p}value")
    return [
        f"{pad}{p}ptr = {_safe_pointer(s)}",
        *_loop_head(s, "old"),
        f"{pad}    {p}want = tl.where({p}todo, {new}, {p}old)",
        f"{pad}    {p}expected = {p}old.to({bits}, bitcast=True)",
        f"{pad}    {p}seen = tl.atomic_cas({p}ptr.to(tl.pointer_type({bits})), {p}expected, "
        f'{p}want.to({bits}, bitcast=True), sem="relaxed")',
        f"{pad}    {p}todo = {p}todo & ({p}seen != {p}expected)",
        f"{pad}    {p}old = {p}seen.to({s.tl_dtype}, bitcast=True)",
    ]


def _cas_loop_in_word(s: ScatterStore) -> list[str]:
    """A compare-and-swap loop on the aligned 32-bit word holding an 8- or 16-bit element
    (little-endian: the element's byte offset in the word times 8 is its shift)."""
    p, pad = s.prefix, s.indent
    field = (1 << (8 * s.dtype.itemsize)) - 1
    assert s.arg.combine is not None
    new = combine_text(s.arg.combine, s.dtype, f"{p}old", f"{p}value")
    return [
        f"{pad}{p}address = {_safe_pointer(s)}.to(tl.int64)",
        f"{pad}{p}ptr = ({p}address & -4).to(tl.pointer_type(tl.int32))",
        f"{pad}{p}shift = (({p}address & 3) * 8).to(tl.int32)",
        *_loop_head(s, "word"),
        f"{pad}    {p}old = {_from_bits(f'(({p}word >> {p}shift) & {field})', s.dtype, s.tl_dtype)}",
        f"{pad}    {p}bits = {_to_bits(new, s.dtype)}",
        f"{pad}    {p}want = ({p}word & ~({field} << {p}shift)) | ({p}bits << {p}shift)",
        f"{pad}    {p}want = tl.where({p}todo, {p}want, {p}word)",
        f'{pad}    {p}seen = tl.atomic_cas({p}ptr, {p}word, {p}want, sem="relaxed")',
        f"{pad}    {p}todo = {p}todo & ({p}seen != {p}word)",
        f"{pad}    {p}word = {p}seen",
    ]


def _from_bits(part: str, dtype: DType, tl_dtype: str) -> str:
    """An 8- or 16-bit element from its bits in the low end of an int32 (truncating)."""
    return f"({part} != 0)" if dtype.is_bool else f"{part}.to({tl_dtype})"


def _to_bits(value: str, dtype: DType) -> str:
    """An 8- or 16-bit element's bits, zero-extended into an int32."""
    if dtype.is_bool or dtype.kind == "uint":
        return f"{value}.to(tl.int32)"
    unsigned = {1: "tl.uint8", 2: "tl.uint16"}[dtype.itemsize]
    return f"{value}.to({unsigned}, bitcast=True).to(tl.int32)"
