"""Stage `lower`: an FX graph of aten ops -> a LoweredGraph of computed buffers and externs.

Each node's value is a lazy `TensorValue` that its consumers inline; a value becomes a
buffer only when something needs memory (Note: when a value is realized):
  - a graph output, or an argument of an extern call;
  - a value an extern kernel (mm, bmm, ...) reads through views: realized before the views,
    the extern gets a strided view of it (BLAS reads a transposed matrix as fast as a plain
    one), where realizing the view itself would copy it with a strided walk, and every other
    consumer reads the one buffer;
  - a value used by several nodes whose body is large, so inlining would repeat work;
  - a body so large that inlining it again would blow up a kernel.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from ember.errors import EmberError
from ember.ir import Buffer, BufferRef, Layout, LoweredGraph, OutputSpec, contiguous_strides
from ember.lower.context import MATMUL_OPS, LoweringContext, matmul_operand_layout
from ember.lower.registry import FULL_PRECISION_ONLY, Unsupported, lookup
from ember.lower.values import TensorValue, as_strided_read, axis, const_index, load
from ember.uop.dtypes import dtypes, from_torch, is_kernel_dtype
from ember.uop.ops import Ops

# Inductor's `realize_opcount_threshold` plays the same role; above it, reuse beats recompute.
REUSE_OPCOUNT = 30
MAX_INLINE_OPCOUNT = 400

# Ops that call aten by design (BLAS, oneDNN, flash attention): not counted as fallbacks.
EXTERN_KERNELS = {
    torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
    torch.ops.aten.convolution, torch.ops.aten.convolution_backward,
    torch.ops.mkldnn._convolution_pointwise, torch.ops.mkldnn._linear_pointwise,  # ember/passes/mkldnn.py
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
    # CUDA attention kernels (flash, memory-efficient, cuDNN) and their backwards
    torch.ops.aten._scaled_dot_product_flash_attention, torch.ops.aten._scaled_dot_product_flash_attention_backward,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward,
    torch.ops.aten._scaled_dot_product_cudnn_attention, torch.ops.aten._scaled_dot_product_cudnn_attention_backward,
}  # fmt: skip

VIEW_OPS = {
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
    torch.ops.aten.permute.default, torch.ops.aten.t.default, torch.ops.aten.transpose.int,
    torch.ops.aten.expand.default, torch.ops.aten.slice.Tensor, torch.ops.aten.select.int,
    torch.ops.aten.squeeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
    torch.ops.aten.unsqueeze.default, torch.ops.aten.as_strided.default, torch.ops.aten.alias.default,
    torch.ops.aten.diagonal.default, torch.ops.aten.unfold.default,
}  # fmt: skip


def lower_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], fallback_random: bool = False,
                unrenderable: frozenset[Ops] = frozenset(), ordered_reductions: bool = True
                ) -> tuple[LoweredGraph, LoweringContext]:  # fmt: skip
    """`unrenderable`, `ordered_reductions`: the capabilities of the backend the kernels go to
    (Note: backends, backend.py)."""
    graph = LoweredGraph(inputs=[], constants={})
    ctx = LoweringContext(graph, fallback_random=fallback_random, unrenderable=unrenderable,
                          ordered_reductions=ordered_reductions)  # fmt: skip
    env: dict[torch.fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = _lower_placeholder(ctx, node, example_inputs[len(ctx.graph.inputs)])
        elif node.op == "get_attr":
            env[node] = _lower_constant(ctx, node, getattr(gm, node.target))
        elif node.op == "call_function":
            env[node] = _lower_call(ctx, node, env)
        elif node.op == "output":
            ctx.graph.outputs = _lower_outputs(ctx, node, env)
        else:
            raise EmberError("lower", f"unexpected FX node kind {node.op!r}", node.name)
    ctx.graph.buffers = ctx.buffers
    return ctx.graph, ctx


def _lower_placeholder(ctx: LoweringContext, node: torch.fx.Node, example: Any) -> Any:
    if not isinstance(example, torch.Tensor):
        if isinstance(example, (torch.SymInt, torch.SymFloat, torch.SymBool)):  # a size under dynamic=True
            raise EmberError("lower", "dynamic shapes are not supported yet; compile with dynamic=False", node.name)
        if isinstance(example, (int, float, bool)):
            raise EmberError("lower", "scalar graph inputs (dynamic scalars) are not supported yet", node.name)
        return example
    if any(not isinstance(s, int) for s in (*example.shape, *example.stride())):
        raise EmberError("lower", "dynamic shapes are not supported yet; compile with dynamic=False", node.name)
    layout = Layout(tuple(example.shape), tuple(example.stride()), 0)
    buffer = ctx.add_buffer(Buffer(node.name, from_torch(example.dtype), layout, "input"))
    ctx.graph.inputs.append(buffer)
    return load(buffer)


def _lower_constant(ctx: LoweringContext, node: torch.fx.Node, value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    layout = Layout(tuple(value.shape), tuple(value.stride()), 0)
    buffer = ctx.add_buffer(Buffer(node.name, from_torch(value.dtype), layout, "constant"))
    ctx.graph.constants[node.name] = value
    return load(buffer)


def _lower_call(ctx: LoweringContext, node: torch.fx.Node, env: dict) -> Any:
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    if node.target is operator.getitem:
        return args[0][args[1]]
    lowering = lookup(node.target)
    value = None
    if lowering in FULL_PRECISION_ONLY and _touches_low_precision(node, args, kwargs):
        lowering = None
    if lowering is not None and _kernel_dtypes_only(node, args, kwargs):
        try:
            value = lowering(ctx, node, *args, **kwargs)
            if ctx.unrenderable and _needs_unrenderable(ctx, value):
                value = None
        except Unsupported:
            value = None
        except Exception as e:
            raise EmberError("lower", f"{type(e).__name__}: {e}", f"{node.target} ({node.name})") from e
    if value is None:
        fallback = getattr(node.target, "overloadpacket", node.target) not in EXTERN_KERNELS
        value = ctx.extern(node.target, args, kwargs, node.meta.get("val"), node.name, fallback=fallback)
    if isinstance(value, TensorValue):
        value = _maybe_realize(ctx, node, value)
    elif isinstance(value, tuple):
        value = tuple(_maybe_realize(ctx, node, v) if isinstance(v, TensorValue) else v for v in value)
    return value


def _needs_unrenderable(ctx: LoweringContext, value: Any) -> bool:
    """Whether a lowered value computes an op the backend cannot render: then the call goes to aten
    (the one place that rule lives; the backend declares the ops, Note: backends)."""
    values, _ = tree_flatten(value)
    bodies = [v.body for v in values if isinstance(v, TensorValue)]
    return any(u.op in ctx.unrenderable for body in bodies for u in body.toposort)


def _dtypes(node: torch.fx.Node, args: tuple, kwargs: dict):
    """Every value of a call (arguments and result), and its ember dtype where it has one."""
    values, _ = tree_flatten((args, kwargs, node.meta.get("val")))
    for v in values:
        dtype = v.dtype if isinstance(v, (TensorValue, torch.Tensor)) else None
        yield v, from_torch(dtype) if isinstance(dtype, torch.dtype) else dtype


def _touches_low_precision(node: torch.fx.Node, args: tuple, kwargs: dict) -> bool:
    return any(dtype in (dtypes.float16, dtypes.bfloat16) for _, dtype in _dtypes(node, args, kwargs))


def _kernel_dtypes_only(node: torch.fx.Node, args: tuple, kwargs: dict) -> bool:
    """Kernels handle only ember's dtypes; anything touching another type goes to aten."""
    for v, dtype in _dtypes(node, args, kwargs):
        if dtype is not None and not is_kernel_dtype(dtype):
            return False
        if isinstance(v, (complex, torch.SymInt, torch.SymFloat)):
            return False
    return True


