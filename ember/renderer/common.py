"""Stage `renderer`: what every renderer gives and reads the same way: the result class, a
kernel's parameters and its run-time errors (Note: kernel errors, renderer/cpp.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ember.uop.dtypes import DType
from ember.uop.ops import CheckArg, Ops, UOp
from ember.uop.variables import SizeSpelling, spell_size


@dataclass
class RenderedKernel:
    """One kernel's source, from either renderer."""

    name: str
    source: str
    params: list[tuple[str, DType, bool]]  # (name, dtype, written), in parameter order
    errors: list[CheckArg] = field(default_factory=list)  # error code i+1 is errors[i]
    launch: dict = field(default_factory=dict)  # Triton: the launcher's block facts (runtime/triton.py)
    tiled: bool = False  # C++: its loops are 2-D tiles (Note: 2-D tiles, codegen/tiling.py)
    search: Any = None  # C++ with config.kernel_search: a SearchPlan (compile_search.py)
    reduce_loops: int = 0  # reduce loops it opens (C++; Triton: its looped variant; shared_loops.reduce_loop_count)
    in_rows: bool = False  # Triton: a pointwise kernel planned in rows (Note: pointwise kernels in rows)
    variables: tuple[str, ...] = ()  # size variables it takes after its buffers (Note: symbolic sizes)


def kernel_params(uops: Iterable[UOp], written: frozenset[str]) -> list[tuple[str, DType, bool]]:
    """(name, dtype, written) of every BUFFER among `uops` (or their sources), in parameter order
    (p0, p1, ...: codegen/kernel.py names them so)."""
    buffers = {s.arg.name: s for u in uops for s in (u, *u.src) if s.op is Ops.BUFFER}
    ordered = sorted(buffers.values(), key=lambda b: int(b.arg.name[1:]))
    return [(b.arg.name, b.dtype, b.arg.name in written) for b in ordered]


def kernel_variables(uops: Iterable[UOp]) -> tuple[str, ...]:
    """The size variables (DEFINE_VARs) a kernel reads, by name: its parameters after its buffers
    (Note: symbolic sizes, uop/variables.py)."""
    found = {s.arg.name for u in uops for s in (u, *u.src) if s.op is Ops.DEFINE_VAR}
    found |= {v.arg.name for u in uops if u.op is Ops.RANGE for v in u.src[0].toposort if v.op is Ops.DEFINE_VAR}
    return tuple(sorted(found))


C_SIZES = SizeSpelling(
    "C", {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.IDIV: "/", Ops.MOD: "%"},
    lambda op, a, b: f"({a} {'>' if op == 'max' else '<'} {b} ? {a} : {b})", negates=False, error=ValueError,
)  # fmt: skip


def size_expression(u: UOp) -> str:
    """C source of an index expression of constants and size variables: a loop's
    bound (Note: symbolic sizes). Sizes are never negative, so C's division is Python's."""
    return spell_size(u, C_SIZES)


def kernel_errors(uops: Iterable[UOp]) -> list[CheckArg]:
    """The distinct run-time errors the kernel's CHECKs report; error code i+1 is the i-th."""
    return list(dict.fromkeys(u.arg for u in uops if u.op is Ops.CHECK))
