"""Stage `lower`: aten FX graph -> LoweredGraph. Importing it registers every lowering."""

from ember.lower import indexing, math_functions, pointwise, pooling, reductions, views  # noqa: F401  (registration)
from ember.lower.graph import lower_graph

__all__ = ["lower_graph"]
