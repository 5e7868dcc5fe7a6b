"""oneDNN (mkldnn) rewrites: linear and convolution layers with their epilogues in one call.

torch's CPU builds expose oneDNN's fused primitives as `torch.ops.mkldnn._linear_pointwise`
and `_convolution_pointwise`: a matmul or convolution, a bias and an activation in one pass
over the output. They take plain (not prepacked) weights, so these rewrites are right when
the weights are graph inputs that change between calls. Measured (benchmarks, README):

  - linear: `addmm(b, x, w.t())` / `mm(x, w.t())` -> `_linear_pointwise(x, w, b)` (and
    `addmm(b, x, y)` with `y.t()` as the weight where that is row-major), with a
    following sigmoid/tanh/silu/tanh-gelu folded in, where oneDNN fuses what would otherwise
    cost a pass over the result (Note: which library multiplies).
  - convolution: a chain of per-channel affine ops after a 2-d convolution (eval-mode
    BatchNorm as AOTAutograd decomposes it: sub mean, mul invstd, mul weight, add bias) is
    folded into the weights and bias at run time (w * scale, shift: kernels over the
    weights, not the activations), and a following sigmoid/tanh/silu becomes the
    convolution's post-op. Folding costs a pass over the weight per call, so it is done only
    where that pays (Note: when folding BatchNorm into the weight pays).

relu is a post-op only under config.mkldnn_relu (EMBER_MKLDNN_RELU=1): oneDNN's relu maps NaN
to 0 where aten keeps NaN. Without it, relu stays an ember kernel, fused with whatever reads
the convolution's output (the next convolution's NHWC copy, a pooling reduction).

A linear is rewritten only where oneDNN's scratchpad does not raise the graph's peak memory
(Note: oneDNN's scratchpad).

Only CPU float32 calls are rewritten, and only when mkldnn is available (`applicable`);
convolutions only when their input is NHWC (after layout.py): torch's fake kernel for
`_convolution_pointwise` always answers an NHWC result, which the real one gives only then.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.fx

from ember.ir import same_sizes
from ember.passes import meta
from ember.passes.bias import read_by_kernels_only
from ember.passes.eager_memory import headroom_bytes
from ember.passes.matcher import FxPat, FxPatternMatcher
from ember.passes.matmul_timing import LinearShape, onednn_is_faster
from ember.uop.variables import known_size_hint, size_hint

aten = torch.ops.aten

# aten activation -> oneDNN post-op (attr, algorithm), for those whose NaN and inf results
# are eager's (checked in tests/test_passes.py); gelu is matched by its `approximate`
POST_OPS = {
    aten.sigmoid.default: ("sigmoid", ""),
    aten.tanh.default: ("tanh", ""),
    aten.silu.default: ("swish", ""),
}
# oneDNN's relu maps NaN to 0 (aten's keeps NaN), and its exact gelu maps inf to inf (aten's
# gives NaN): relu only under config.mkldnn_relu, exact gelu never.
RELU_POST_OP = {aten.relu.default: ("relu", "")}

# oneDNN's linear costs ~10 us more per call than aten's addmm (one thread): it wins from about
# a million multiply-adds (2048x64x10: 37 vs 83 us; 128x64x64: 19 vs 14 us; 16x8x4: 14 vs 3 us)
LINEAR_MIN_MACS = 1 << 20
# A product of one row (a decode step's) reads each weight element once: its time is streaming the
# weight, which in a model larger than the caches comes from memory, microseconds per 100 KB, next
# to which oneDNN's fixed cost is small. Such a product is timed (Note: timed matmul libraries)
# from ONE_ROW_MIN_WEIGHT_BYTES of weight up, under LINEAR_MIN_MACS too: GPT-2's 768 x 768
# attention projection at a decode step took MKL 105 us (22 GB/s) against oneDNN's 46 GB/s.
ONE_ROW_MIN_WEIGHT_BYTES = 1 << 20


# Note: which library multiplies
# At the real models' shapes aten's mm (MKL's sgemm) is 3-10% faster than oneDNN's linear on one
# thread (benchmarks/real_models.py shapes, Sapphire Rapids: 1024 x 768 x 3072, mm 27.5 ms, oneDNN
# with its bias 31.0; 1024 x 3072 x 768, 26.6 against 29.3; 1024 x 512 x 32000, 263 against 279).
# aten's addmm is not: it first copies the bias into its result, a pass of its own (25088 x 96
# rows times 96 x 384: addmm 22.9 ms, mm 14.6). So:
#   - where ember's kernels read the result (an activation, a residual add, a layer scale; through
#     views), they add the bias for free: addmm(b, x, w) -> mm(x, w) + b (passes/bias.py), and the
#     mm stays aten's;
#   - oneDNN takes a matmul where it fuses what would otherwise cost a pass: an activation it
#     applies as a post-op whose result leaves ember's kernels (linear -> tanh -> linear);
#   - a bias where an extern kernel (attention) or the graph's caller reads the result stays in
#     aten's addmm: its bias pass costs less than oneDNN's linear does over mm. One thread, the
#     median of interleaved calls (Sapphire Rapids, a busy machine), oneDNN with its bias against
#     addmm: BERT's and ViT's query/key/value 128 x 768 x 768, 1233 against 1140 us; 1024 rows,
#     9387 against 8914; 197 and 1576 rows, 1887 against 1754 and 14245 against 13691;
#     nn.TransformerEncoderLayer's 512 x 256 x 768 projection, 1715 against 1480; 1024 x 128 x
#     512, 1247 against 1055; 3136 x 96 x 384, 2328 both. oneDNN was never the faster;
#   - a plain mm whose result leaves ember's kernels stays aten's too: oneDNN would fuse nothing.
# All of this held on Sapphire Rapids. On other machines the libraries rank otherwise (an AMD EPYC:
# oneDNN in less than half of MKL's time), so, under config.matmul_timing, a static linear also
# goes to oneDNN wherever oneDNN was timed faster at its shape on this machine (Note: timed matmul
# libraries, matmul_timing.py): the rules above decide only where oneDNN was not.


# Note: oneDNN's scratchpad
# oneDNN's matmul takes a scratchpad from torch's allocator on every call, freed when it returns:
# per thread, a D x 64 panel of the weight copied into its own layout, D the depth of the K blocks
# it works in (`panel_depth`: K rounded up to 16 up to 512; 512 for K up to 1024; 1024 beyond,
# whatever M, N and the thread count), and a copy of the whole input when that is not row-major (so a transposed input,
# a weight gradient's, stays with aten, whose BLAS reads it in place). A single row (a decode
# step's vector) takes neither: 256 + 640 bytes per thread, whatever K, N, bias or post-op (measured with
# torch.profiler's memory events for oneDNN 3.x; tests/test_peak_memory.py checks the bound on several
# shapes). MKL's sgemm behind aten's addmm packs into buffers it keeps from call to call, so a
# oneDNN linear costs memory where an addmm costs none: 2 MiB per call at 16 threads, more than
# the activations of a small model. So a matmul becomes a oneDNN linear only where that
# scratchpad fits under the peak the graph reaches anyway, run op by op as eager runs it
# (eager_memory.py `headroom_bytes`); ember's fused kernels hold no more than that at any point.
# The decision depends on the thread count, which is in the graph cache key.
# A language model's head is the graph's peak (its logits), so no scratchpad fits there, and it
# stays with MKL, at about half of oneDNN's speed on an AMD EPYC: LLaMA-style and GPT-2 small at
# batch 8 x 128 ran at 1.38x and 1.58x of eager, and 1.87x and 2.12x with their heads on oneDNN,
# for 258 KiB over eager's peak of 127 and 199 MiB at 2 threads. config.onednn_slack_kb
# (EMBER_ONEDNN_SLACK_KB, 0 by default) is the KiB above eager's peak the scratchpads may take.
HEADROOM = "ember_headroom_bytes"  # node.meta key: what annotate_headroom found for the node
WEIGHT_PANEL = 64  # columns of the weight panel each thread copies
PER_THREAD_BYTES = 1024  # oneDNN's own bookkeeping per thread, rounded up


def annotate_headroom(graph: torch.fx.Graph, inputs_held: bool = False, slack: int = 0) -> None:
    """Record in each matmul node's meta the bytes it may add without raising the peak by more
    than `slack` bytes (`inputs_held`: eager_memory.INPUTS_HELD)."""
    for node, headroom in headroom_bytes(graph, inputs_held).items():
        if node.target in (aten.addmm.default, aten.mm.default):
            node.meta[HEADROOM] = headroom + slack


def linear_scratchpad_bytes(x: torch.Tensor, in_features: int, threads: int) -> int:
    """An upper bound of the scratchpad one `_linear_pointwise` call on input `x` takes (Note:
    oneDNN's scratchpad)."""
    rows = x.numel() // max(in_features, 1)
    if rows == 1:  # a vector times the matrix (a decode step): no panels, no copy of the input
        return threads * PER_THREAD_BYTES
    depth = panel_depth(in_features)
    per_thread = WEIGHT_PANEL * depth * 4 + PER_THREAD_BYTES
    input_copy = 0 if _row_major(x, in_features) else rows * in_features * 4
    return threads * per_thread + input_copy


def panel_depth(in_features: int) -> int:
    """The K-block depth of the weight panel oneDNN copies per thread (Note: oneDNN's scratchpad)."""
    rounded = -(-in_features // 16) * 16
    if rounded <= 512:
        return rounded
    return 512 if in_features <= 1024 else 1024


def applicable() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


# -- linear ---------------------------------------------------------------------------------


def linear(graph: torch.fx.Graph, node: torch.fx.Node, x: torch.fx.Node, w: torch.fx.Node,
           b: Any = None, relu: bool = False, timed_in: str | None = None) -> torch.fx.Node | None:  # fmt: skip
    """x @ w.t() + b as one oneDNN linear; w is the (out, in) weight, b a 1-d bias or None;
    `relu`: relu is a post-op (config.mkldnn_relu); `timed_in`: the cache folder of matmul
    timings, None when they are off (config.matmul_timing)."""
    if not _linear_pays(node, x, w, b, out_dim=0):
        return None
    fused = _post_op_pays(node, relu) and _past_fixed_cost(node, x)
    if not (fused or _timed_faster(node, x, w, b, 0, False, timed_in)):
        return None
    return _linear_call(graph, node, (x, w, b, "none", [], ""))


def linear_of_matrix(graph: torch.fx.Graph, node: torch.fx.Node, x: torch.fx.Node, y: torch.fx.Node, b: Any = None,
                     relu: bool = False, timed_in: str | None = None) -> torch.fx.Node | None:  # fmt: skip
    """x @ y + b with y an (in, out) matrix: oneDNN reads y.t() as its (out, in) weight.
    Stored column-major (a transposed view of an (out, in) weight that the graph's views hid),
    y is a linear's weight as any other. Stored row-major (GPT-2's Conv1D weight), y goes to
    oneDNN only where it was timed faster on this machine: on Sapphire Rapids oneDNN given that
    layout took 1.5 to 2 times as long as aten's addmm (one thread: 128 x 768 x 3072, 7.6 against
    5.1 ms; 1024 rows, 62 against 29), on an AMD EPYC less than half (Note: timed matmul
    libraries, matmul_timing.py)."""
    value = y.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return None
    in_out = not value.t().is_contiguous()
    if in_out and not value.is_contiguous():
        return None
    if not _linear_pays(node, x, y, b, out_dim=1):
        return None
    fused = not in_out and _post_op_pays(node, relu) and _past_fixed_cost(node, x)
    if not (fused or _timed_faster(node, x, y, b, 1, in_out, timed_in)):
        return None
    weight = meta.call(graph, aten.permute.default, (y, [1, 0]))
    return _linear_call(graph, node, (x, weight, b, "none", [], ""))


def _timed_faster(node: torch.fx.Node, x: torch.fx.Node, weight: torch.fx.Node, b: Any, out_dim: int,
                  in_out: bool, timed_in: str | None) -> bool:  # fmt: skip
    """Whether oneDNN's linear was timed faster than aten's matmul at `node`'s shape on this machine
    (Note: timed matmul libraries); `weight`'s dim `out_dim` is the output features, and `in_out`:
    it is stored (in, out) row-major. A symbolic linear is timed at its example's sizes, the hints
    of its symbols; at each call `linear_by_size` still leaves the small ones to aten."""
    rows, in_features = (known_size_hint(s) for s in x.meta["val"].shape)
    out_features = known_size_hint(weight.meta["val"].shape[out_dim])
    if timed_in is None or None in (rows, in_features, out_features):
        return False
    shape = LinearShape(rows, in_features, out_features, b is not None, in_out)
    return onednn_is_faster(shape, timed_in)


def _linear_call(graph: torch.fx.Graph, node: torch.fx.Node, args: tuple) -> torch.fx.Node:
    """oneDNN's linear in place of `node`, or for a symbolic one, `linear_by_size`."""
    weight = args[1].meta["val"]
    target = linear_by_size if _symbolic_linear(node, weight.shape[1]) else torch.ops.mkldnn._linear_pointwise.default
    return meta.call(graph, target, args, like=_dense(node))


def _symbolic_linear(node: torch.fx.Node, in_features: Any) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*node.meta["val"].shape, in_features))


