"""ember: a deep-learning compiler for PyTorch. `torch.compile(model, backend="ember")`.

`compile` and `ember_backend` load on first use (PEP 562), so `import ember` and the `ember`
command's `--help` and `--version` do not pay for importing torch. `metrics`, `explain` and `report` are
imported here: they share their names with submodules, which an import of the submodule
elsewhere would otherwise leave in their place.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from ember.explain import explain  # noqa: E402
from ember.metrics import metrics  # noqa: E402
from ember.report import report  # noqa: E402

__all__ = ["check_gpu_errors", "compile", "ember_backend", "explain", "metrics", "report", "__version__"]

if TYPE_CHECKING:
    from ember.frontend import compile, ember_backend
    from ember.wrapper.runtime import check_gpu_errors

_LAZY = {"compile": "ember.frontend", "ember_backend": "ember.frontend", "check_gpu_errors": "ember.wrapper.runtime"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
