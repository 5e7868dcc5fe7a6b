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
from torch.utils._pytree import tree_flatten

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


# Note: gloo runs collectives one at a time
#     torch's gloo backend (ProcessGroupGloo) runs each collective on one of its worker threads,
#     two by default (`init_process_group` gives gloo no options). Each thread, after a collective,
#     records its op's name in the group's status (`pgStatus_->lastCompletedWorkName` in
#     `ProcessGroupGloo::runLoop`) without holding the group's lock. When two collectives finish
#     together, both threads assign that one `std::string`: names longer than libstdc++'s 15-byte
#     inline buffer live on the heap, so both threads free the same old buffer. In torch 2.13 an
#     all-gather on gloo (`_allgather_base`) runs as ALLGATHER_COALESCED, a 19-character name, so
#     two FSDP all-gathers in flight can corrupt the heap: "malloc(): unaligned tcache chunk
#     detected", or under AddressSanitizer "attempting double-free" of a 20-byte string allocated
#     and freed on one gloo worker thread and freed again on the other, in 4 of 52 runs of
#     `benchmarks.distributed --device cpu --tiny --fsdp simple` with up to 9 collectives in flight.
#     So a graph whose collectives go to a gloo group with more than one worker thread issues them
#     one at a time: `config.collectives_in_flight` is 1 for it, whatever it was set to, and the
#     collectives are placed for overlap even where `config.collective_overlap` is off (the traced
#     order may hold several in flight). A collective still runs beside the kernels that do not
#     need it. What is left is a window of a few instructions: a thread records the name after
#     its collective's wait returns, so the next collective would have to be issued, run and
#     finished on the other thread while the first is descheduled in those instructions.
#     Collectives a graph does not wait for itself, and collectives issued outside ember's graphs,
#     are not bounded here.


def groups_run_one_at_a_time(gm: torch.fx.GraphModule) -> dict[str, int]:
    """The process groups of `gm`'s collectives that run them on gloo with several worker threads,
    with that number of threads (Note: gloo runs collectives one at a time)."""
    found: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or communication_of(node.target) is not Communication.START:
            continue
        group, device = _group_name(node), _device(node)
        if group is None or device is None or group in found:
            continue
        threads = _gloo_threads(group, device)
        if threads > 1:
            found[group] = threads
    return found


def _group_name(node: torch.fx.Node) -> str | None:
    for position, argument in enumerate(node.target._schema.arguments):
        if argument.name == "group_name":
            value = node.kwargs.get("group_name", node.args[position] if position < len(node.args) else None)
            return value if isinstance(value, str) else None
    return None


def _device(node: torch.fx.Node) -> torch.device | None:
    values, _ = tree_flatten(node.meta.get("val"))
    return next((v.device for v in values if isinstance(v, torch.Tensor)), None)


def _gloo_threads(group: str, device: torch.device) -> int:
    """Worker threads of the gloo backend serving `device` in `group`; 0 for another backend, or
    for a group this process cannot resolve (a graph traced without a process group)."""
    gloo = getattr(torch.distributed, "ProcessGroupGloo", None)
    if gloo is None:
        return 0
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        backend = _resolve_process_group(group)._get_backend(device)
    except Exception:  # no such group here, or none of its backends serves this device
        return 0
    if not isinstance(backend, gloo):
        return 0
    return int(getattr(getattr(backend, "options", None), "_threads", 2))
