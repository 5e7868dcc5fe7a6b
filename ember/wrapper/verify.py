"""Stage `wrapper`, under EMBER_VERIFY: each compiled call checked, kernel by kernel, against
the same aten graph run in float64 eager.

Takes the loaded `call(args, _check)` of a wrapper generated with `verify=True`, the FX graph
as compile_graph received it (before ember's passes), the lowered graph's `holds` (which FX
node each buffer holds) and the steps; gives a callable with the wrapper's calling convention
that warns (or raises, under strict) naming the first step whose output differs.

Note: verifying a compiled graph
    The wrapper calls `_check(step, {buffer: tensor})` after the last step that writes each
    buffer holding an FX node's value (Note: which node a buffer holds, lower/graph.py), before
    the buffer is freed or reused. The verifier runs the original FX graph as an interpreter in
    float64 (float inputs upcast, float dtype arguments widened), lazily: at a check it
    evaluates the nodes the checked node depends on that it has not evaluated yet, compares,
    and then *anchors* the node: from then on the node's value is ember's own buffer (upcast).
    So every step is compared with float64 computed from the very inputs that step read, and
    the error of one kernel never accumulates into a false report against a later one; the
    first step that differs is the step whose own computation is wrong. Random ops, bit
    reinterpretations and ops that fail in float64 make their dependents unverifiable until a
    buffer anchors them again. A second interpreter runs the graph the same way in its own
    dtypes (eager's roundings): a step passes when it is close to either run, since a bfloat16
    step rounds after each op it fuses where the float64 run never rounds (the conformance
    sweep, tests/conformance.py, accepts either reference for the same reason).

    Tolerance, per element: |ember - float64| <= rtol * (|float64| + rms), with rms the root
    mean square of the buffer's finite reference values (a scale for results that cancel to
    near zero), rtol by the buffer's dtype (`RTOL`); NaN where the reference has NaN and only
    there; equal infinities. Integer and bool buffers must be equal, except that where they
    come from float math inside the step (a comparison, an argmax) one element in a hundred
    may differ, as float32 and float64 may round a near-tie differently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map

from ember.debug.provenance import fused_nodes, source_line, step_of_nodes
from ember.errors import EmberError, warn_at_user_code
from ember.ir import ExternCall, Layout, LoweredGraph
from ember.metrics import metrics
from ember.schedule import KernelStep, Step
from ember.wrapper.python import KernelBinary

RTOL = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
WIDENED = (torch.float32, torch.float16, torch.bfloat16)
# ops whose float64 run means something else: they reinterpret bits
BIT_OPS = {torch.ops.aten.view.dtype}
UNAVAILABLE = object()  # a node's float64 value cannot be had (random, failed)


class VerificationError(EmberError):
    """EMBER_VERIFY under strict: a compiled step's output differs from float64 eager."""

    def __init__(self, message: str):
        super().__init__("verify", message)


@dataclass(frozen=True)
class StepInfo:
    label: str  # "kernel kernel_ab12..." or "extern aten.mm.default"
    number: int  # 1-based position among the graph's steps
    total: int


@dataclass(frozen=True)
class Mismatch:
    step: StepInfo
    buffer: str
    node: torch.fx.Node
    fused: tuple[torch.fx.Node, ...]
    detail: str

    def message(self) -> str:
        fused = ", ".join(f"{n.name} ({n.target})" for n in self.fused) or "(none known)"
        lines = [
            f"{self.step.label} (step {self.step.number} of {self.step.total}) differs from the float64 reference",
            f"  buffer {self.buffer} holds node '{self.node.name}' ({self.node.target}): {self.detail}",
            f"  fused aten nodes: {fused}",
            f"  source: {source_line(self.node, self.fused)}",
        ]
        return "\n".join(lines)


def step_infos(steps: list[Step], kernels: dict[int, KernelBinary]) -> dict[int, StepInfo]:
    infos = {}
    for i, step in enumerate(steps):
        if isinstance(step, KernelStep):
            label = f"kernel {kernels[i].symbol}" if i in kernels else "kernel (empty)"
        else:
            assert isinstance(step, ExternCall)
            label = f"extern {step.op}"
        infos[i] = StepInfo(label, i + 1, len(steps))
    return infos


class VerifiedGraph:
    """A compiled graph's `call` that checks every call (Note: verifying a compiled graph)."""

    def __init__(self, call: Callable, gm: torch.fx.GraphModule, graph: LoweredGraph, steps: list[Step],
                 kernels: dict[int, KernelBinary], strict: bool):  # fmt: skip
        self.call, self.gm, self.strict = call, gm, strict
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.holds = {buf: (self.nodes[name], layout) for buf, (name, layout) in graph.holds.items()
                      if name in self.nodes}  # fmt: skip
        self.steps = step_infos(steps, kernels)
        self.step_of = step_of_nodes(steps, self.holds)

    def __call__(self, args: list) -> Any:
        # float64, and eager in the graph's own dtypes: a low-precision step may round where the
        # float64 run does not (each inlined bfloat16 op rounds), so a step passes when it is
        # close to either, as in tests/conformance.py
        exact, same = Reference(self.gm, list(args)), Reference(self.gm, list(args), wide=False)
        found: list[Mismatch] = []

        def check(step: int, buffers: dict[str, torch.Tensor]) -> None:
            if found:
                return  # the first differing step is the one to fix; the rest may follow from it
            held = sorted((self.order[self.holds[n][0]], n) for n in buffers if n in self.holds)
            for _, name in held:  # in graph order: a step's first wrong node is the one to name
                node, layout = self.holds[name]
                tensor = buffers[name]
                got = view(tensor, layout)
                detail, same_detail = exact.check(node, got), same.check(node, got)
                detail = detail if same_detail else ""
                metrics.add(verify_checks=1)
                if detail:
                    fused = fused_nodes(node, step, self.step_of)
                    found.append(Mismatch(self.steps[step], name, node, fused, detail))
                    return

        result = self.call(args, check)
        if found:
            metrics.add(verify_mismatches=1)
            if self.strict:
                raise VerificationError(found[0].message())
            warn_at_user_code(f"ember verify: {found[0].message()}")
        return result


