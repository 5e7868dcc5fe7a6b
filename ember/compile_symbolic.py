"""A graph with symbolic sizes compiled once for every shape (Note: symbolic sizes, uop/variables.py).

Takes the aten graph torch.compile gives with SymInt sizes and its example inputs; gives a
callable that serves every shape the graph's guards admit. The graph goes through
`compile_graph` like any other, with the sizes left symbolic, while the shape environment
admits only guards that dynamo will check and that do not fix a size (Note: guards a compile
adds, size_guards.py): any stage that needs a concrete size raises there. A graph that cannot be
compiled so (a stage or an op that needs a concrete size, CUDA graphs, a data-dependent size)
is compiled per concrete shape instead (shape_specialization.py); the reason is counted in
`metrics.symbolic_fallbacks`, logged, and under EMBER_DEBUG written to symbolic_fallbacks.txt.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ember.compile_graph import compile_graph
from ember.config import Config
from ember.debug.progress import logger
from ember.metrics import metrics
from ember.size_guards import REFUSED, guarding


def compile_symbolic(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config, role: str) -> Callable | str:
    """The graph compiled once with symbolic sizes, or the reason it cannot be. A forward or an
    inference graph may add guards that dynamo then checks (Note: guards a compile adds)."""
    refusal = _refusal(example_inputs, config)
    if refusal is not None:
        return refusal
    shape_env = _shape_env(example_inputs)
    try:
        with guarding(shape_env, admit=role in ("forward", "inference")) as guards:
            call = compile_graph(gm, example_inputs, config, role, guards)
    except Exception as e:  # noqa: BLE001 - any failure means the per-shape path compiles it, correctly
        logger.debug("symbolic compile failed", exc_info=True)
        return _reason(e)
    metrics.add(symbolic_graphs=1)
    if guards.admitted:
        metrics.tally("size_guards", {str(g): 1 for g in guards.admitted})
    return call


def record_fallback(reason: str, role: str, config: Config) -> None:
    """Counted in metrics, logged, and under EMBER_DEBUG appended to symbolic_fallbacks.txt in the debug folder."""
    metrics.tally("symbolic_fallbacks", {reason: 1})
    logger.info("%s graph with dynamic shapes is compiled per shape: %s", role, reason)
    if config.debug:
        folder = Path(config.debug_dir)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "symbolic_fallbacks.txt", "a") as f:
            f.write(f"{role} graph compiled per shape: {reason}\n")


def _refusal(example_inputs: list[Any], config: Config) -> str | None:
    if not config.symbolic_shapes:
        return "symbolic_shapes is off"
    if config.cuda_graphs and any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs):
        return "CUDA graphs replay static sizes"
    if _shape_env(example_inputs) is None:
        return "no shape environment"
    if config.verify:
        return "verify compares static layouts"
    return None


def _shape_env(example_inputs: list[Any]) -> Any:
    for x in example_inputs:
        sizes = (*x.shape, *x.stride()) if isinstance(x, torch.Tensor) else (x,)
        for s in sizes:
            if isinstance(s, torch.SymInt) and s.node.shape_env is not None:
                return s.node.shape_env
    return None


def _reason(error: Exception) -> str:
    """A short, stable description of why a symbolic compile failed (a metrics key)."""
    text = str(error)
    if REFUSED in text:
        guard = re.search(r"frozen: (.*?)(?: == (?:True|False))?$", text.splitlines()[0])
        return f"needs a concrete size: {guard.group(1) if guard else text.splitlines()[0]}"
    first = text.splitlines()[0] if text else type(error).__name__
    return first[:200]
