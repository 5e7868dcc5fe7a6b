"""Stage `lower`: functional collectives (`torch.ops._c10d_functional`) as extern calls.

A collective in an aten graph (DTensor's redistributions, tensor parallelism, a user's
`torch.distributed._functional_collectives`) is two ops: the collective itself, which issues the
communication and returns its result tensor at once, and `wait_tensor` on that result, which
returns it once the communication is done. Both run as aten externs by design (never counted as
fallbacks); lowering marks each with its part (`Communication`), and the scheduler moves them
apart so that kernels run while the data is in flight (Note: collectives in the graph,
schedule/collectives.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ember.ir import Communication
from ember.lower.registry import register_extern

NAMESPACE = "_c10d_functional"
WAIT_NAME = "wait_tensor"
# The collectives torch has defined; each present in this torch is registered (a newer one is
# still recognised by its namespace, `communication_of`).
COLLECTIVE_NAMES = (
    "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
    "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced",
    "all_to_all_single", "broadcast", "broadcast_", WAIT_NAME,
)  # fmt: skip


def _packets() -> list[Any]:
    if not torch.distributed.is_available():
        return []
    namespace = getattr(torch.ops, NAMESPACE)
    return [getattr(namespace, name) for name in COLLECTIVE_NAMES if hasattr(namespace, name)]


register_extern(*_packets())


def communication_of(op: Any) -> Communication | None:
    """The part `op` plays in a collective, or None for any other op."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.name.startswith(f"{NAMESPACE}::"):
        return None
    return Communication.WAIT if schema.name == f"{NAMESPACE}::{WAIT_NAME}" else Communication.START
