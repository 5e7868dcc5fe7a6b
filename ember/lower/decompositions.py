"""ember's decomposition table: composite aten ops rewritten into ops ember lowers.

It starts from torch's core-aten decompositions (what AOTAutograd would use for an
export-style graph) and removes the ops ember lowers directly, because a direct lowering
produces fewer, simpler UOps than the decomposition.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch._C import DispatchKey
from torch._decomp import core_aten_decompositions, get_decompositions

from ember.lower import transformer_fastpath
from ember.lower.foreach import foreach_decompositions

aten = torch.ops.aten

LOWERED_DIRECTLY = [aten.gelu, aten.hardtanh, aten.lerp, aten.addcmul, aten.addcdiv]

# Extern kernels by design. The flash-attention forward must also stay whole: its
# decomposition returns a logsumexp its (extern) backward does not accept, which gives
# wrong gradients.
KEPT_AS_EXTERN = [
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
]  # fmt: skip

# Core aten ops that are composites of reductions and pointwise ops ember lowers.
EXTRA = [
    aten._softmax, aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data,
    aten.native_layer_norm, aten.native_layer_norm_backward, aten.native_group_norm,
    aten.native_group_norm_backward, aten.native_batch_norm, aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_no_training, aten._native_batch_norm_legit_functional,
    aten.native_batch_norm_backward, aten.nll_loss_forward, aten.nll_loss_backward,
    aten.gelu_backward, aten.sigmoid_backward, aten.tanh_backward, aten.threshold_backward,
    aten.log_sigmoid_forward, aten.mse_loss, aten.mse_loss_backward, aten.rms_norm,
]  # fmt: skip

# More composites: activations, ldexp, pooling that decomposes into windowed reductions or
# gathers, and the *_copy variants of views (a view, then a clone).
EXTRA_POINTWISE = [aten.elu, aten.leaky_relu, aten.ldexp, aten.dist]
EXTRA_OTHER = [aten.addmv, aten.grid_sampler_2d, aten._batch_norm_with_update_functional]
EXTRA_POOLING = [
    aten.max_pool2d_with_indices_backward, aten._adaptive_avg_pool2d, aten.im2col, aten.col2im,
]  # fmt: skip
EXTRA_VIEW_COPIES = [
    aten.permute_copy, aten.as_strided_copy, aten.view_copy, aten.narrow_copy, aten.unbind_copy,
    aten.new_empty_strided,
]  # fmt: skip


# Random ops whose decomposition draws differently from eager's kernel (bernoulli -> rand < p):
# with config.fallback_random they stay whole, so the aten call draws exactly as eager does.
RANDOM_DECOMPOSED = [aten.bernoulli]


@functools.lru_cache(maxsize=2)
def decomposition_table(fallback_random: bool = False) -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(EXTRA + EXTRA_POINTWISE + EXTRA_POOLING + EXTRA_VIEW_COPIES + EXTRA_OTHER))
    for packet in LOWERED_DIRECTLY + KEPT_AS_EXTERN + (RANDOM_DECOMPOSED if fallback_random else []):
        for overload in packet.overloads():
            table.pop(getattr(packet, overload), None)
    table.update(CORRECTED)
    table.update(foreach_decompositions())  # one aten op per tensor, fused per parameter (lower/foreach.py)
    # the fused transformer fast-path ops, as ops ember fuses (Note: the transformer fast path)
    table.update(transformer_fastpath.DECOMPOSITIONS)
    return table


def multilabel_margin_loss_forward(input, target, reduction: int):
    """The loss from its definition: a sample's targets are its target entries before the first
    -1, and each (target t, non-target class c) pair adds max(0, 1 - (x[t] - x[c])); the sum
    over pairs is divided by the number of classes. Also the 0/1 mask of each sample's target
    classes, eager's second output (its backward reads it). torch's own decomposition counts
    the entries after the first -1 too, which eager ignores."""
    scores, labels = torch.atleast_2d(input), torch.atleast_2d(target)
    classes = scores.shape[-1]
    listed = torch.cumsum(labels == -1, dim=-1) == 0  # [sample, entry]: before the first -1
    class_ids = torch.arange(classes, device=scores.device)
    is_target = (torch.where(listed, labels, -1).unsqueeze(-1) == class_ids).any(dim=1)  # [sample, class]
    target_scores = torch.gather(scores, -1, torch.where(listed, labels, 0))  # [sample, entry]
    hinges = (1 - target_scores.unsqueeze(-1) + scores.unsqueeze(1)).clamp_min(0)  # [sample, entry, class]
    counted = listed.unsqueeze(-1) & ~is_target.unsqueeze(1)
    loss = torch.where(counted, hinges, 0).sum(dim=(1, 2)) / classes
    if reduction == 1:  # mean
        loss = loss.mean()
    elif reduction == 2:  # sum
        loss = loss.sum()
    elif input.dim() < 2:
        loss = loss.reshape(())
    return loss, is_target.to(input.dtype).reshape(input.shape)


def native_group_norm(input, weight, bias, batch: int, channels: int, inner: int, groups: int, eps: float):
    """Group norm as (x - mean) * rstd * weight + bias, and each group's mean and rstd (eager's
    other outputs, read by its backward). torch's decomposition, like eager's CPU kernel, folds
    the mean into a bias, x * (rstd * weight) + (bias - mean * rstd * weight): where |mean| is
    large against the spread, both terms are large and their sum loses the result's low bits (a
    group of equal values -8.07, weight -8.48, bias -2.40: 1e-3 off). Subtracting the mean first
    keeps the error relative to the normalized value."""
    compute = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    grouped = input.to(compute).reshape(batch, groups, (channels // groups) * inner)
    variance, mean = torch.var_mean(grouped, dim=-1, correction=0, keepdim=True)
    rstd = torch.rsqrt(variance + eps)
    out = ((grouped - mean) * rstd).reshape(input.shape)
    per_channel = [1, channels] + [1] * (input.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(per_channel)
    if bias is not None:
        out = out + bias.reshape(per_channel)
    return out.to(input.dtype), mean.squeeze(-1).to(input.dtype), rstd.squeeze(-1).to(input.dtype)


def view_copy(x, size):
    """A contiguous copy of `x` in shape `size`, as eager gives it also for strides no view can
    express (a transposed or expanded input): torch's decomposition is a view, which raises there."""
    return torch.reshape(x, size).clone(memory_format=torch.contiguous_format)


