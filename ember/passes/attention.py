"""Attention written out by hand -> one flash-attention call (CPU, inference graphs).

`softmax(q @ k.transpose(-2, -1) * scale) @ v` on 4-d [batch, heads, seq, dim] tensors
reaches the aten graph as two batched matmuls around a softmax, each matmul with its
operands copied into [batch*heads, rows, cols] (expand, clone, view) and its result viewed
back to 4-d. Ember would run that as: a copy of q, a transposing copy of k, a bmm, a softmax
kernel over the whole [seq, seq] score matrix, a copy of v, and another bmm. torch's
`_scaled_dot_product_flash_attention_for_cpu` computes the same attention blockwise, reading
q, k and v through their strides and never writing the scores: on the suite's attention
(4 x 4 heads x 128 x 64) it is 1.2x faster than the pieces (TorchInductor makes the same
replacement, its `fuse_attention` patterns).

Matched, from the view that brings the second matmul's result back to 4-d:

    view(bmm(view(expand(W)), view(clone?(expand?(V)))), [B, H, L, E])
    W = softmax(X, -1)  as `_softmax`, or as its decomposition amax/sub/exp/sum/div
    X = S / c | S * c | S
    S = view(bmm(view(clone?(expand?(Q))), view(clone?(expand?(K^T)))), [B, H, L, S])

and replaced by `_scaled_dot_product_flash_attention_for_cpu(Q, K, V, scale=1/c | c | 1)[0]`.
Every intermediate (the scores, the weights) must have no reader outside the pattern, which
leaves training graphs alone (their forward saves the weights for the backward). Only CPU
float32/float64 tensors, one head dim (at most MAX_HEAD_DIM) for q, k and v, no broadcast (GQA's
repeated k/v is already a copy in the graph when it gets here) and no mask.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ember.passes import meta
from ember.passes.matcher import FxPat, FxPatternMatcher

aten = torch.ops.aten

FLOATS = (torch.float32, torch.float64)
MAX_HEAD_DIM = 256  # flash attention's blocks hold a row of q per head dim; beyond, the pieces are as good
LAST_DIM = (-1, 3)  # the softmax's dim, as a 4-d graph may spell it
BACK_TO_4D = (aten.view.default, aten._unsafe_view.default)


def _value(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _sole_reader(node: Any, reader: torch.fx.Node) -> bool:
    """`node` is a graph value whose only reader is `reader` (so replacing `reader` leaves it dead)."""
    return isinstance(node, torch.fx.Node) and set(node.users) == {reader}


def _is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def batched_operand(operand: Any, bmm: torch.fx.Node) -> torch.fx.Node | None:
    """The 4-d [B, H, rows, cols] tensor that `operand`, a [B*H, rows, cols] operand of `bmm`,
    is a copy or view of (view of clone of expand, each of clone and expand optional), or None."""
    if not _is_call(operand, aten.view.default, aten._unsafe_view.default) or not _sole_reader(operand, bmm):
        return None
    source, reader = operand.args[0], operand
    if _is_call(source, aten.clone.default) and _sole_reader(source, reader):
        source, reader = source.args[0], source
    if _is_call(source, aten.expand.default) and _sole_reader(source, reader):
        inner = _value(source.args[0])
        if inner is None or tuple(inner.shape) != tuple(source.args[1]):
            return None  # a real broadcast
        source = source.args[0]
    value, flat = _value(source), _value(operand)
    if value is None or flat is None or value.dim() != 4 or flat.dim() != 3:
        return None
    if value.shape[0] * value.shape[1] != flat.shape[0] or tuple(value.shape[2:]) != tuple(flat.shape[1:]):
        return None
    return source


def softmax_input(weights: Any, reader: torch.fx.Node) -> torch.fx.Node | None:
    """X where `weights` is softmax(X) over the last dim, read only by `reader`, or None."""
    if not _sole_reader(weights, reader):
        return None
    if _is_call(weights, aten._softmax.default):
        x, dim, half_to_float = weights.args
        return x if dim in LAST_DIM and not half_to_float and set(x.users) == {weights} else None
    if not _is_call(weights, aten.div.Tensor):
        return None
    exp, total = weights.args
    if not (_is_call(exp, aten.exp.default) and _is_call(total, aten.sum.dim_IntList)):
        return None
    if total.args[0] is not exp or not _reduces_last_dim(total) or set(exp.users) != {weights, total}:
        return None
    shifted = exp.args[0]
    if not (_is_call(shifted, aten.sub.Tensor) and _sole_reader(shifted, exp)):
        return None
    x, row_max = shifted.args
    if not (_is_call(row_max, aten.amax.default) and row_max.args[0] is x and _reduces_last_dim(row_max)):
        return None
    return x if set(row_max.users) == {shifted} and set(x.users) == {row_max, shifted} else None


def _reduces_last_dim(node: torch.fx.Node) -> bool:
    dims, keepdim = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return list(dims) in ([-1], [3]) and keepdim is True


def scores_and_scale(x: torch.fx.Node) -> tuple[torch.fx.Node, float] | None:
    """(S, scale) where `x` is S / c, S * c or S itself, c a number."""
    if _is_call(x, aten.div.Tensor, aten.mul.Tensor) and isinstance(x.args[1], (int, float)):
        if isinstance(x.args[1], bool) or x.args[1] == 0:
            return None
        scores = x.args[0]
        if not isinstance(scores, torch.fx.Node) or set(scores.users) != {x}:
            return None
        return scores, (1.0 / x.args[1] if x.target is aten.div.Tensor else float(x.args[1]))
    return x, 1.0


def query_and_key(scores: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(Q, K^T) as 4-d tensors where `scores` is view(bmm(Q, K^T), [B, H, L, S])."""
    if not _is_call(scores, *BACK_TO_4D):
        return None
    bmm = scores.args[0]
    if not (_is_call(bmm, aten.bmm.default) and _sole_reader(bmm, scores)):
        return None
    query, key_t = batched_operand(bmm.args[0], bmm), batched_operand(bmm.args[1], bmm)
    return None if query is None or key_t is None else (query, key_t)