# Note: a symbolic linear picks its matmul at run time
# oneDNN's linear wins from about LINEAR_MIN_MACS multiply-adds and loses below (its fixed cost,
# and a copy of the weight into its own layout at every call). A graph with symbolic sizes serves
# every row count, so the threshold taken at the example's sizes would decide all of them by the
# first (a prompt of thousands of rows, a decode step of one). Such a linear is `linear_by_size`,
# a function the wrapper calls (kept in the graph cache by name: runtime/graph_cache.py), which
# asks the sizes each call gets. Under fake tensors (a SymInt count) it answers oneDNN's result,
# whose layout the other path's has too (row-major), so tracing it adds no guard. Whether oneDNN
# is worth it at all is decided as for a static linear (a post-op to fuse, or oneDNN timed faster
# on this machine: Note: timed matmul libraries), the timing at the example's sizes, since which
# library is faster depends on the machine far more than on the row count.


def linear_by_size(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attr: str, scalars: list,
                   algorithm: str) -> torch.Tensor:  # fmt: skip
    """`mkldnn._linear_pointwise(x, weight, bias, attr, scalars, algorithm)`, by aten's mm or addmm
    and the post-op in place below LINEAR_MIN_MACS multiply-adds (Note: a symbolic linear picks
    its matmul at run time)."""
    macs = x.shape[0] * weight.shape[0] * weight.shape[1]
    if not isinstance(macs, int) or macs >= LINEAR_MIN_MACS:
        return torch.ops.mkldnn._linear_pointwise.default(x, weight, bias, attr, scalars, algorithm)
    out = torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
    return ACTIVATIONS_IN_PLACE[attr](out)


