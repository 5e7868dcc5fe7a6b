"""ember: a deep-learning compiler for PyTorch. `torch.compile(model, backend="ember")`."""

__version__ = "0.1.0"

from ember.explain import explain  # noqa: E402
from ember.frontend import compile, ember_backend  # noqa: E402
from ember.metrics import metrics  # noqa: E402

__all__ = ["compile", "ember_backend", "explain", "metrics", "__version__"]
