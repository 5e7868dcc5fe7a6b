"""Decompositions of the `_foreach_*` ops (optimizers' foreach paths) into one aten op per tensor.

A foreach op applies one elementwise op to each tensor of a list (`_foreach_add.List(params,
grads)` is `[add(p, g) for p, g in zip(params, grads)]`). AOTAutograd functionalizes the
in-place forms (`_foreach_mul_` -> `_foreach_mul` and a `copy_` per tensor) and then applies
this table, so every tensor's update reaches lowering as ordinary elementwise ops, which the
scheduler fuses per parameter: parameter, gradient and states read once and written in place
(Note: inputs written in place, lower/mutation.py), instead of one pass over memory per op.

Each entry is written from the op's definition: overload `List` pairs the i-th tensors of two
lists, `ScalarList` the i-th tensor with the i-th number, `Scalar` and `Tensor` use one value
for every tensor; addcmul/addcdiv's `Tensor` overload holds one value per tensor in a 1-d tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

UNARY = [
    "abs", "ceil", "cos", "erf", "exp", "expm1", "floor", "frac", "log", "log1p", "neg", "reciprocal", "round",
    "rsqrt", "sigmoid", "sign", "sin", "sqrt", "tanh", "trunc",
]  # fmt: skip
# foreach name -> the per-tensor function, for overloads List, Scalar, ScalarList, Tensor
BINARY: dict[str, Callable[..., torch.Tensor]] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    "clamp_min": torch.clamp_min, "clamp_max": torch.clamp_max,
}  # fmt: skip
# maximum/minimum of two tensors only (with a number, eager's NaN rule is its own kernel's)
TENSOR_BINARY: dict[str, Callable[..., torch.Tensor]] = {"maximum": torch.maximum, "minimum": torch.minimum}


def _zip_lists(lists: int, fn: Callable[..., torch.Tensor]) -> Callable[..., list[torch.Tensor]]:
    """`fn` on the i-th items of the first `lists` arguments, the rest of the arguments as given."""

    def decomposition(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        per_tensor, shared = args[:lists], args[lists:]
        return [fn(*items, *shared, **kwargs) for items in zip(*per_tensor)]

    return decomposition


def _multiply_divide_add(combine: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """addcmul/addcdiv of one tensor, `value` a number or a 0-d tensor (torch's takes a number)."""

    def per_tensor(x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: Any = 1) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return x + value * combine(t1, t2)
        return torch.addcmul(x, t1, t2, value=value) if combine is torch.mul else torch.addcdiv(x, t1, t2, value=value)

    return per_tensor


def _values_per_tensor(fn: Callable[..., torch.Tensor]) -> Callable[..., list[torch.Tensor]]:
    """The `Tensor` overload of addcmul/addcdiv: `scalars` holds the i-th tensor's value at i."""

    def decomposition(x, t1, t2, scalars: torch.Tensor) -> list[torch.Tensor]:
        return [fn(*items, scalars[i]) for i, items in enumerate(zip(x, t1, t2))]

    return decomposition


def _pow_scalar_and_tensor(base: Any, exponents: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.pow(base, e) for e in exponents]


def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor], non_blocking: bool = False) -> list[torch.Tensor]:
    return [aten.copy.default(t, s, non_blocking) for t, s in zip(targets, sources)]


def _norm(xs: list[torch.Tensor], ord: Any = 2, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(x, ord, dtype=dtype) for x in xs]


def foreach_decompositions() -> dict[Any, Callable]:
    """OpOverload -> decomposition, for every foreach overload this torch has."""
    table: dict[str, Callable] = {}
    for name in UNARY:
        table[f"{name}.default"] = _zip_lists(1, getattr(torch, name))
    for name, fn in BINARY.items():
        table |= {f"{name}.List": _zip_lists(2, fn), f"{name}.ScalarList": _zip_lists(2, fn),
                  f"{name}.Scalar": _zip_lists(1, fn), f"{name}.Tensor": _zip_lists(1, fn)}  # fmt: skip
    for name, fn in TENSOR_BINARY.items():
        table[f"{name}.List"] = _zip_lists(2, fn)
    for name, combine in (("addcmul", torch.mul), ("addcdiv", torch.div)):
        per_tensor = _multiply_divide_add(combine)
        table |= {f"{name}.Scalar": _zip_lists(3, per_tensor), f"{name}.ScalarList": _zip_lists(4, per_tensor),
                  f"{name}.Tensor": _values_per_tensor(per_tensor)}  # fmt: skip
    table |= {"lerp.List": _zip_lists(3, torch.lerp), "lerp.ScalarList": _zip_lists(3, torch.lerp),
              "lerp.Scalar": _zip_lists(2, torch.lerp)}  # fmt: skip
    table |= {"pow.ScalarAndTensor": _pow_scalar_and_tensor, "copy.default": _copy, "norm.Scalar": _norm}
    found = {}
    for qualified, decomposition in table.items():
        name, overload = qualified.split(".")
        packet = getattr(aten, f"_foreach_{name}", None)
        op = getattr(packet, overload, None) if packet is not None else None
        if op is not None:
            found[op] = decomposition
    return found
