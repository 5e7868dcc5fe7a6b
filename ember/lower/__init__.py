"""Stage `lower`: aten FX graph -> LoweredGraph. Importing it registers every lowering."""

from ember.lower import (  # noqa: F401  (registration)
    collectives,
    indexing,
    math_functions,
    mutation,
    pointwise,
    pooling,
    random,
    reductions,
    scans,
    scatter,
    views,
)
from ember.lower.graph import lower_graph

__all__ = ["lower_graph"]
