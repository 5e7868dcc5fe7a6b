"""`ember.explain(fn, *args)` and `ember explain script.py`: what ember made of a program.

For each compiled graph: the kernels and the buffers fused into each, the extern and
fallback calls, and every fusion the scheduler refused with its reason.
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def explain(fn: Callable, *args, **kwargs) -> str:
    """Compile and run `fn(*args, **kwargs)` with ember; return the explanation text."""
    import torch  # here, not at module level: `import ember` stays free of torch

    from ember.frontend import compile as ember_compile

    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "explain.txt"
        torch._dynamo.reset()
        ember_compile(fn, explain_file=str(report))(*args, **kwargs)
        return report.read_text() if report.exists() else "ember compiled no graph (nothing reached the backend)\n"


def explain_script(path: str, argv: list[str]) -> str:
    """Run a script that uses ember (torch.compile(..., backend="ember")) and explain its graphs."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "explain.txt"
        os.environ["EMBER_EXPLAIN_FILE"] = str(report)
        old_argv = sys.argv
        sys.argv = [path, *argv]
        try:
            runpy.run_path(path, run_name="__main__")
        finally:
            sys.argv = old_argv
            os.environ.pop("EMBER_EXPLAIN_FILE", None)
        return report.read_text() if report.exists() else "the script compiled no graph with ember\n"
