"""Stage `lower`: an FX graph of aten ops -> a LoweredGraph of computed buffers and externs.

Each node's value is a lazy `TensorValue` that its consumers inline; a value becomes a
buffer only when something needs memory (Note: when a value is realized):
  - a graph output, or an argument of an extern call;
  - a value an extern kernel (mm, bmm, ...) reads through views: realized before the views,
    the extern gets a strided view of it (BLAS reads a transposed matrix as fast as a plain
    one), where realizing the view itself would copy it with a strided walk, and every other
    consumer reads the one buffer;
  - a value used by several nodes whose body is large, so inlining would repeat work;
  - a value with a transcendental op that consumers read broadcast, each element of it
    computed many times over (Note: values recomputed under a broadcast);
  - a body so large that inlining it again would blow up a kernel.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from ember.errors import EmberError
from ember.ir import Buffer, BufferRef, Layout, LoweredGraph, OpaqueInput, OutputSpec, contiguous_strides, same_sizes
from ember.lower.collectives import communication_of
from ember.lower.context import (
    MATMUL_OPS,
    LoweringContext,
    dense_layout,
    eager_argument_layout,
    gapped_layout,
    matmul_operand_layout,
    same_strides,
    with_eager_unit_strides,
)
from ember.lower.mutation import emit_input_mutations
from ember.lower.registry import EXTERN_BY_DESIGN, FULL_PRECISION_ONLY, Unsupported, lookup
from ember.lower.values import TensorValue, as_strided_read, axis, const_index, load
from ember.passes.mkldnn import linear_by_size
from ember.uop.dtypes import dtypes, from_torch, is_kernel_dtype
from ember.uop.ops import Ops, UOp
from ember.uop.symbolic import simplify
from ember.uop.variables import SymbolicSizeError, known_size_hint, size_hint, symbolic_scalar

# Inductor's `realize_opcount_threshold` plays the same role; above it, reuse beats recompute.
REUSE_OPCOUNT = 30
MAX_INLINE_OPCOUNT = 400

# Ops that call aten by design (BLAS, oneDNN, flash attention): not counted as fallbacks.
EXTERN_KERNELS = {
    torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
    torch.ops.aten.convolution, torch.ops.aten.convolution_backward,
    torch.ops.mkldnn._convolution_pointwise, torch.ops.mkldnn._linear_pointwise, linear_by_size,  # passes/mkldnn.py
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
    saved = frozenset(gm.meta.get(SAVED_OUTPUTS, ()))  # (the frontend's: Note: outputs in eager's layout)
    ctx = LoweringContext(graph, fallback_random=fallback_random, unrenderable=unrenderable,
                          ordered_reductions=ordered_reductions, saved_outputs=saved)  # fmt: skip
    env: dict[torch.fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = _lower_placeholder(ctx, node, example_inputs[len(ctx.graph.arguments)])
            ctx.graph.arguments.append(node.name)
        elif node.op == "get_attr":
            env[node] = _lower_constant(ctx, node, getattr(gm, node.target))
        elif node.op == "call_function":
            env[node] = _lower_call(ctx, node, env)
            _record_holder(ctx.graph, node, env[node])
        elif node.op == "output":
            ctx.graph.outputs = _lower_outputs(ctx, node, env)
            emit_input_mutations(ctx)  # after every read of the inputs' old contents
        else:
            raise EmberError("lower", f"unexpected FX node kind {node.op!r}", node.name)
    ctx.graph.buffers = ctx.buffers
    return ctx.graph, ctx


def _record_holder(graph: LoweredGraph, node: torch.fx.Node, value: Any) -> None:
    """Note: which node a buffer holds. A node whose value is a plain strided read of a buffer
    is, element for element, that buffer seen through a layout; the first such node of each
    buffer names the aten computation the buffer holds (EMBER_VERIFY compares the two)."""
    read = as_strided_read(value) if isinstance(value, TensorValue) else None
    if read is not None and read[0] not in graph.holds:
        graph.holds[read[0]] = (node.name, read[1])


def _lower_placeholder(ctx: LoweringContext, node: torch.fx.Node, example: Any) -> Any:
    if not isinstance(example, torch.Tensor):
        if isinstance(example, torch.SymInt):  # a size under dynamic shapes (Note: symbolic sizes)
            ctx.graph.size_arguments[node.name] = example
            return example
        if isinstance(example, (torch.SymFloat, torch.SymBool)):
            raise EmberError("lower", "symbolic float and bool graph inputs are not supported", node.name)
        if isinstance(example, (int, float, bool)):
            raise EmberError("lower", "scalar graph inputs (dynamic scalars) are not supported yet", node.name)
        return OpaqueInput(node.name)
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
    if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat)):  # of sizes: its expression is the value
        return node.meta["val"]
    if isinstance(node.meta.get("val"), torch.SymBool):  # no kernel or wrapper form for these
        raise EmberError("lower", "a symbolic bool computed from sizes is not supported", node.name)
    if node.target in SIZE_ASSERTS:  # what dynamo's guards already check at every call
        return None
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
        packet = getattr(node.target, "overloadpacket", node.target)
        fallback = packet not in EXTERN_KERNELS and packet not in EXTERN_BY_DESIGN
        fallback = fallback and communication_of(node.target) is None  # a collective newer than our table
        metas = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        value = ctx.extern(node.target, args, kwargs, node.meta.get("val"), node.name, fallback, metas)
    if isinstance(value, TensorValue):
        value = _maybe_realize(ctx, node, value)
    elif isinstance(value, tuple):
        metas = node.meta.get("val")
        metas = metas if isinstance(metas, (tuple, list)) and len(metas) == len(value) else (None,) * len(value)
        value = tuple(_maybe_realize(ctx, node, v, m) if isinstance(v, TensorValue) else v
                      for v, m in zip(value, metas))  # fmt: skip
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
        if isinstance(v, (complex, torch.SymBool)):  # (a SymInt is a size: Note: symbolic sizes)
            return False
        if isinstance(v, torch.SymFloat) and not _float_of_sizes(v):
            return False
    return True


def _float_of_sizes(value: torch.SymFloat) -> bool:
    """Whether a SymFloat is computed from sizes only (interpolate's scale, out / in), which a
    kernel reads as a float64 UOp of the size variables, as Python computes it (symbolic_scalar)."""
    try:
        return symbolic_scalar(value) is not None
    except SymbolicSizeError:
        return False


def _maybe_realize(ctx: LoweringContext, node: torch.fx.Node, value: TensorValue, result_meta: Any = None
                   ) -> TensorValue:  # fmt: skip
    """Note: when a value is realized (see the module docstring). `result_meta`: the fake value of
    this one result of a node returning several (max pooling's values and indices)."""
    nodes = value.body.toposort
    if any(u.op is Ops.REDUCE for u in nodes):
        # inlined into a consumer with more loops, a reduction would be recomputed per element
        layout = _channels_last_layout(node.meta.get("val") if result_meta is None else result_meta, value)
        if layout is not None:  # pooling NHWC activations: channels stay innermost, as eager's result
            return load(ctx.buffers[ctx.realize(value, node.name, layout).name], layout)
        return ctx.realized(value, node.name)
    if (layout := _layout_for_several_externs(node, value)) is not None:
        ref = ctx.realize(value, node.name, layout, fresh=True)  # Note: one copy for several extern calls
        return load(ctx.buffers[ref.name], ref.layout)
    if _feeds_extern_kernel(node) and as_strided_read(value) is None:
        # in eager's layout: views of it (saved for backward, returned) then have eager's strides;
        # an operand only matmuls read may be column-major (Note: transposed matmul operands)
        layout = matmul_operand_layout(value) if _only_matmuls_read(node) else None
        ref = ctx.realize(value, node.name, layout or _output_layout(node.meta.get("val"), value))
        return load(ctx.buffers[ref.name], ref.layout)
    opcount = sum(1 for u in nodes if u.dtype.kind != "index")
    if opcount > MAX_INLINE_OPCOUNT or (len(node.users) > 1 and opcount > REUSE_OPCOUNT):
        return ctx.realized(value, node.name)
    if len(node.users) > 1 and _full_size_reads(ctx, nodes, value) > REUSE_READS:
        return ctx.realized(value, node.name)  # Note: a sum of many buffers is realized
    if _recomputed_under_broadcast(node, nodes):
        return ctx.realized(value, node.name)
    return value


# Note: a sum of many buffers is realized
# A pointwise value is inlined into each of its readers. A residual stream (x + attention + mlp +
# attention + ...) stays cheap in ops, so it was inlined layer after layer: each RMSNorm of the
# LLaMA-style model read every earlier layer's output (up to seven buffers) twice, once for its
# mean and once to normalize, until the op count passed REUSE_OPCOUNT. A value read by several
# readers that reads more than REUSE_READS buffers of its own size is realized (inductor's
# `realize_reads_threshold` plays the same role): one write and one read per reader instead of
# every buffer per reader. Broadcast reads (a bias, a norm's weight) do not count: they are small.
REUSE_READS = 4


def _full_size_reads(ctx: LoweringContext, nodes: list[UOp], value: TensorValue) -> int:
    """How many distinct buffers of at least `value`'s element count its body loads."""
    numel = 1
    for size in value.shape:
        numel *= size_hint(size)
    names = {u.src[0].src[0].arg.name for u in nodes if u.op is Ops.LOAD}
    return sum(1 for name in names if name in ctx.buffers and _elements(ctx.buffers[name]) >= numel)


def _elements(buffer: Buffer) -> int:
    count = 1
    for size in buffer.layout.size:
        count *= size_hint(size)
    return count


# Note: values recomputed under a broadcast
# An inlined value is computed once per iteration of each consumer's loops. Where a consumer
# reads it broadcast, each of its elements is computed again for every element it is broadcast
# to: LLaMA's rotary cos and sin ([B, S, D], computed once per forward in eager) inlined into the
# query's and key's [B, H, S, D] kernels of every layer cost 2 * H * layers transcendentals per
# element instead of 2. Realized, they are computed once and read. Only for bodies with a
# transcendental (a broadcast affine parameter costs less to recompute than to load twice; but
# see HEAVY_BROADCAST), and
# only where consumers would compute it RECOMPUTED_TIMES over in all, one of them through a broadcast,
# and RECOMPUTED_MIN elements again at least (a small value is cheaper to recompute than to launch for).
TRANSCENDENTAL_OPS = {
    Ops.EXP, Ops.EXP2, Ops.EXPM1, Ops.LOG, Ops.LOG2, Ops.LOG10, Ops.LOG1P, Ops.SIN, Ops.COS, Ops.TAN,
    Ops.ASIN, Ops.ACOS, Ops.ATAN, Ops.SINH, Ops.COSH, Ops.TANH, Ops.ERF, Ops.POW,
}  # fmt: skip
RECOMPUTED_TIMES = 4
RECOMPUTED_MIN = 1 << 15  # elements computed again: fewer cost less than a kernel call of their own
# Plain arithmetic is realized too where one reader broadcasts it HEAVY_BROADCAST times or more
# and recomputing it would cost HEAVY_RECOMPUTE operations or more (its ops per element times the
# elements computed again): a decode step's layer-normalized row, read against every row of the
# LM head's weight (Note: a vector times a matrix, passes/vector_matmul.py), took 4.0 ms inlined
# (sub, mul, mul, add per weight element) and 3.6 realized, at 50257 x 768 on 2 threads of an AMD
# EPYC. A BatchNorm's per-channel affine over a batch of feature maps stays inlined: a few
# million operations cost less than a kernel of its own.
HEAVY_BROADCAST = 1024
HEAVY_RECOMPUTE = 1 << 24
NOT_ARITHMETIC = {Ops.BUFFER, Ops.INDEX, Ops.LOAD, Ops.CONST, Ops.RANGE, Ops.DEFINE_VAR}


def _recomputed_under_broadcast(node: torch.fx.Node, body: tuple) -> bool:
    """Whether inlining `node`'s value (`body`: its UOps) would compute each element of it
    RECOMPUTED_TIMES or more, some consumer reading it broadcast (Note: values recomputed under a broadcast)."""
    transcendental = any(u.op in TRANSCENDENTAL_OPS for u in body)
    arithmetic = sum(1 for u in body if u.op not in NOT_ARITHMETIC and u.dtype.kind != "index")
    if not transcendental and not arithmetic:
        return False
    elements = _example_numel(node.meta.get("val"))
    readers = [_example_numel(user.meta.get("val")) for user in _readers_through_views(node)]
    if not elements or not readers or any(r is None for r in readers):
        return False
    total = sum(readers)  # type: ignore[arg-type]
    if total - elements < RECOMPUTED_MIN:
        return False
    if not transcendental:
        heavy = arithmetic * (total - elements) >= HEAVY_RECOMPUTE
        return heavy and max(readers) >= HEAVY_BROADCAST * elements  # type: ignore[operator]
    broadcast = max(readers) >= 2 * elements  # type: ignore[type-var, operator]
    return broadcast and total >= RECOMPUTED_TIMES * elements


def _readers_through_views(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read `node` directly or through chains of views (the graph's output excluded)."""
    readers = []
    for user in node.users:
        if user.op == "call_function" and user.target in VIEW_OPS:
            readers += _readers_through_views(user)
        elif user.op == "call_function":
            readers.append(user)
    return readers


def _example_numel(meta: Any) -> int | None:
    """The element count of a tensor's fake value; for a symbolic one, in the example the graph is
    compiled with (its symbols' hints: the decision changes speed, never a result; Note: symbolic
    sizes). None for what is no tensor or has a size with no hint (unbacked)."""
    if not isinstance(meta, torch.Tensor):
        return None
    numel = 1
    for size in meta.shape:
        hint = known_size_hint(size)
        if hint is None:
            return None
        numel *= hint
    return numel


def _channels_last_layout(meta: Any, value: TensorValue) -> Layout | None:
    """Eager's layout for a 4-d result that eager gives channels-last (a pooling of NHWC
    activations, passes/layout.py), else None. Stored row-major, it would be read across the
    channels and copied back to NHWC for the next convolution."""
    if not isinstance(meta, torch.Tensor) or meta.dim() != 4 or meta.is_contiguous():
        return None
    if not meta.is_contiguous(memory_format=torch.channels_last):
        return None
    return _eager_output_layout(meta, value.shape)


def extern_kernel(target: Any) -> bool:
    """Whether `target` (an aten overload or packet, or ember's own `linear_by_size`) is one of the
    EXTERN_KERNELS."""
    return getattr(target, "overloadpacket", target) in EXTERN_KERNELS


def _feeds_extern_kernel(node: torch.fx.Node) -> bool:
    """Whether an extern kernel reads `node` directly or through a chain of views."""
    for user in node.users:
        if user.op != "call_function":
            continue
        if extern_kernel(user.target):
            return True
        if user.target in VIEW_OPS and _feeds_extern_kernel(user):
            return True
    return False


# Note: one copy for several extern calls
# A value that is a plain read of another buffer is not realized where it is computed: each extern
# call reading it copies it into eager's layout where that differs (Note: extern arguments in
# eager's strides, lower/context.py). Read by several calls, as T5's attention bias (one
# `position_bias.contiguous()` for six attention calls once the per-layer copies are merged,
# passes/cse.py), that is one copy per call, each written and read once. Such a value is
# realized once, in eager's layout, where it is computed: the calls are given that buffer as is.


def _layout_for_several_externs(node: torch.fx.Node, value: TensorValue) -> Layout | None:
    """Eager's layout for a plain read that extern calls (not matmuls, which read any strides)
    take directly more than once and would each copy into it, else None."""
    if as_strided_read(value) is None:
        return None
    uses = 0
    for user in node.users:
        packet = getattr(user.target, "overloadpacket", user.target) if user.op == "call_function" else None
        if packet in EXTERN_KERNELS and packet not in MATMUL_OPS:
            uses += sum(1 for a in tree_flatten((user.args, user.kwargs))[0] if a is node)
    return eager_argument_layout(value, node.meta.get("val")) if uses > 1 else None


def _only_matmuls_read(node: torch.fx.Node) -> bool:
    return all(user.op == "call_function" and getattr(user.target, "overloadpacket", None) in MATMUL_OPS
               for user in node.users)  # fmt: skip


# asserts on sizes that AOTAutograd leaves in a graph with symbolic sizes
SIZE_ASSERTS = {torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default}

# Ops returning several views of their input, each picked by an `operator.getitem` node.
MULTI_VIEW_OPS = {
    torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.unbind.int,
    torch.ops.aten.chunk.default, torch.ops.aten.tensor_split.sections, torch.ops.aten.tensor_split.indices,
}  # fmt: skip


def _lower_outputs(ctx: LoweringContext, node: torch.fx.Node, env: dict) -> list[OutputSpec]:
    results, _ = tree_flatten(node.args[0])
    realized: dict[torch.fx.Node, BufferRef] = {}
    tensors = [r for r in results if isinstance(r, torch.fx.Node) and isinstance(env[r], TensorValue)]
    for root, members in _outputs_sharing_a_base(tensors).items():  # Note: outputs that are views
        realized |= _output_views(ctx, root, members, env, taken={r.name for r in realized.values()})
    outputs = []
    for result in results:
        value = env[result] if isinstance(result, torch.fx.Node) else result
        if not isinstance(value, TensorValue):
            outputs.append(OutputSpec(None, value))
            continue
        if result not in realized:
            ref = _output_buffer(ctx, result, value, taken={r.name for r in realized.values()})
            # a saved tensor goes to the backward's externs (cuDNN attention checks size-1 strides)
            realized[result] = with_eager_unit_strides(
                ref, result.meta.get("val") if isinstance(result, torch.fx.Node) else None
            )
            if isinstance(result, torch.fx.Node) and realized[result].name not in ctx.graph.holds:
                ctx.graph.holds[realized[result].name] = (result.name, realized[result].layout)
        outputs.append(OutputSpec(realized[result]))
    return outputs


def _output_buffer(ctx: LoweringContext, node: torch.fx.Node, value: TensorValue, taken: set[str]) -> BufferRef:
    """A view of an input where eager returns one; an intermediate buffer (or a view of it)
    when no other output shares it and it has eager's strides; otherwise a fresh buffer in
    eager's layout (Note: outputs in eager's layout)."""
    if _aliases_graph_input(node):
        return ctx.realize(value, node.name)
    eager = _eager_output_layout(node.meta.get("val"), value.shape, gaps=node.name in ctx.saved_outputs)
    read = as_strided_read(value)
    if read is not None and not is_kernel_dtype(value.dtype):  # no kernel copies it: aten's result as is
        return BufferRef(read[0], read[1], value.dtype)
    if read is not None and (eager is None or same_strides(read[1], eager)):  # a view nobody else sees: no copy
        buffer = ctx.buffers[read[0]]
        if buffer.kind in ("computed", "extern") and buffer.name not in taken:
            return BufferRef(buffer.name, read[1], buffer.dtype)
    if eager is not None and 0 in eager.stride:
        if _constant_where_broadcast(value, eager):
            return _realize_broadcast(ctx, node.name, value, eager)
        eager = None  # a fake kernel's stride 0 (as_strided_scatter of an expanded input) the values do not have
    return ctx.realize(value, node.name, eager or _dense_in_eager_order(node.meta.get("val"), value.shape), fresh=True)


# Note: outputs in eager's layout
# AOTAutograd traces the backward graph with the forward outputs' fake tensors, so a tensor the
# forward saves for backward must come back with exactly those strides: the backward's kernels
# were generated for them (wrapper/runtime.py `assert_layout`). An output that is a view of an
# intermediate buffer (cat with an empty operand is its other operand, a permuted matmul result)
# is returned as that view only when its strides are eager's; otherwise it is copied into eager's
# layout. A broadcast output (eager's `expand`, strides 0) is stored once per distinct element
# and returned as the same broadcast view. A strided view with gaps (a step slice: Funnel's pooled
# queries, ProphetNet's permuted n-gram states) that the forward saves for the backward
# (`SAVED_OUTPUTS`, marked by the frontend) is stored with eager's gaps; stored dense, it failed
# the backward's layout check. One the user gets is stored dense, in eager's order: only the
# elements returned are computed (tests/test_output_layout.py).
SAVED_OUTPUTS = "ember_saved_outputs"  # gm.meta: names of the nodes a forward returns for its backward


def _eager_output_layout(meta: Any, shape: tuple[int, ...], gaps: bool = False) -> Layout | None:
    """Eager's layout for an output when ember can give it: dense, up to broadcast (stride-0) dims;
    with `gaps` (a tensor saved for the backward), also each element once with gaps between (a
    step slice `c[::2]`, strides (32, 1) for rows of 16), in no more memory than eager's base."""
    if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != shape or 0 in shape:
        return None
    if gaps and dense_layout(meta, shape) is None and (gapped := gapped_layout(meta, shape)) is not None:
        return gapped
    stride = tuple(meta.stride())
    stored = [i for i, size in enumerate(shape) if size != 1 and stride[i] != 0]
    expected = 1
    for i in sorted(stored, key=lambda i: size_hint(stride[i])):  # symbolic: checked by expression below
        if not same_sizes((stride[i],), (expected,)):
            return None
        expected *= shape[i]
    return Layout(shape, stride)


def _dense_in_eager_order(meta: Any, shape: tuple[int, ...]) -> Layout:
    """A dense layout whose dims are in the order of eager's strides, for an output eager returns
    as a strided view (`x.t()[::2]`: strides (2, 2048) -> (1, 1024)). Eager's intermediate
    follows its inputs' memory order (TensorIterator does), so this order walks the inputs as
    eager does, where row-major would read them a row apart per element. Row-major when eager's
    strides say nothing (no meta, broadcast or negative strides)."""
    if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != shape:
        return Layout.contiguous(shape)
    if any(st < 0 or (st == 0 and n != 1) for n, st in zip(shape, meta.stride())):
        return Layout.contiguous(shape)
    order = sorted(range(len(shape)), key=lambda i: (-size_hint(meta.stride(i)), i))  # outermost first
    stride, expected = [0] * len(shape), 1
    for i in reversed(order):
        stride[i] = expected
        expected *= max(shape[i], 1)
    return Layout(shape, tuple(stride))


def _constant_where_broadcast(value: TensorValue, layout: Layout) -> bool:
    """Whether `value` is the same along every dim `layout` broadcasts (stride 0, size > 1)."""
    used = {u.arg for u in simplify(value.body).toposort if u.op is Ops.AXIS}  # (ax * 0 is no use)
    return not any(st == 0 and size != 1 and i in used for i, (size, st) in enumerate(zip(value.shape, layout.stride)))


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
    return _view_chain(node)[0].op == "placeholder"


def _view_chain(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node whose memory eager's `node` views (itself when it is no view), then the view
    ops from it down to `node` (a getitem of a split stands for the split and the pick)."""
    chain = [node]
    while (source := _viewed(chain[0])) is not None:
        chain.insert(0, source)
    return chain


def _viewed(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node `node` is a view of, if it is one."""
    if node.op != "call_function":
        return None
    if node.target in VIEW_OPS:
        return node.args[0]
    parent = node.args[0] if node.target is operator.getitem else None
    if isinstance(parent, torch.fx.Node) and parent.op == "call_function" and parent.target in MULTI_VIEW_OPS:
        return parent.args[0]
    return None


# Note: outputs that are views
# Eager returns `b, b[1:]` as a tensor and a view of it: a write through one shows in the other.
# Lowering folds views into index expressions, so from values alone a view and a copy look alike
# (`b[1:].clone()` reads b's buffer too); the FX graph tells them apart. Outputs whose chains of
# view ops start at one node (the node itself among them, or two views of an intermediate nobody
# returns) share that node's buffer, realized as an output is (eager's layout), and each view is
# that buffer seen through the layout eager's own view ops give when replayed on meta tensors
# laid out as the buffer (`_replayed_view`); a view whose strides would then differ from eager's
# is copied instead, as before. With symbolic sizes (no meta tensor to replay on) a view takes
# eager's own layout where the buffer is laid out as eager's base. Views of graph inputs come back
# as views of the inputs. Under AOTAutograd's training graphs these aliases are rebuilt by its
# runtime wrapper anyway.


def _outputs_sharing_a_base(outputs: list[torch.fx.Node]) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Output nodes that eager returns as views of one computed node, by that node."""
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for output in dict.fromkeys(outputs):
        base = _view_chain(output)[0]
        if base.op == "call_function":
            groups.setdefault(base, []).append(output)
    return {base: members for base, members in groups.items() if len(members) > 1}


def _output_views(ctx: LoweringContext, base: torch.fx.Node, members: list[torch.fx.Node], env: dict,
                  taken: set[str]) -> dict[torch.fx.Node, BufferRef]:  # fmt: skip
    """Refs for output nodes that eager returns as views of `base` (Note: outputs that are views)."""
    base_ref = _output_buffer(ctx, base, env[base], taken)
    refs = {base: base_ref}
    for member in members:
        if member is base:
            continue
        eager = member.meta.get("val")
        layout = _replayed_view(_view_chain(member)[1:], base_ref.layout, base.meta.get("val"), eager)
        if layout is None or (isinstance(eager, torch.Tensor) and not same_strides(layout, Layout(
                tuple(eager.shape), tuple(eager.stride())))):  # fmt: skip
            refs[member] = _output_buffer(ctx, member, env[member], taken | {base_ref.name})
        else:
            refs[member] = BufferRef(base_ref.name, layout, base_ref.dtype)
    return refs if base in members else {m: ref for m, ref in refs.items() if m is not base}


def _replayed_view(views: list[torch.fx.Node], base: Layout, base_value: Any, value: Any) -> Layout | None:
    """The layout eager's view ops `views` give when applied in turn to a tensor laid out as
    `base`, computed by running them on a meta tensor; None when an op takes a tensor argument.
    With symbolic sizes (a meta tensor takes numbers) it is eager's own layout of the view
    (`value`, the view's fake value) where `base` is eager's layout of the base (`base_value`):
    the views then do to the buffer what they did to eager's base, so q, k and v split from one
    projection come back as views of it under dynamic shapes too. Else None: the output is copied."""
    if not all(type(x) is int for x in (*base.size, *base.stride, base.offset)):
        if not (isinstance(base_value, torch.Tensor) and isinstance(value, torch.Tensor)):
            return None
        eager_base = Layout(tuple(base_value.shape), tuple(base_value.stride()), base_value.storage_offset())
        return Layout(tuple(value.shape), tuple(value.stride()), value.storage_offset()) if base == eager_base else None
    t = torch.empty(base.storage_size, device="meta").as_strided(base.size, base.stride, base.offset)
    for view in views:
        op = view.args[0] if view.target is operator.getitem else view  # a split, then its piece
        rest = (*op.args[1:], *op.kwargs.values())
        if any(isinstance(a, torch.fx.Node) for a in tree_flatten(rest)[0]):
            return None
        t = op.target(t, *op.args[1:], **op.kwargs)
        t = t[view.args[1]] if op is not view else t
    return Layout(tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _output_layout(meta: Any, value: TensorValue) -> Layout:
    """Eager's strides when they are dense, no dim broadcast (so outputs match eager's layout), else row-major."""
    eager = _eager_output_layout(meta, value.shape)
    if eager is None or any(st == 0 and n != 1 for n, st in zip(eager.size, eager.stride)):
        return Layout(value.shape, contiguous_strides(value.shape))
    return eager
