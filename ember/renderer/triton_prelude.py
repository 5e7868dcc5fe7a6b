"""Stage `renderer` (GPU): the jit helpers every Triton kernel module starts with.

NaN-propagating max/min/product reductions, IEEE division and integer powers.
"""

PRELUDE = """\
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def ember_max_combine(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def ember_min_combine(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def ember_mul_combine(a, b):
    return a * b


@triton.jit
def ember_max(x, axis, keep_dims):
    return tl.reduce(x, axis, ember_max_combine, keep_dims=keep_dims)


@triton.jit
def ember_min(x, axis, keep_dims):
    return tl.reduce(x, axis, ember_min_combine, keep_dims=keep_dims)


@triton.jit
def ember_prod(x, axis, keep_dims):
    return tl.reduce(x, axis, ember_mul_combine, keep_dims=keep_dims)


@triton.jit
def ember_div_rn(a, b):
    a, b = tl.broadcast(a, b)
    return tl.div_rn(a, b)


@triton.jit
def ember_ipow(a, b):
    # integer power by squaring, wrapping as eager; negative exponents as the CPU's ember_ipow
    result = a * 0 + 1
    base = a
    e = b
    for _ in tl.static_range(64):
        result = tl.where((e & 1) != 0, result * base, result)
        base = base * base
        e = e >> 1
    negative = tl.where(a == 1, 1, tl.where(a == -1, tl.where((b & 1) != 0, -1, 1), 0))
    return tl.where(b < 0, negative, result)
"""

# Note: symbolic blocks (codegen/blocks.py): a loop over a number of elements given by size
# arguments bounds its `range` by `ember_loop_bound(n)`: n itself on the GPU. Triton's interpreter
# makes every value computed from an argument a 1-element array, which `range` cannot take (numpy
# has no int() of one), so the module run by the interpreter has its own (runtime/triton.py
# `write_module`: runtime/triton_libdevice.py `interpreted_loop_bound`).
LOOP_BOUND_PRELUDE = """

@triton.jit
def ember_loop_bound(n):
    return n
"""
