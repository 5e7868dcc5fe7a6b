"""Provenance: which aten nodes of the FX graph each step computes, and the user's source
line they came from. Used by the fusion report (`ember explain`, `fusion.txt`) and by
EMBER_VERIFY's messages (wrapper/verify.py). A lowered graph's `holds` says which FX node each
buffer holds (Note: which node a buffer holds, lower/graph.py); a step computes the nodes its
written buffers hold and every ancestor reached without crossing another step's buffer.
"""

from __future__ import annotations

import functools
import os
import re
import types
from dataclasses import dataclass

import torch
import torch.fx

from ember.ir import Layout
from ember.schedule import KernelStep, Step

TORCH_FOLDER = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def step_of_nodes(steps: list[Step], holds: dict[str, tuple[torch.fx.Node, Layout]]) -> dict[torch.fx.Node, int]:
    """The step that computes each FX node some buffer holds."""
    step_of = {}
    for i, step in enumerate(steps):
        names = step.writes if isinstance(step, KernelStep) else [b.name for b in step.outputs]
        for name in names:
            if name in holds:
                step_of[holds[name][0]] = i
    return step_of


def fused_nodes(node: torch.fx.Node, step: int, step_of: dict[torch.fx.Node, int],
                order: dict[torch.fx.Node, int] | None = None) -> tuple[torch.fx.Node, ...]:  # fmt: skip
    """The FX nodes `step` computes to give `node`: its ancestors reached without going through
    a node another step's buffer holds (or a graph input), in graph order (`order`: each node's
    position, when the caller has it)."""
    region: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in region or n.op != "call_function":
            continue
        region.add(n)
        stack += [a for a in n.all_input_nodes if step_of.get(a, step) == step]
    order = order if order is not None else {n: k for k, n in enumerate(node.graph.nodes)}
    return tuple(sorted(region, key=order.__getitem__))


def source_line(node: torch.fx.Node, fused: tuple[torch.fx.Node, ...]) -> str:
    """The user's line for `node` (or the first fused node that has one), from its stack trace;
    for a backward node (AOTAutograd keeps no stack trace there), the forward module and the
    aten op it is the gradient of."""
    for n in (node, *fused):
        trace = n.meta.get("stack_trace")
        if trace:
            frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
            if frames:
                path, line, function, code = frames[-1]
                return f'File "{path}", line {line}, in {function}: {code.strip()}'
    for n in (node, *fused):
        modules = n.meta.get("fwd_nn_module_stack") or n.meta.get("nn_module_stack")
        if modules:
            path, kind = list(modules.values())[-1]
            kind_name = getattr(kind, "__name__", str(kind))
            of = f" (part of {n.meta['original_aten']})" if n.meta.get("original_aten") else ""
            backward = "the backward of " if n.meta.get("partitioner_tag") == "is_backward" else ""
            return f"{backward}module {path} ({kind_name}){of}; no stack trace"
    return "unknown (the FX node has no stack trace)"


@dataclass(frozen=True)
class StepOrigin:
    """What one step computes, in the user's terms."""

    aten_ops: tuple[str, ...]  # distinct aten ops of its FX nodes, in graph order
    sources: tuple[str, ...]  # distinct user source lines of those nodes (at most MAX_SOURCES)
    more_sources: int = 0  # lines left out


MAX_SOURCES = 3


def step_origins(gm: torch.fx.GraphModule, holds: dict[str, tuple[str, Layout]], steps: list[Step]) -> list[StepOrigin]:
    """Each step's aten ops and source lines; `holds` as LoweredGraph.holds (buffer -> node name)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    held = {buf: (nodes[name], layout) for buf, (name, layout) in holds.items() if name in nodes}
    step_of = step_of_nodes(steps, held)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    origins = []
    for i, step in enumerate(steps):
        region: set[torch.fx.Node] = set()
        for node in _step_nodes(step, held, nodes):
            region.update(fused_nodes(node, i, step_of, order))
        ordered = sorted(region, key=order.__getitem__)
        aten = tuple(dict.fromkeys(op_name(n.target) for n in ordered))
        lines = [line for n in ordered if (line := user_line(n))]
        if not lines and ordered:
            lines = [source_line(ordered[-1], tuple(ordered))]
        distinct = list(dict.fromkeys(lines))
        origins.append(StepOrigin(aten, tuple(distinct[:MAX_SOURCES]), max(0, len(distinct) - MAX_SOURCES)))
    return origins


def _step_nodes(step: Step, held: dict, nodes: dict[str, torch.fx.Node]) -> list[torch.fx.Node]:
    """The FX nodes whose values `step` writes: those its buffers hold, or for a buffer no node
    holds (a copy made for an extern's argument), the node lowering realized it for."""
    if not isinstance(step, KernelStep):
        return [held[b.name][0] for b in step.outputs if b.name in held]
    found = []
    for c in step.group:
        if c.name in held:
            found.append(held[c.name][0])
        elif c.name in step.stored:
            found += [nodes[o] for o in c.origins if o in nodes]
    return found


def op_name(target: object) -> str:
    name = target.__name__ if isinstance(target, types.FunctionType) else str(target)  # ember's own (linear_by_size)
    return name.removeprefix("aten.")


def user_line(node: torch.fx.Node) -> str:
    """`file:line: code` of the innermost frame of the node's stack trace; '' without one."""
    trace = node.meta.get("stack_trace")
    return _innermost_user_frame(trace) if trace else ""


# every node of one source line carries the same trace: each distinct trace is parsed once
@functools.lru_cache(maxsize=4096)
def _innermost_user_frame(trace: str) -> str:
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return ""
    # the innermost frame outside torch: `F.linear` inside nn.Linear is not the user's line
    users = [f for f in frames if not os.path.abspath(f[0]).startswith(TORCH_FOLDER)]
    path, line, _, code = (users or frames)[-1]
    return f"{path}:{line}: {code.strip()}"


def profiler_labels(steps: list[Step], origins: list[StepOrigin], kernel_vars: dict[int, str]) -> dict[int, str]:
    """Each step's name under torch.profiler (Note: profiler ranges, wrapper/runtime.py): the
    kernel's name and the aten ops it fused (`ember kernel_3: gelu, mul, sum`), or the extern."""
    labels = {}
    for i, step in enumerate(steps):
        ops = list(dict.fromkeys(op.split(".")[0] for op in origins[i].aten_ops))
        listed = ", ".join(ops[:MAX_LABEL_OPS]) + (", ..." if len(ops) > MAX_LABEL_OPS else "")
        if isinstance(step, KernelStep):
            if i in kernel_vars:
                labels[i] = f"ember {kernel_vars[i]}: {listed}" if listed else f"ember {kernel_vars[i]}"
        else:
            labels[i] = f"ember {'fallback' if step.is_fallback else 'extern'} {op_name(step.op)}"
    return labels


MAX_LABEL_OPS = 8
