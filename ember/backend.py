"""What compile_graph asks of a backend: one object per kind of generated code (C++ or Triton).

Note: backends
    Lowering, scheduling, the shared codegen steps (codegen/phases.py), the IR spec and the
    wrapper are one code path. A backend is what differs, declared in one object in the spirit
    of tinygrad's Renderer, so compile_graph never branches on a backend's name:
      - `capabilities`, the facts lowering and codegen may use: the ops its renderer cannot
        spell (a call that would need one goes to aten, in one place: lower/graph.py), whether
        its reductions walk elements in eager's CPU order (so order-dependent results, var_mean's
        mean of infinities, can be matched) and, for a block backend, what a block can hold
        (codegen/blocks.py decides block variants and index width from it);
      - `prepare`: rewrites of the lowered graph before scheduling (Triton: split reductions);
      - `generate`: each kernel step through its codegen steps, renderer and compiler, giving
        the wrapper's KernelBinary per step (which carries how the wrapper launches it).
    The two instances are compile_cpp.CppBackend and compile_triton.TritonBackend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ember.codegen.blocks import BlockLimits
from ember.config import Config
from ember.debug.log import DebugDump
from ember.ir import LoweredGraph
from ember.schedule import KernelStep
from ember.uop.ops import Ops


@dataclass(frozen=True)
class Capabilities:
    """What lowering may assume about the backend a graph's kernels go to (Note: backends)."""

    unrenderable: frozenset[Ops] = frozenset()  # ops its renderer has no spelling for: calls go to aten
    ordered_reductions: bool = True  # reductions fold elements in order, as eager's CPU kernels
    blocks: BlockLimits | None = None  # a block backend's limits (codegen/blocks.py decides from them); None: loops


@dataclass
class GeneratedKernels:
    """Every kernel of a graph, generated and compiled: the wrapper's binaries by step index."""

    binaries: dict = field(default_factory=dict)  # step index -> wrapper.python.KernelBinary
    kernels: int = 0
    reduce_loops: int = 0  # reduce loops the programs open (ember.metrics.reduce_loops)
    tiled_kernels: int = 0  # kernels with 2-D tiles (C++; ember.metrics.tiled_kernels)
    row_kernels: int = 0  # pointwise kernels planned in rows (Triton; ember.metrics.row_kernels)


class Backend(Protocol):
    name: str  # "cpp" | "triton": in debug dumps and error messages only
    source_suffix: str  # of its kernels' source files in the debug dump
    capabilities: Capabilities

    def prepare(self, graph: LoweredGraph, lowering, config: Config) -> None:
        """Rewrite the lowered graph before scheduling (in place)."""
        ...

    def generate(self, graph: LoweredGraph, steps: list, config: Config, debug: DebugDump,
                 timings: dict[str, float]) -> GeneratedKernels:  # fmt: skip
        """Codegen, render and compile every kernel step; time them as `codegen` and `runtime`."""
        ...


def has_work(step) -> bool:
    """A kernel over empty buffers has nothing to do: the wrapper only allocates them. A symbolic
    size may be 0 at run time: its loops then run no iteration (Note: symbolic sizes)."""
    return isinstance(step, KernelStep) and any(_may_be_nonempty(c.buffer.layout.numel) for c in step.group)


def _may_be_nonempty(numel) -> bool:
    return numel > 0 if type(numel) is int else True
