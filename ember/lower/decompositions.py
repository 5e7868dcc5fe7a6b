"""ember's decomposition table: composite aten ops rewritten into ops ember lowers.

It starts from torch's core-aten decompositions (what AOTAutograd would use for an
export-style graph) and removes the ops ember lowers directly, because a direct lowering
produces fewer, simpler UOps than the decomposition.
"""

from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

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


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(EXTRA))
    for packet in LOWERED_DIRECTLY + KEPT_AS_EXTERN:
        for overload in packet.overloads():
            table.pop(getattr(packet, overload), None)
    return table
