"""Decompositions of PyTorch's fused transformer fast-path ops into ops ember lowers and fuses.

Note: the transformer fast path
In eval mode without grad, `nn.TransformerEncoderLayer` and `nn.MultiheadAttention` call one
fused native op each (`aten._transformer_encoder_layer_fwd`, `aten._native_multi_head_attention`).
Left whole, ember can only call them; rewritten here into addmm (which the oneDNN linear pass
takes), bmm, softmax, layer_norm, activations and residual adds, they fuse like any other graph.

The rewrite follows the native kernels (aten/src/ATen/native/transformers/transformer.cpp,
attention.cpp, attention.cu) where their results differ from the module's slow path:
  - the mask, of any dtype, is converted to bool: a float mask hides every position where it
    is nonzero (it is not added to the scores), whatever its value;
  - a row whose keys are all masked gives NaN (CPU `_masked_softmax` and CUDA's persistent
    softmax both divide 0 by 0), which then spreads to that query's output row;
  - mask_type says how a 2-d mask broadcasts: 0 is (L, L), 1 is a (B, L) key padding mask;
    masks of other ranks must be (B, H, L, L);
  - the feed-forward activation is `_addmm_activation`: exact (erf) gelu on the CPU, the tanh
    approximation on CUDA (cublasLt's GELU epilogue, or `gelu_(result, "tanh")` without it;
    torch's own `_addmm_activation` decomposition makes the same split).
Anything else (nested tensors, empty inputs, other dtypes and devices, mask shapes the native
kernels reject) returns NotImplemented: the tracer then records the aten op unchanged and ember
calls it, so an unsupported case is never computed differently from eager.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten

SUPPORTED_DTYPES = (torch.float32, torch.float64)
GELU_APPROXIMATION = {"cpu": "none", "cuda": "tanh"}  # what `_addmm_activation` computes there


def transformer_encoder_layer_fwd(
    src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first, eps,
    norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2,
    mask=None, mask_type=None,
):  # fmt: skip
    """One encoder layer as transformer.cpp computes it: pre- or post-norm attention, then the
    feed-forward block, each with its residual add."""
    tensors = (src, qkv_weight, qkv_bias, proj_weight, proj_bias, norm_weight_1, norm_bias_1, norm_weight_2,
               norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2)  # fmt: skip
    if not _supported(src, tensors, embed_dim, num_heads, qkv_weight, qkv_bias, mask, mask_type):
        return NotImplemented
    x = _layer_norm(src, norm_weight_1, norm_bias_1, eps) if norm_first else src
    attention, _ = _self_attention(
        x, x, x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type, need_weights=False
    )
    x = attention + src
    if not norm_first:
        x = _layer_norm(x, norm_weight_1, norm_bias_1, eps)
    residual = x
    if norm_first:
        x = _layer_norm(x, norm_weight_2, norm_bias_2, eps)
    hidden = _linear(x, ffn_weight_1, ffn_bias_1)
    hidden = F.gelu(hidden, approximate=GELU_APPROXIMATION[src.device.type]) if use_gelu else torch.relu(hidden)
    x = _linear(hidden, ffn_weight_2, ffn_bias_2) + residual
    if not norm_first:
        x = _layer_norm(x, norm_weight_2, norm_bias_2, eps)
    return x


def native_multi_head_attention(
    query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask=None,
    need_weights=True, average_attn_weights=True, mask_type=None,
):  # fmt: skip
    """`nn.MultiheadAttention`'s fast path: (output, weights); weights are averaged over the
    heads, per head, or an empty tensor when not needed (what torch's fake kernel answers)."""
    tensors = (query, key, value, qkv_weight, qkv_bias, proj_weight, proj_bias)
    if not _supported(query, tensors, embed_dim, num_head, qkv_weight, qkv_bias, mask, mask_type) or not (
        query.shape == key.shape == value.shape
    ):
        return NotImplemented
    output, weights = _self_attention(
        query, key, value, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type, need_weights
    )
    if not need_weights:
        return output, query.new_empty(0)
    return output, (weights.sum(1) / num_head if average_attn_weights else weights)


def _supported(x, tensors, embed_dim: int, num_heads: int, qkv_weight, qkv_bias, mask, mask_type) -> bool:
    """The cases the decomposition computes exactly as the native kernels do."""
    if any(t.is_nested for t in tensors) or (mask is not None and mask.is_nested):
        return False
    if x.dim() != 3 or x.numel() == 0 or x.shape[2] != embed_dim or embed_dim % num_heads != 0:
        return False
    if tuple(qkv_weight.shape) != (3 * embed_dim, embed_dim) or tuple(qkv_bias.shape) != (3 * embed_dim,):
        return False  # eager's checks: a bias that merely broadcasts is an error there
    if x.dtype not in SUPPORTED_DTYPES or x.device.type not in GELU_APPROXIMATION:
        return False
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors):
        return False
    return mask is None or _mask_shape(x, num_heads, mask, mask_type) is not None


