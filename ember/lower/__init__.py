"""Stage `lower`: aten FX graph -> LoweredGraph. Importing it registers every lowering."""

from ember.lower import indexing, pointwise, random, reductions, scans, scatter, views  # noqa: F401  (registration)
from ember.lower.graph import lower_graph

__all__ = ["lower_graph"]