def untransposed(graph: torch.fx.Graph, key_t: torch.fx.Node) -> torch.fx.Node:
    """K from K^T: the permute's input where K^T is one, else a new permute (a view)."""
    if _is_call(key_t, aten.permute.default) and list(key_t.args[1]) == [0, 1, 3, 2]:
        return key_t.args[0]
    return meta.call(graph, aten.permute.default, (key_t, [0, 1, 3, 2]))


def fits_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    tensors = (query, key, value)
    if any(t.device.type != "cpu" or t.dtype not in FLOATS or t.dtype != query.dtype for t in tensors):
        return False
    batch_heads = tuple(query.shape[:2])
    if tuple(key.shape[:2]) != batch_heads or tuple(value.shape[:2]) != batch_heads:
        return False
    head_dim = query.shape[3]  # the CPU kernel wants one head size for q, k and v
    same_head_dim = key.shape[3] == head_dim and value.shape[3] == head_dim
    fits = same_head_dim and key.shape[2] == value.shape[2] and 0 < head_dim <= MAX_HEAD_DIM
    return fits and all(unit_last_stride(t) for t in tensors)


def unit_last_stride(t: torch.Tensor) -> bool:
    """Whether `t`'s last dim is contiguous. The CPU flash kernel reads a row of the head dim as
    contiguous whatever its stride says (eager's dispatch checks this and runs the math kernel
    instead): DaViT's channel attention, softmax(k^T v) @ q^T, gave it transposed operands with
    stride 96 there, and ember returned wrong values that changed from call to call."""
    return statically_known_true(t.stride(-1) == 1) or statically_known_true(t.shape[-1] == 1)


def flash_attention(graph: torch.fx.Graph, node: torch.fx.Node, bmm: torch.fx.Node) -> torch.fx.Node | None:
    """The rule: `node` views `bmm` (weights @ V) back to 4-d (see the module docstring)."""
    weights_4d = batched_operand(bmm.args[0], bmm)
    value_4d = batched_operand(bmm.args[1], bmm)
    if weights_4d is None or value_4d is None:
        return None
    x = softmax_input(weights_4d, _reader_of(weights_4d))
    found = scores_and_scale(x) if x is not None else None
    pair = query_and_key(found[0]) if found is not None else None
    if found is None or pair is None:
        return None
    query, key_t = pair
    tensors = [_value(n) for n in (query, key_t, value_4d)]
    if any(t is None for t in tensors) or not fits_flash_attention(tensors[0], tensors[1].mT, tensors[2]):
        return None
    key = untransposed(graph, key_t)
    attention = meta.call(graph, aten._scaled_dot_product_flash_attention_for_cpu.default, (query, key, value_4d),
                          {"scale": found[1]})  # fmt: skip
    return meta.call(graph, operator.getitem, (attention, 0), like=attention.meta["val"][0])


