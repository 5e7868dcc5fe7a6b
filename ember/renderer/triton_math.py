"""Stage `renderer` (GPU): the libm-like math functions of lower/math_functions.py in Triton.

They call libdevice (CUDA's math library); special functions past these are aten extern
kernels on every backend (Note: special functions, lower/math_functions.py). Under the
interpreter, libdevice is runtime/triton_libdevice.py (numpy and torch's CPU functions), so
the interpreter tests check the rendering; libdevice's own accuracy is checked on the GPU.
"""

from __future__ import annotations

from ember.uop.ops import Ops, UOp

LIBDEVICE_CALLS = {
    Ops.ACOSH: "acosh", Ops.ASINH: "asinh", Ops.ATANH: "atanh", Ops.ERFC: "erfc", Ops.LGAMMA: "lgamma",
    Ops.COPYSIGN: "copysign", Ops.NEXTAFTER: "nextafter", Ops.HYPOT: "hypot",
}  # fmt: skip

# Ops the Triton renderer has no spelling for, which the backend declares (compile_triton.py
# TritonBackend) so that lowering sends each call needing one to aten alone (a fallback extern,
# lower/graph.py) rather than the whole graph running eagerly. Empty today: special functions
# past libm's are aten externs on every backend (Note: special functions).
UNRENDERABLE: frozenset[Ops] = frozenset()


def render_math(u: UOp, srcs: list[str]) -> str | None:
    """The call for a special function, or None when `u` is not one."""
    if u.op in LIBDEVICE_CALLS:
        return f"libdevice.{LIBDEVICE_CALLS[u.op]}({', '.join(srcs)})"
    if u.op in (Ops.FMAX, Ops.FMIN):  # C's fmax: a NaN loses to a number
        a, b = srcs
        fn = "tl.maximum" if u.op is Ops.FMAX else "tl.minimum"
        return f"tl.where({a} != {a}, {b}, tl.where({b} != {b}, {a}, {fn}({a}, {b})))"
    return None