def _maybe_realize(ctx: LoweringContext, node: torch.fx.Node, value: TensorValue) -> TensorValue:
    """Note: when a value is realized (see the module docstring)."""
    nodes = value.body.toposort
    if any(u.op is Ops.REDUCE for u in nodes):
        # inlined into a consumer with more loops, a reduction would be recomputed per element
        return ctx.realized(value, node.name)
    if _feeds_extern_kernel(node) and as_strided_read(value) is None:
        # in eager's layout: views of it (saved for backward, returned) then have eager's strides;
        # an operand only matmuls read may be column-major (Note: transposed matmul operands)
        layout = matmul_operand_layout(value) if _only_matmuls_read(node) else None
        ref = ctx.realize(value, node.name, layout or _output_layout(node.meta.get("val"), value))
        return load(ctx.buffers[ref.name], ref.layout)
    opcount = sum(1 for u in nodes if u.dtype.kind != "index")
    if opcount > MAX_INLINE_OPCOUNT or (len(node.users) > 1 and opcount > REUSE_OPCOUNT):
        return ctx.realized(value, node.name)
    return value


def _feeds_extern_kernel(node: torch.fx.Node) -> bool:
    """Whether an extern kernel reads `node` directly or through a chain of views."""
    for user in node.users:
        if user.op != "call_function":
            continue
        if getattr(user.target, "overloadpacket", None) in EXTERN_KERNELS:
            return True
        if user.target in VIEW_OPS and _feeds_extern_kernel(user):
            return True
    return False