# oneDNN post-op -> aten's activation, in place on a fresh matmul result (POST_OPS and RELU_POST_OP)
ACTIVATIONS_IN_PLACE = {
    "none": lambda out: out,
    "sigmoid": torch.sigmoid_,
    "tanh": torch.tanh_,
    "swish": lambda out: torch.nn.functional.silu(out, inplace=True),
    "relu": torch.relu_,
    "gelu": lambda out: torch.nn.functional.gelu(out, approximate="tanh"),  # the only gelu post-op (post_op)
}


def _post_op_pays(node: torch.fx.Node, relu: bool) -> bool:
    """`node`'s one reader is an activation oneDNN applies as a post-op (`relu`: relu is one), and
    the activation's result leaves ember's kernels (an extern kernel or the graph's caller reads it)."""
    if len(node.users) != 1:
        return False
    user = next(iter(node.users))
    return post_op(user, relu)[0] is not None and not read_by_kernels_only(user)


def _dense(node: torch.fx.Node) -> Any:
    """`node`'s fake value when it is row-major, as oneDNN's linear result is; else None
    (compute it)."""
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) and value.is_contiguous() else None


def _linear_pays(node: torch.fx.Node, x: Any, weight: Any, b: Any, out_dim: int) -> bool:
    """A CPU float32 matmul big enough for oneDNN, with plain alpha/beta and a 1-d bias;
    `weight`'s dim `out_dim` is the output features."""
    if node.kwargs or not meta.cpu_float32(x, weight, node) or weight.meta["val"].dim() != 2:
        return False
    out_features = weight.meta["val"].shape[out_dim]
    if b is not None and (not meta.cpu_float32(b) or b.meta["val"].shape != (out_features,)):
        return False
    in_features = weight.meta["val"].shape[1 - out_dim]
    if not _row_major(x.meta["val"], in_features):
        return False  # oneDNN copies the whole input first; aten's BLAS reads it in place
    if _symbolic_linear(node, in_features):
        return True  # decided at every call (Note: a symbolic linear picks its matmul at run time)
    if not _past_fixed_cost(node, x) and not _streams_one_row(node, in_features):
        return False
    scratchpad = linear_scratchpad_bytes(x.meta["val"], in_features, torch.get_num_threads())
    return scratchpad <= node.meta.get(HEADROOM, 0)