def _reader_of(node: torch.fx.Node) -> torch.fx.Node:
    """The one reader of `node` (batched_operand checked there is one)."""
    return next(iter(node.users))


# Note: grouped-query attention reads its shared heads
# LLaMA-style attention (GQA) gives each of Hkv key/value heads to R query heads: repeat_kv
# copies k and v R times into [B, Hkv*R, L, E] (unsqueeze, expand, clone, view), query head h
# reading kv head h // R. The CPU flash-attention kernel maps query heads to fewer key/value
# heads itself, in that same order (head h reads kv head h // (H / Hkv)), so it is given k and v
# as they were: no copy, and each kv head is read from memory once per R query heads (LLaMA's
# 2 kv heads for 8 query heads: the copies wrote 4x the keys and values each layer).


def unrepeated_heads(kv: Any, reader: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """(x, R) where `kv`, read only by `reader`, is x's heads each repeated R times in a row
    (view(clone(expand(unsqueeze(x, 2), [B, Hkv, R, L, E])), [B, Hkv*R, L, E]); no clone where
    the view can broadcast, Hkv = 1), or None."""
    if not (_is_call(kv, *BACK_TO_4D, aten.reshape.default) and _sole_reader(kv, reader)):
        return None
    expanded, copy = kv.args[0], kv
    if _is_call(expanded, aten.clone.default) and _sole_reader(expanded, kv):
        expanded, copy = expanded.args[0], expanded
    if not (_is_call(expanded, aten.expand.default) and _sole_reader(expanded, copy)):
        return None
    unsqueezed = expanded.args[0]
    if not (_is_call(unsqueezed, aten.unsqueeze.default) and unsqueezed.args[1] == 2):
        return None
    source, repeated, flat = (_value(n) for n in (unsqueezed.args[0], expanded, kv))
    if source is None or repeated is None or flat is None or source.dim() != 4 or repeated.dim() != 5:
        return None
    batch, kv_heads, length, dim = source.shape
    repeats = repeated.shape[2]
    if tuple(repeated.shape) != (batch, kv_heads, repeats, length, dim):
        return None
    if tuple(flat.shape) != (batch, kv_heads * repeats, length, dim):
        return None
    return unsqueezed.args[0], repeats


def grouped_query_attention(graph: torch.fx.Graph, node: torch.fx.Node, query: Any, key: Any, value: Any
                            ) -> torch.fx.Node | None:  # fmt: skip
    """The rule: flash attention over repeated k and v heads reads the shared heads (Note:
    grouped-query attention reads its shared heads)."""
    keys, values = unrepeated_heads(key, node), unrepeated_heads(value, node)
    if keys is None or values is None or keys[1] != values[1] or key is value:
        return None
    queries, repeated = _value(query), _value(key)
    if queries is None or repeated is None or tuple(queries.shape[:2]) != tuple(repeated.shape[:2]):
        return None  # the kernel's head mapping needs one query head per repeated head
    shared = [_value(keys[0]), _value(values[0])]
    if any(t is None or not unit_last_stride(t) for t in shared):
        return None
    args = (query, keys[0], values[0], *node.args[3:])
    return meta.call(graph, aten._scaled_dot_product_flash_attention_for_cpu.default, args, dict(node.kwargs))


pm_grouped_query_attention = FxPatternMatcher([
    # flash(Q, view(clone(expand(unsqueeze(K, 2)))), view(clone(expand(unsqueeze(V, 2))))) -> flash(Q, K, V)
    (FxPat(aten._scaled_dot_product_flash_attention_for_cpu.default, FxPat.var("query"), FxPat.var("key"),
           FxPat.var("value")), grouped_query_attention),
])  # fmt: skip


pm_flash_attention = FxPatternMatcher([
    # view(bmm(softmax(Q @ K^T * scale), V), 4-d) -> _scaled_dot_product_flash_attention_for_cpu(Q, K, V)[0]
    (FxPat(BACK_TO_4D, FxPat(aten.bmm.default, name="bmm", one_user=True), FxPat.var()), flash_attention),
])  # fmt: skip
