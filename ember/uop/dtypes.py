"""ember's scalar types, mapped to torch dtypes and C types.

Every stage names types through `DType`; only the frontend and the wrapper translate from
and to `torch.dtype`, and only the C++ renderer reads `ctype`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int
    ctype: str
    kind: str  # "float" | "int" | "uint" | "bool" | "index"

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind in ("int", "uint", "index")

    @property
    def is_bool(self) -> bool:
        return self.kind == "bool"

    @property
    def min(self) -> int | float:
        if self.is_float:
            return -math.inf
        if self.is_bool or self.kind == "uint":
            return 0
        return -(2 ** (8 * self.itemsize - 1))

    @property
    def max(self) -> int | float:
        if self.is_float:
            return math.inf
        if self.is_bool:
            return 1
        bits = 8 * self.itemsize
        return 2**bits - 1 if self.kind == "uint" else 2 ** (bits - 1) - 1

    def __repr__(self) -> str:
        return f"dtypes.{self.name}"


class dtypes:  # noqa: N801 - a namespace, spelled like torch's
    bool = DType("bool", 1, "bool", "bool")
    int8 = DType("int8", 1, "int8_t", "int")
    int16 = DType("int16", 2, "int16_t", "int")
    int32 = DType("int32", 4, "int32_t", "int")
    int64 = DType("int64", 8, "int64_t", "int")
    uint8 = DType("uint8", 1, "uint8_t", "uint")
    # Kernel-internal only (random bits, Note: counter-based random numbers; a bfloat16's bits,
    # Note: semantics written once, codegen/primitives.py); no tensor has them.
    uint16 = DType("uint16", 2, "uint16_t", "uint")
    uint32 = DType("uint32", 4, "uint32_t", "uint")
    # Note: low-precision floats. float16 and bfloat16 live in memory as their 16 bits
    # (`uint16_t`); kernels compute on them in float32 (codegen/low_precision.py) and convert
    # with exact, branch-free helpers (renderer/cpp.py), so rounding matches eager bit for bit.
    float16 = DType("float16", 2, "uint16_t", "float")
    bfloat16 = DType("bfloat16", 2, "uint16_t", "float")
    float32 = DType("float32", 4, "float", "float")
    float64 = DType("float64", 8, "double", "float")
    # Loop variables and index arithmetic; rendered as int64_t (narrowed later when it fits).
    index = DType("index", 8, "int64_t", "index")
    # STORE, SINK and other ops that produce no value.
    void = DType("void", 0, "void", "void")


_FROM_TORCH: dict[torch.dtype, DType] = {
    torch.bool: dtypes.bool,
    torch.int8: dtypes.int8,
    torch.int16: dtypes.int16,
    torch.int32: dtypes.int32,
    torch.int64: dtypes.int64,
    torch.uint8: dtypes.uint8,
    torch.float16: dtypes.float16,
    torch.bfloat16: dtypes.bfloat16,
    torch.float32: dtypes.float32,
    torch.float64: dtypes.float64,
}
_TO_TORCH = {v: k for k, v in _FROM_TORCH.items()}


def from_torch(dtype: torch.dtype) -> DType:
    """The ember dtype for a torch dtype. Types ember has no kernels for yet come back with
    kind "opaque": buffers of them flow between fallback externs, kernels refuse them."""
    if dtype in _FROM_TORCH:
        return _FROM_TORCH[dtype]
    return DType(str(dtype).removeprefix("torch."), dtype.itemsize, "", "opaque")


def to_torch(dtype: DType) -> torch.dtype:
    return _TO_TORCH.get(dtype) or getattr(torch, dtype.name)


def is_kernel_dtype(dtype: DType) -> bool:
    return dtype in _TO_TORCH


LOW_PRECISION = frozenset({dtypes.float16, dtypes.bfloat16})


def is_low_precision(dtype: DType) -> bool:
    """A storage-only float: loaded into float32 to compute, rounded back to store."""
    return dtype in LOW_PRECISION


def round_to(dtype: DType, value: float) -> float:
    """`value` rounded to a low-precision float as eager rounds a Python scalar: through
    float32 to nearest-even, NaN stays NaN, overflow is inf."""
    return _as_low_precision(dtype.name, repr(float(value)))[0]


def bits_of(dtype: DType, value: float) -> int:
    """The 16-bit pattern of `value` in a low-precision float (NaN: the quiet positive NaN)."""
    return _as_low_precision(dtype.name, repr(float(value)))[1]


@functools.lru_cache(maxsize=4096)
def _as_low_precision(name: str, text: str) -> tuple[float, int]:
    """(value, bits) of float(text) in torch dtype `name`; keyed by repr, which keeps -0.0
    apart from 0.0 and round-trips every float."""
    low = torch.tensor(float(text), dtype=torch.float64).to(getattr(torch, name))
    return float(low.item()), int(low.view(torch.int16).item()) & 0xFFFF
