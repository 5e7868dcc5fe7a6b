"""The GPU path of compile_graph: codegen, render and load each kernel as Triton.

compile_graph picks the backend per graph from its inputs' device (`graph_backend`):
CUDA inputs go to Triton; CPU inputs to C++, unless `config.backend == "triton"`, which
runs the Triton renderer on CPU tensors under Triton's interpreter (how CI tests it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ember
from ember.codegen.kernel import build_kernel_ast
from ember.codegen.phases import block_rewrite
from ember.config import Config
from ember.errors import EmberError
from ember.lower.random import SEED_BUFFER
from ember.metrics import metrics
from ember.renderer.triton import TritonKernel, render_triton
from ember.runtime.triton import write_module
from ember.schedule import KernelStep
from ember.wrapper.python import KernelBinary


def graph_device(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> torch.device:
    """The device a graph computes on: its first CUDA input's (a CPU 0-d tensor may come along,
    as eager allows), else its first tensor input's, else any node's, else the CPU."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    for x in sorted(tensors, key=lambda t: t.device.type != "cuda"):
        return x.device
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def graph_backend(device: torch.device, config: Config) -> str:
    """ "triton" or "cpp" (Note: the module docstring)."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        return "triton" if config.backend == "triton" else "cpp"
    raise EmberError("lower", f"ember compiles for CPU and CUDA, not for device {device}")


def codegen_triton_kernel(step: KernelStep, check_ir: bool = False) -> tuple[TritonKernel, tuple[str, ...]]:
    """One kernel: AST, block rewrite phases, render. Names the op when it fails."""
    try:
        ast = build_kernel_ast(step.group, step.stored)
        sink = block_rewrite(ast.sink, check_ir)
        name = f"triton_{sink.key[:16]}"
        scalars = frozenset(f"p{i}" for i, buffer in enumerate(ast.params) if buffer == SEED_BUFFER)
        return render_triton(name, sink, ast.outputs, scalars), ast.params
    except Exception as e:
        origins = ", ".join(o for c in step.group for o in c.origins)
        raise EmberError("codegen", f"{type(e).__name__}: {e}", origins) from e


def compile_triton_kernels(rendered: dict[int, tuple[TritonKernel, tuple[str, ...]]], config: Config,
                           interpret: bool) -> dict[int, KernelBinary]:  # fmt: skip
    """Writes each module into the cache; Triton compiles on first launch (runtime/triton.py)."""
    binaries = {}
    for i, (kernel, params) in rendered.items():
        path, cached = write_module(kernel.source, Path(config.cache_dir), interpret, ember.__version__)
        metrics.code_cache_hits += cached
        metrics.code_cache_misses += not cached
        errors = tuple((e.error, e.message) for e in kernel.errors)
        written = [j for j, (_, _, w) in enumerate(kernel.params) if w]
        launch = {"variants": kernel.variants, "xnumel": kernel.xnumel, "rnumel": kernel.rnumel,
                  "written": written, "interpret": interpret, "autotune": config.autotune}  # fmt: skip
        if kernel.xextent > kernel.xnumel:  # Note: nested reductions (renderer/triton.py)
            launch["xextent"] = kernel.xextent
        binaries[i] = KernelBinary(kernel.name, str(path), kernel.name, params, errors, triton=launch)
    return binaries
