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

aten = torch.ops.aten

LOWERED_DIRECTLY = [aten.gelu, aten.hardtanh]

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
    # the fused transformer fast-path ops, as ops ember fuses (Note: the transformer fast path)
    table.update(transformer_fastpath.DECOMPOSITIONS)
    return table


def multilabel_margin_loss_forward(input, target, reduction: int):
    """torch's decomposition (2.13) sums the margin over every target slot, also those after
    the first -1, which eager ignores; this one masks them. Same shapes and dtypes."""
    orig_shape = input.shape
    input, target = torch.atleast_2d(input), torch.atleast_2d(target)
    dim = input.shape[1]
    idx = torch.arange(dim, device=target.device)
    end = torch.amin(torch.where(target == -1, idx, dim), dim=-1, keepdim=True)
    valid = idx < end  # [batch, slot]: the slot holds a target
    u = torch.gather(input, -1, torch.where(valid, target, 0))
    is_target = torch.any(idx == torch.where(valid, target, -1).unsqueeze(-1), dim=1)
    z = (1.0 - u.T.unsqueeze(-1) + input).clamp_min(0) / dim  # [slot, batch, class]
    z = torch.where(is_target | ~valid.T.unsqueeze(-1), 0, z)
    z = z.sum(dim=(0, -1))
    if reduction == 1:  # mean
        z = z.mean()
    elif reduction == 2:  # sum
        z = z.sum()
    elif len(orig_shape) < 2:
        z = z.reshape(())
    return z, is_target.to(input.dtype).reshape(orig_shape)


CORRECTED = {aten.multilabel_margin_loss_forward.default: multilabel_margin_loss_forward}


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
