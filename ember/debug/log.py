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
import sys
import threading
from pathlib import Path

from ember.ir import ComputedBuffer, IndexedStore, LoweredGraph

# Owned by this module: the next dump's number; compiles on several threads each take their own.
_dump_numbers = itertools.count()
_dump_numbers_lock = threading.Lock()


class DebugDump:
    def __init__(self, enabled: bool, root: str, graph_key: str, role: str = "graph"):
        self.enabled = enabled
        self.folder = Path(root) / f"{role}_{graph_key[:8]}"
        if enabled:
            with _dump_numbers_lock:
                number = next(_dump_numbers)
            self.folder = Path(root) / f"{number:03d}_{role}_{graph_key[:8]}"
            (self.folder / "kernels").mkdir(parents=True, exist_ok=True)
            print(f"ember: debug dump of this graph in {self.folder.resolve()}", file=sys.stderr)

    def write(self, name: str, text: str) -> None:
        if self.enabled:
            (self.folder / name).write_text(text)


def describe_fusion(scheduled, origins: list | None = None) -> str:
    """Each kernel with the buffers fused into it, the aten ops it computes and the user's
    source lines they came from (`origins`: debug/provenance.py step_origins), then every
    refused fusion with its reason."""
    from ember.schedule import KernelStep

    lines = []
    for i, step in enumerate(scheduled.steps):
        if isinstance(step, KernelStep):
            members = ", ".join(c.name + ("" if c.name in step.stored else " (kernel-local)") for c in step.group)
            lines.append(f"step {i}: kernel [{members}]")
        else:
            lines.append(f"step {i}: {'fallback' if step.is_fallback else 'extern'} {step.op}")
        if origins is not None and origins[i].aten_ops:
            lines.append(f"    aten: {', '.join(origins[i].aten_ops)}")
            lines += [f"    from {source}" for source in origins[i].sources]
            if origins[i].more_sources:
                lines.append(f"    ... and {origins[i].more_sources} more source lines")
    lines += ["", f"{scheduled.fusions} fusions; refused:"] + [f"  {r}" for r in scheduled.refusals]
    return "\n".join(lines) + "\n"


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