def _past_fixed_cost(node: torch.fx.Node, x: torch.fx.Node) -> bool:
    """At least LINEAR_MIN_MACS multiply-adds; a symbolic linear is asked at each call instead
    (Note: a symbolic linear picks its matmul at run time), never here, where a comparison of
    symbolic sizes would add a guard."""
    in_features = x.meta["val"].shape[-1]
    if _symbolic_linear(node, in_features):
        return True
    return node.meta["val"].numel() * in_features >= max(LINEAR_MIN_MACS, 1)


def _streams_one_row(node: torch.fx.Node, in_features: int) -> bool:
    """One row by a weight of ONE_ROW_MIN_WEIGHT_BYTES or more (a static linear)."""
    rows, out_features = node.meta["val"].shape
    return rows == 1 and out_features * in_features * 4 >= ONE_ROW_MIN_WEIGHT_BYTES


def _row_major(x: torch.Tensor, in_features: int) -> bool:
    """Rows of `in_features` one after another; a single row's stride is any (a decode step's
    last position, sliced out of the sequence, keeps the sequence's stride or gets 0)."""
    if x.dim() != 2 or not same_sizes((x.stride(1),), (1,)):
        return False
    return same_sizes((x.shape[0],), (1,)) or same_sizes((x.stride(0),), (in_features,))