def _mask_shape(x, num_heads: int, mask, mask_type) -> tuple[int, ...] | None:
    """The (B, H, L, L)-broadcastable shape `mask` stands for, or None where eager rejects it."""
    batch, length = x.shape[0], x.shape[1]
    if mask.device != x.device:
        return None
    if mask.dim() != 2:  # the native kernels treat any mask that is not 2-d as a full one
        full = (batch, num_heads, length, length)
        return full if tuple(mask.shape) == full else None
    if mask_type == 0 and tuple(mask.shape) == (length, length):
        return (1, 1, length, length)
    if mask_type == 1 and tuple(mask.shape) == (batch, length):
        return (batch, 1, 1, length)
    return None


def _self_attention(query, key, value, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type,
                    need_weights: bool):  # fmt: skip
    """attention.cpp's math: (output (B, L, D), softmax weights (B, H, L, L) or None). Without a
    mask and weights it is scaled_dot_product_attention, as attention.cu computes it then too
    (with no mask no row is fully masked, so SDPA's results are the native kernel's)."""
    batch, length, dim = query.shape
    heads = (batch, length, num_heads, dim // num_heads)
    q, k, v = (t.reshape(heads).transpose(1, 2) for t in _project_qkv(query, key, value, qkv_weight, qkv_bias))
    if mask is None and not need_weights:
        context, weights = F.scaled_dot_product_attention(q, k, v), None
    else:
        context, weights = _masked_attention(q, k, v, _bool_mask(query, num_heads, mask, mask_type))
    output = _linear(context.transpose(1, 2).reshape(batch, length, dim), proj_weight, proj_bias)
    return output, weights


def _masked_attention(q, k, v, hidden):
    """softmax(q k^T / sqrt(head_dim), masked) v on (B, H, L, head_dim) heads: q is scaled
    before the product, as transform_bias_rescale_qkv does; a fully hidden row is NaN."""
    batch, num_heads, length, head_dim = q.shape
    q = (q * (1.0 / math.sqrt(head_dim))).reshape(-1, length, head_dim)
    scores = torch.bmm(q, k.transpose(2, 3).reshape(-1, head_dim, length)).view(batch, num_heads, length, length)
    if hidden is not None:
        scores = scores.masked_fill(hidden, -math.inf)
    weights = torch.softmax(scores, dim=-1)
    context = torch.bmm(weights.view(-1, length, length), v.reshape(-1, length, head_dim))
    return context.view(batch, num_heads, length, head_dim), weights


def _bool_mask(x, num_heads: int, mask, mask_type):
    """`mask` as the bool (B, H, L, L)-broadcastable tensor the native kernels read: any
    nonzero value hides its position."""
    if mask is None:
        return None
    hidden = mask if mask.dtype == torch.bool else mask != 0
    return hidden.reshape(_mask_shape(x, num_heads, mask, mask_type))


def _project_qkv(query, key, value, qkv_weight, qkv_bias):
    """The packed in-projection: one matmul for self-attention, one per input otherwise."""
    if query is key and key is value:
        return _linear(query, qkv_weight, qkv_bias).chunk(3, dim=-1)
    weights, biases = qkv_weight.chunk(3, dim=0), qkv_bias.chunk(3, dim=0)
    return tuple(_linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))


def _linear(x, weight, bias):
    """x @ weight.t() + bias as a 2-d addmm, the form ember's oneDNN linear pass recognizes."""
    rows = x.reshape(-1, x.shape[-1])
    return torch.addmm(bias, rows, weight.t()).view(*x.shape[:-1], weight.shape[0])


def _layer_norm(x, weight, bias, eps: float):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


DECOMPOSITIONS = {
    aten._transformer_encoder_layer_fwd.default: transformer_encoder_layer_fwd,
    aten._native_multi_head_attention.default: native_multi_head_attention,
}
