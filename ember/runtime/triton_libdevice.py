"""libdevice for kernels run by Triton's interpreter (TRITON_INTERPRET=1, CPU tensors).

The interpreter runs a kernel as Python over numpy arrays but has no libdevice (CUDA's
libm), which the Triton renderer calls for the functions tl.math lacks. The runtime
imports this namespace instead of `triton.language.extra.libdevice` into modules it loads
for the interpreter; each function applies the numpy equivalent to the block's data.
`interpreted_size` passes a size argument as the GPU's kernel takes it and `interpreted_loop_bound`
makes a bound of them a `range`'s (Note: symbolic blocks, codegen/blocks.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
import triton.language as tl
from triton.runtime.interpreter import TensorHandle


def _tensor(x, like=None):
    if isinstance(x, tl.core.tensor):
        return x
    dtype = like.dtype if like is not None else (tl.float32 if isinstance(x, float) else tl.int32)
    data = np.array([x], dtype=like.handle.data.dtype if like is not None else None)
    return tl.core.tensor(TensorHandle(data, dtype.scalar), dtype)


def _elementwise(fn):
    def apply(*args):
        first = next(a for a in args if isinstance(a, tl.core.tensor))
        tensors = [_tensor(a, first) for a in args]
        with np.errstate(all="ignore"):
            data = fn(*(t.handle.data for t in tensors))
        data = np.asarray(data).astype(first.handle.data.dtype)
        scalar = first.dtype.scalar
        shape = [int(n) for n in data.shape]
        block = tl.block_type(scalar, shape) if any(t.type.is_block() for t in tensors) else scalar
        return tl.core.tensor(TensorHandle(data, scalar), block)

    return apply


def _torch(fn):
    """A function numpy lacks, from torch's CPU kernels (what eager computes on the CPU)."""
    return lambda *arrays: fn(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)).numpy()


interpreted_libdevice = SimpleNamespace(
    expm1=_elementwise(np.expm1), log10=_elementwise(np.log10), log1p=_elementwise(np.log1p),
    tan=_elementwise(np.tan), asin=_elementwise(np.arcsin), acos=_elementwise(np.arccos),
    atan=_elementwise(np.arctan), sinh=_elementwise(np.sinh), cosh=_elementwise(np.cosh),
    tanh=_elementwise(np.tanh), nearbyint=_elementwise(np.rint), trunc=_elementwise(np.trunc),
    fmod=_elementwise(np.fmod), pow=_elementwise(np.power), atan2=_elementwise(np.arctan2),
    log=_elementwise(np.log), sin=_elementwise(np.sin), acosh=_elementwise(np.arccosh),
    asinh=_elementwise(np.arcsinh), atanh=_elementwise(np.arctanh), copysign=_elementwise(np.copysign),
    nextafter=_elementwise(np.nextafter), hypot=_elementwise(np.hypot), erfc=_elementwise(_torch(torch.erfc)),
    lgamma=_elementwise(_torch(torch.lgamma)),
)  # fmt: skip


def interpreted_size(value: int) -> tl.core.tensor:
    """A size argument as the interpreter should see it: an int64 scalar, as the compiled kernel
    declares it (Note: symbolic blocks, codegen/blocks.py). The interpreter makes a plain int an
    int32 (for values that fit) of one element, which is no loop bound: `range` takes its
    `__index__`, and numpy has no int() of a 1-element array."""
    return tl.core.tensor(TensorHandle(np.array(value, dtype=np.int64), tl.int64), tl.int64)


def interpreted_loop_bound(n):
    """A loop bound computed from size arguments as a Python int (renderer/triton_prelude.py
    LOOP_BOUND_PRELUDE): the interpreter's values are arrays of one element."""
    return int(np.asarray(n.handle.data).reshape(-1)[0]) if isinstance(n, tl.core.tensor) else n