def linear_post_op(graph: torch.fx.Graph, node: torch.fx.Node, lin: torch.fx.Node) -> torch.fx.Node | None:
    """act(linear(x)) -> one oneDNN linear with `act` as its post-op."""
    attr, algorithm = post_op(node, relu=True)  # the table decides whether relu is matched
    if attr is None or lin.args[3] != "none":
        return None
    return meta.call(graph, lin.target, (*lin.args[:3], attr, [], algorithm), like=_dense(node))


def post_op(node: torch.fx.Node, relu: bool) -> tuple[str | None, str]:
    """The oneDNN post-op computing `node`'s activation exactly as aten does, if any."""
    if node.target is aten.gelu.default:
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return ("gelu", "tanh") if approximate == "tanh" else (None, "")
    table = {**POST_OPS, **RELU_POST_OP} if relu else POST_OPS
    return table.get(node.target, (None, ""))  # type: ignore[call-overload]


x, w, y, b = FxPat.var("x"), FxPat.var("w"), FxPat.var("y"), FxPat.var("b")
weight_t = FxPat((aten.permute.default,), w, [1, 0])
linear_result = FxPat((torch.ops.mkldnn._linear_pointwise.default, linear_by_size), name="lin", one_user=True)


def pm_mkldnn_linear(relu: bool, timed_in: str | None = None) -> FxPatternMatcher:
    """The linear rules; `relu`: relu is a post-op (config.mkldnn_relu); `timed_in`: the cache
    folder of matmul timings, None when they are off (Note: timed matmul libraries)."""
    of_weight = partial(linear, relu=relu, timed_in=timed_in)
    of_matrix = partial(linear_of_matrix, relu=relu, timed_in=timed_in)
    return FxPatternMatcher([
        (FxPat(aten.addmm.default, b, x, weight_t), of_weight),  # addmm(b, x, w.t()) -> linear(x, w, b)
        (FxPat(aten.mm.default, x, weight_t), of_weight),        # mm(x, w.t()) -> linear(x, w)
        (FxPat(aten.addmm.default, b, x, y), of_matrix),         # addmm(b, x, y), y column-major -> linear(x, y.t(), b)
        (FxPat(aten.mm.default, x, y), of_matrix),               # mm(x, y), y column-major -> linear(x, y.t())
        (FxPat((*POST_OPS, aten.gelu.default), linear_result),
         linear_post_op),                                        # act(linear(x, w, b)) -> linear(x, w, b, act)
    ])  # fmt: skip