def _only_matmuls_read(node: torch.fx.Node) -> bool:
    return all(user.op == "call_function" and getattr(user.target, "overloadpacket", None) in MATMUL_OPS
               for user in node.users)  # fmt: skip


def _lower_outputs(ctx: LoweringContext, node: torch.fx.Node, env: dict) -> list[OutputSpec]:
    results, _ = tree_flatten(node.args[0])
    outputs, realized = [], {}
    for result in results:
        value = env[result] if isinstance(result, torch.fx.Node) else result
        if not isinstance(value, TensorValue):
            outputs.append(OutputSpec(None, value))
            continue
        if result not in realized:
            realized[result] = _output_buffer(ctx, result, value, taken={r.name for r in realized.values()})
        outputs.append(OutputSpec(realized[result]))
    return outputs


def _output_buffer(ctx: LoweringContext, node: torch.fx.Node, value: TensorValue, taken: set[str]) -> BufferRef:
    """A view of an input where eager returns one; an intermediate buffer (or a view of it)
    when no other output shares it and it has eager's strides; otherwise a fresh buffer in
    eager's layout (Note: outputs in eager's layout)."""
    if _aliases_graph_input(node):
        return ctx.realize(value, node.name)
    eager = _eager_output_layout(node.meta.get("val"), value.shape)
    read = as_strided_read(value)
    if read is not None and (eager is None or _same_strides(read[1], eager)):  # a view nobody else sees: no copy
        buffer = ctx.buffers[read[0]]
        if buffer.kind in ("computed", "extern") and buffer.name not in taken:
            return BufferRef(buffer.name, read[1], buffer.dtype)
    if eager is not None and 0 in eager.stride:
        return _realize_broadcast(ctx, node.name, value, eager)
    return ctx.realize(value, node.name, eager or Layout.contiguous(value.shape), fresh=True)


# Note: outputs in eager's layout
# AOTAutograd traces the backward graph with the forward outputs' fake tensors, so a tensor the
# forward saves for backward must come back with exactly those strides: the backward's kernels
# were generated for them (wrapper/runtime.py `assert_layout`). An output that is a view of an
# intermediate buffer (cat with an empty operand is its other operand, a permuted matmul result)
# is returned as that view only when its strides are eager's; otherwise it is copied into eager's
# layout. A broadcast output (eager's `expand`, strides 0) is stored once per distinct element
# and returned as the same broadcast view.


def _eager_output_layout(meta: Any, shape: tuple[int, ...]) -> Layout | None:
    """Eager's layout for an output when ember can give it: dense, up to broadcast (stride-0) dims."""
    if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != shape or 0 in shape:
        return None
    stride = tuple(meta.stride())
    stored = [i for i, size in enumerate(shape) if size != 1 and stride[i] != 0]
    expected = 1
    for i in sorted(stored, key=lambda i: stride[i]):
        if stride[i] != expected:
            return None
        expected *= shape[i]
    return Layout(shape, stride)


def _same_strides(a: Layout, b: Layout) -> bool:
    return all(x == y or size == 1 for x, y, size in zip(a.stride, b.stride, a.size))


def _realize_broadcast(ctx: LoweringContext, origin: str, value: TensorValue, layout: Layout) -> BufferRef:
    """`value`, constant along the dims where `layout` has stride 0, stored once along them."""
    broadcast = [i for i, (size, st) in enumerate(zip(value.shape, layout.stride)) if st == 0 and size != 1]
    compact = value.reindex(
        tuple(1 if i in broadcast else size for i, size in enumerate(value.shape)),
        [const_index(0) if i in broadcast else axis(i) for i in range(value.ndim)],
    )
    ref = ctx.realize(compact, origin, Layout(compact.shape, layout.stride), fresh=True)
    return BufferRef(ref.name, layout, ref.dtype)


def _aliases_graph_input(node: torch.fx.Node) -> bool:
    """Does eager return a view of a graph input here? Then ember returns one too."""
    while node.op == "call_function" and node.target in VIEW_OPS:
        node = node.args[0]
    return node.op == "placeholder"


def _output_layout(meta: Any, value: TensorValue) -> Layout:
    """Eager's strides when they are dense, no dim broadcast (so outputs match eager's layout), else row-major."""
    eager = _eager_output_layout(meta, value.shape)
    if eager is None or any(st == 0 and n != 1 for n, st in zip(eager.size, eager.stride)):
        return Layout(value.shape, contiguous_strides(value.shape))
    return eager