def index_fill(x, dim: int, index, value):
    """`value` written at positions `index` along `dim`: an index_put with full slices before
    `dim`. torch 2.11's decomposition clones a non-contiguous `x` through empty_permuted and
    copy_, which AOTAutograd's functional-graph check rejects (an AssertionError on a transposed
    or sliced input); index_put is functional on every torch."""
    flat = x.reshape(1) if x.dim() == 0 else x
    if isinstance(value, torch.Tensor):
        fill = value.to(x.dtype)
    else:
        fill = torch.scalar_tensor(value, dtype=x.dtype, device=x.device)
    positions = [None] * (dim % flat.dim()) + [index.reshape(-1)]
    return aten.index_put.default(flat, positions, fill).reshape(x.shape)


CORRECTED = {
    aten.index_fill.int_Scalar: index_fill,
    aten.index_fill.int_Tensor: index_fill,
    aten.multilabel_margin_loss_forward.default: multilabel_margin_loss_forward,
    aten.native_group_norm.default: native_group_norm,
    aten.view_copy.default: view_copy,
}


@contextlib.contextmanager
def corrected_autograd_kernels() -> Iterator[None]:
    """Note: decompositions torch runs before ember's table
    torch registers a few decompositions as Python kernels at the Autograd key; while
    AOTAutograd traces they run before the decomposition table is consulted, so an entry
    in CORRECTED alone would never be used. This swaps ours in for the trace, then back."""
    swapped = {op: op.py_kernels[DispatchKey.Autograd] for op in CORRECTED if DispatchKey.Autograd in op.py_kernels}
    try:
        for op in swapped:
            op.py_kernels[DispatchKey.Autograd] = CORRECTED[op]
            op._dispatch_cache.clear()
        yield
    finally:
        for op, kernel in swapped.items():
            op.py_kernels[DispatchKey.Autograd] = kernel
            op._dispatch_cache.clear()