pm_mkldnn_linear_relu = FxPatternMatcher([
    (FxPat(aten.relu.default, linear_result), linear_post_op),  # relu(linear(x, w, b)) -> linear(..., relu)
])  # fmt: skip


# -- convolution ----------------------------------------------------------------------------

AFFINE_KINDS = {aten.add.Tensor: "add", aten.sub.Tensor: "sub", aten.mul.Tensor: "mul"}


def fold_convolution_epilogues(graph: torch.fx.Graph, relu: bool) -> int:
    """Each 2-d convolution followed by per-channel affine ops and/or an activation becomes
    one `_convolution_pointwise`; returns how many. `relu`: relu may be a post-op."""
    folded = 0
    for conv in [n for n in graph.nodes if _plain_conv2d(n)]:
        chain, activation_node = _epilogue(conv, relu)
        if not chain and activation_node is None:
            continue
        if chain and not _folding_pays(conv):
            continue  # the activation reads the chain: without it, no post-op either
        last = activation_node or chain[-1][1]
        with graph.inserting_before(last):
            fused = _fused_convolution(graph, conv, chain, activation_node)
        last.replace_all_uses_with(fused)
        for node in [last, *reversed([n for _, n in chain if n is not last]), conv]:
            graph.erase_node(node)  # each was the only user of the next one
        folded += 1
    return folded


# Note: when folding BatchNorm into the weight pays
# Folding the per-channel affine chain into the weight costs a pass over the weight (read, then
# write the folded copy) at every call, as weights are graph inputs that may change. What it
# saves is at most a pass over the convolution's output: the affine ops otherwise inline into the
# ember kernel that reads the output (the ReLU, the residual add, the next NHWC copy), which
# mostly runs anyway. So the chain is folded when the weight is copied anyway (into OHWI, Note:
# channels-last weights, layout.py: the scale rides along) or is no larger than the output. At
# batch 1, ResNet-50's last 1 x 1 convolutions have weights 10-20 times their output: folding
# them cost more than their BatchNorm (about 16 of 136 ms a step, one thread).


def _folding_pays(conv: torch.fx.Node) -> bool:
    """(A symbolic output's size is its example's: a guess about speed, Note: symbolic sizes.)"""
    weight = conv.args[1]
    return _channels_last_copy(weight) or weight.meta["val"].numel() <= size_hint(conv.meta["val"].numel())  # type: ignore[union-attr]


def _channels_last_copy(node: Any) -> bool:
    """`node` is layout.py's `clone(w, memory_format=channels_last)`."""
    return (isinstance(node, torch.fx.Node) and node.target is aten.clone.default
            and node.kwargs.get("memory_format") == torch.channels_last)  # fmt: skip


