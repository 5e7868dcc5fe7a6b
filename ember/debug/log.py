"""EMBER_DEBUG=1: each compiled graph's stages, dumped into a folder a user can read.

<debug_dir>/<NNN>_<role>_<hash>/fx_graph.txt   the aten graph ember received

NNN numbers the graphs of this process in the order they compiled; role is forward, backward
or inference (AOTAutograd's compiler that handed it over), so a training step's dumps read
`000_forward_1a2b3c4d`, `001_backward_5e6f7a8b`.
                               fx_graph_after_passes.txt  the same after ember/passes (what lowering sees)
                         ir.txt           buffers, their UOp bodies, extern calls
                         kernels/*.cpp    each kernel's source
                         wrapper.py       the generated wrapper
                         timings.txt      seconds per stage
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
from pathlib import Path

import torch._logging

from ember.ir import ComputedBuffer, IndexedStore, LoweredGraph

# Owned by this module: the next dump's number; compiles on several threads each take their own.
_dump_numbers = itertools.count()
_dump_numbers_lock = threading.Lock()


# TORCH_LOGS=output_code shows ember's generated code too (each kernel's source and each
# wrapper, as inductor's are shown). torch's handlers for TORCH_LOGS sit on its own "torch"
# logger, so the artifact logger is named under it: that is the only route TORCH_LOGS offers.
output_code_log = torch._logging.getArtifactLogger("torch.ember", "output_code")
CODE_FILES = ("kernels/", "wrapper.py")


class DebugDump:
    def __init__(self, enabled: bool, root: str, graph_key: str, role: str = "graph"):
        self.enabled = enabled
        self.captured: dict[str, str] | None = None  # set to a dict to keep what is written (ember report)
        self.log_code = output_code_log.isEnabledFor(logging.DEBUG)
        self.label = f"{role} graph {graph_key[:8]}"
        self.folder = Path(root) / f"{role}_{graph_key[:8]}"
        if enabled:
            with _dump_numbers_lock:
                number = next(_dump_numbers)
            self.folder = Path(root) / f"{number:03d}_{role}_{graph_key[:8]}"
            (self.folder / "kernels").mkdir(parents=True, exist_ok=True)
            print(f"ember: debug dump of this graph in {self.folder.resolve()}", file=sys.stderr)

    def wants(self, name: str) -> bool:
        """Whether `write(name, ...)` keeps the text anywhere: a caller skips making a costly one."""
        return self.enabled or self.captured is not None or (self.log_code and name.startswith(CODE_FILES))

    def write(self, name: str, text: str) -> None:
        if self.captured is not None:
            self.captured[name] = text
        if self.enabled:
            (self.folder / name).write_text(text)
        if self.log_code and name.startswith(CODE_FILES):
            output_code_log.debug("ember output code, %s, %s:\n%s", self.label, name, text)


def describe_fusion(scheduled, origins: list | None = None) -> str:
    """Each kernel with the buffers fused into it, the aten ops it computes and the user's
    source lines they came from (`origins`: debug/provenance.py step_origins), then every
    refused fusion with its reason."""
    from ember.schedule import KernelStep

    lines = []
    overlaps = {o.start: o for o in scheduled.overlaps}
    waits = {o.wait: o for o in scheduled.overlaps if o.wait is not None}
    for i, step in enumerate(scheduled.steps):
        if isinstance(step, KernelStep) and step.parts:  # Note: horizontal fusion (schedule/horizontal.py)
            parts = " | ".join(_members(part) for part in step.parts)
            lines.append(f"step {i}: horizontal kernel of {len(step.parts)} parts [{parts}]")
        elif isinstance(step, KernelStep):
            lines.append(f"step {i}: kernel [{_members(step)}]")
        elif i in overlaps:
            lines.append(f"step {i}: collective {step.op}, {describe_overlap(overlaps[i])}")
        elif i in waits:
            lines.append(f"step {i}: wait for the collective of step {waits[i].start}")
        else:
            lines.append(f"step {i}: {'fallback' if step.is_fallback else 'extern'} {step.op}")
        if origins is not None and origins[i].aten_ops:
            lines.append(f"    aten: {', '.join(origins[i].aten_ops)}")
            lines += [f"    from {source}" for source in origins[i].sources]
            if origins[i].more_sources:
                lines.append(f"    ... and {origins[i].more_sources} more source lines")
    lines += ["", f"{scheduled.fusions} fusions; refused:"] + [f"  {r}" for r in scheduled.refusals]
    return "\n".join(lines) + "\n"


def _members(step) -> str:
    return ", ".join(c.name + ("" if c.name in step.stored else " (kernel-local)") for c in step.group)


def describe_overlap(overlap) -> str:
    """What runs while a collective is in flight (Note: collectives in the graph, schedule/collectives.py)."""
    if overlap.wait is None:
        return "not waited for in this graph"
    return f"waited at step {overlap.wait}; overlapped with {overlap.kernels} kernels and {overlap.externs} externs"


def describe_ir(graph: LoweredGraph) -> str:
    lines = [f"inputs: {', '.join(f'{b.name} {b.dtype.name}{list(b.layout.size)}' for b in graph.inputs)}", ""]
    for step in graph.steps:
        if isinstance(step, ComputedBuffer):
            b = step.buffer
            lines.append(f"{b.name} = computed {b.dtype.name}{list(b.layout.size)} stride {b.layout.stride}")
            lines.append(f"    body: {step.body}")
        elif isinstance(step, IndexedStore):
            how = "=" if step.combine is None else f"{step.combine.name}="
            lines.append(f"{step.name}[index] {how} value, for each position of {list(step.shape)}")
            lines.append(f"    index: {step.index}\n    value: {step.value}")
        else:
            kind = "fallback" if step.is_fallback else "extern"
            lines.append(f"{', '.join(o.name for o in step.outputs)} = {kind} {step.op} ({step.origin})")
    lines.append("")
    lines.append(f"outputs: {[o.ref.name if o.ref else o.constant for o in graph.outputs]}")
    return "\n".join(lines) + "\n"