def view(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    return t.as_strided(layout.size, layout.stride, t.storage_offset() + layout.offset)


class Reference:
    """The FX graph in float64 (`wide`) or in its own dtypes, evaluated lazily node by node,
    with ember's checked buffers anchored in place of the nodes they hold (Note: verifying a
    compiled graph)."""

    def __init__(self, gm: torch.fx.GraphModule, args: list, wide: bool = True):
        self.gm, self.wide = gm, wide
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.env: dict[torch.fx.Node, Any] = {}
        self.float_math: dict[torch.fx.Node, bool] = {}  # computed from floats since the last anchor
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, args):
            self.env[node], self.float_math[node] = self.copy(value), False

    def copy(self, value: Any) -> Any:
        return widen(value) if self.wide else own_copy(value)

    def check(self, node: torch.fx.Node, got: torch.Tensor) -> str:
        """'' when ember's `got` agrees with node's reference value (or it has none), else what
        differs; then `got` stands for the node (anchored)."""
        want = self.value(node)
        detail = ""
        if isinstance(want, torch.Tensor):
            detail = difference(got, want, self.float_math[node])
        self.env[node], self.float_math[node] = self.copy(got), False
        return detail

    def value(self, node: torch.fx.Node) -> Any:
        missing, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in self.env or n in missing:
                continue
            missing.add(n)
            stack += n.all_input_nodes
        for n in sorted(missing, key=self.order.__getitem__):
            self.env[n], self.float_math[n] = self.evaluate(n), self.computes_from_floats(n)
        return self.env[node]

    def evaluate(self, node: torch.fx.Node) -> Any:
        if node.op == "get_attr":
            return self.copy(getattr(self.gm, str(node.target)))
        if node.op != "call_function":
            return UNAVAILABLE
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), self.env.__getitem__)
        if any(v is UNAVAILABLE for v in tree_flatten((args, kwargs))[0]) or not reproducible(node):
            return UNAVAILABLE
        if self.wide:
            args, kwargs = tree_map(widen_dtype, args), tree_map(widen_dtype, kwargs)
        target = node.target
        assert callable(target)  # a call_function node's target is the function
        try:
            return target(*args, **kwargs)
        except Exception:
            return UNAVAILABLE

    def computes_from_floats(self, node: torch.fx.Node) -> bool:
        for arg in node.all_input_nodes:
            value = self.env[arg]
            if self.float_math[arg] or (isinstance(value, torch.Tensor) and value.is_floating_point()):
                return True
        return False


def reproducible(node: torch.fx.Node) -> bool:
    target = node.target
    if target in BIT_OPS:
        return False
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags


def widen(value: Any) -> Any:
    """A float64 copy of a float tensor, a copy of any other (the graph may write its inputs)."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    return value.to(torch.float64) if value.dtype in WIDENED else value.clone()


def own_copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def widen_dtype(value: Any) -> Any:
    return torch.float64 if isinstance(value, torch.dtype) and value in WIDENED else value


def difference(got: torch.Tensor, want: torch.Tensor, float_math: bool) -> str:
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, float64 reference {tuple(want.shape)}"
    if got.numel() == 0:
        return ""
    if got.is_floating_point() and want.is_floating_point():
        return float_difference(got, want, RTOL.get(got.dtype, 1e-4))
    if got.is_complex() or want.is_complex():
        return ""
    differs = got.to(want.dtype) != want
    allowed = max(1, got.numel() // 100) if float_math else 0
    count = int(differs.sum())
    if count <= allowed:
        return ""
    where = tuple(differs.nonzero()[0].tolist())
    return (f"{count} of {got.numel()} elements differ ({got.dtype}); first at {where}: ember {got[where].item()}, "
            f"float64 reference {want[where].item()}")  # fmt: skip


def float_difference(got: torch.Tensor, want: torch.Tensor, rtol: float) -> str:
    g, w = got.detach().to(torch.float64), want.detach().to(torch.float64)
    nan = g.isnan() != w.isnan()
    if nan.any():
        where = tuple(nan.nonzero()[0].tolist())
        return (f"NaN where the float64 reference is not, or the reverse: at {where} ember {g[where].item()}, "
                f"float64 {w[where].item()}")  # fmt: skip
    finite = w[w.isfinite()]
    rms = float(finite.square().mean().sqrt()) if finite.numel() else 0.0
    error = (g - w).abs()
    error[(g == w) | (g.isnan() & w.isnan())] = 0.0  # equal infinities
    bad = error > rtol * (w.abs() + rms)
    if not bad.any():
        return ""
    flat = int(torch.where(bad, error, torch.zeros_like(error)).argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
    relative = error / w.abs().clamp_min(1e-300)
    return (f"{int(bad.sum())} of {g.numel()} elements beyond tolerance (rtol {rtol:g} for {got.dtype}); "
            f"max abs error {float(error[bad].max()):.3g} at {where} (ember {g[where].item():.7g}, float64 "
            f"{w[where].item():.7g}), max rel error {float(relative[bad].max()):.3g}")  # fmt: skip