def _plain_conv2d(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not aten.convolution.default:
        return False
    out, x = node.meta.get("val"), node.args[0].meta.get("val")  # type: ignore[union-attr]
    if not isinstance(x, torch.Tensor) or not x.is_contiguous(memory_format=torch.channels_last):
        return False  # torch's fake kernel of _convolution_pointwise says NHWC output whatever the input
    transposed, output_padding = node.args[6], node.args[7]
    return (meta.cpu_float32(node.args[0], node.args[1], node) and out.dim() == 4 and out.numel() > 0  # type: ignore[union-attr]
            and not transposed and not any(output_padding))  # type: ignore[arg-type]  # fmt: skip


def _epilogue(conv: torch.fx.Node, relu: bool) -> tuple[list[tuple[str, Any]], torch.fx.Node | None]:
    """The per-channel ops after `conv` ((kind, node) with kind add/sub/mul) and an activation,
    each the only user of the one before."""
    chain: list[tuple[str, Any]] = []
    node = conv
    channels = conv.meta["val"].shape[1]
    while len(node.users) == 1:
        user = next(iter(user for user in node.users))
        kind = AFFINE_KINDS.get(user.target)  # type: ignore[call-overload]
        if kind is not None and not user.kwargs and user.args[0] is node and _per_channel(user.args[1], channels):
            if user.meta["val"].dtype != torch.float32:
                break
            chain.append((kind, user))
            node = user
            continue
        if post_op(user, relu)[0] is not None and user.args[0] is node:
            return chain, user
        break
    return chain, None


def _per_channel(value: Any, channels: int) -> bool:
    """A float32 tensor that broadcasts over (N, C, H, W) along C only."""
    t = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() > 4 or t.device.type != "cpu":
        return False
    shape = (1,) * (4 - t.dim()) + tuple(t.shape)
    return shape[0] == 1 and shape[2:] == (1, 1) and shape[1] in (1, channels)


def _fused_convolution(graph: torch.fx.Graph, conv: torch.fx.Node, chain: list, activation_node: Any) -> torch.fx.Node:
    """conv(x, w*scale, shift) with the activation as a post-op; scale and shift per channel."""
    x, weight, bias, stride, padding, dilation, _, _, groups = conv.args
    channels = conv.meta["val"].shape[1]
    scale, shift = None, bias
    for kind, node in chain:
        operand = _as_channel_vector(graph, node.args[1], channels)
        if kind == "mul":
            scale = operand if scale is None else meta.call(graph, aten.mul.Tensor, (scale, operand))
            shift = None if shift is None else meta.call(graph, aten.mul.Tensor, (shift, operand))
        else:
            if kind == "sub":
                operand = meta.call(graph, aten.neg.default, (operand,))
            shift = operand if shift is None else meta.call(graph, aten.add.Tensor, (shift, operand))
    if scale is not None:
        scale_4d = meta.call(graph, aten.view.default, (scale, [channels, 1, 1, 1]))
        if _channels_last_copy(weight):  # one kernel scales the weight into OHWI (the old copy dies)
            scaled = meta.call(graph, aten.mul.Tensor, (weight.args[0], scale_4d))
            weight = meta.call(graph, aten.clone.default, (scaled,), {"memory_format": torch.channels_last})
        else:
            weight = meta.call(graph, aten.mul.Tensor, (weight, scale_4d))
    attr, algorithm = post_op(activation_node, relu=True) if activation_node is not None else ("none", "")
    args: tuple = (x, weight, shift, padding, stride, dilation, groups, attr, [], algorithm)
    last = activation_node if activation_node is not None else chain[-1][1]
    like = last.meta["val"] if last.meta["val"].is_contiguous(memory_format=torch.channels_last) else None
    return meta.call(graph, torch.ops.mkldnn._convolution_pointwise.default, args, like=like)


def _as_channel_vector(graph: torch.fx.Graph, value: torch.fx.Node, channels: int) -> torch.fx.Node:
    """A per-channel operand as a (C,) tensor node."""
    t = value.meta["val"]
    flat = meta.call(graph, aten.reshape.default, (value, [t.numel()]))
    if t.numel() == channels:
        return flat
    return meta.call(graph, aten.expand.default, (flat, [channels]))
