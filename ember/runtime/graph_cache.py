"""The graph cache: a graph compiled before (same FX graph, input metadata, constants,
config, ember's source, versions, compiler and CPU) is loaded from disk in a new process,
skipping lowering, scheduling, codegen and gcc. An entry (`graphs/<key[:2]>/<key>.json`,
Note: cache safety) records its key and checksum and holds the wrapper's source, its
non-literal objects in plain JSON (aten ops by name: no pickles) and a summary for metrics
and `ember explain`. An entry that fails to load is discarded and rebuilt (compile_graph).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.node import _get_qualified_name

from ember.passes.mkldnn import linear_by_size
from ember.runtime.cache import CorruptEntry, content_hash, discard, entry_path, log, read_entry, write_entry


@dataclass
class GraphSummary:
    kernels: int = 0
    fusions: int = 0
    refusals: int = 0
    extern_calls: int = 0
    reduce_loops: int = 0  # C++ kernels' reduce loops (Note: shared reduce loops, codegen/shared_loops.py)
    fallback_ops: list[str] = field(default_factory=list)
    explanation: str = ""
    pass_rewrites: dict[str, int] = field(default_factory=dict)  # FX pass -> nodes rewritten (ember/passes)
    tiled_kernels: int = 0  # C++ kernels with 2-D tiles (codegen/tiling.py)
    row_kernels: int = 0  # Triton pointwise kernels planned in rows (Note: pointwise kernels in rows)
    collectives: int = 0  # collectives issued (Note: collectives in the graph, schedule/collectives.py)
    overlapped_kernels: int = 0  # ember kernels run between a collective and its wait, summed over collectives
    mutated_inputs: list[int] = field(default_factory=list)  # inputs the graph writes into (runtime/cuda_graphs.py)
    inputs_written_in_place: int = 0  # (Note: inputs written in place, lower/mutation.py)
    kernel_bytes: int = 0  # bytes the kernels read and write (ember.metrics.kernel_bytes)
    horizontal_groups: int = 0  # horizontal kernels (Note: horizontal fusion, schedule/horizontal.py)
    horizontal_parts: int = 0  # the kernels they launch together
    inplace_writes: int = 0  # kernel outputs over dying buffers (Note: in-place kernels, codegen/kernel.py)
    donated_inputs_overwritten: int = 0  # of those, over donated inputs (Note: donated inputs, donation.py)
    collectives_in_flight: int = 0  # the most collectives issued and not waited for at once
    scalar_inputs: int = 0  # 0-d CPU inputs Triton kernels take by value (Note: host scalars by value)
    # guards on sizes the compile added, as JSON trees (Note: guards a compile adds, size_guards.py)
    size_guards: list | None = field(default_factory=list)


def graph_key(gm: torch.fx.GraphModule, example_inputs: list[Any], config_key: str, identity: str) -> str:
    """`identity`: what the graph depends on besides itself and the config (cache_identity.py)."""
    inputs = [_input_description(x) for x in example_inputs]
    return content_hash(graph_text(gm.graph), repr(inputs), _symbol_ranges(example_inputs), _constants_digest(gm),
                        config_key, identity)  # fmt: skip


def graph_text(graph: torch.fx.Graph) -> str:
    """Every node of `graph` as one line: its name, kind, target and arguments (a node's argument
    spelled by the node's name), all that the graph's Python code (`gm.code`) spells. Written
    here rather than read from `gm.code`: AOTAutograd's graphs generate their Python lazily,
    and generating it for a graph of thousands of nodes costs ten times this."""
    return "\n".join(f"{n.name} {n.op} {_target_name(n.target)} {n.args!r} {n.kwargs!r}" for n in graph.nodes)


def _target_name(target: Any) -> str:
    """A call's target by its qualified name (an aten op's `torch.ops.aten.add.Tensor`), which is the
    same in every process, where a function's repr holds its address; attributes and methods by name."""
    return target if isinstance(target, str) else _get_qualified_name(target)


def _symbol_ranges(example_inputs: list[Any]) -> str:
    """The bounds of the size symbols a symbolic graph's inputs hold (Note: symbolic sizes): its
    kernels' index math is simplified with them, so they are part of what it was compiled for."""
    ranges = {}
    for x in example_inputs:
        sizes = (*x.shape, *x.stride()) if isinstance(x, torch.Tensor) else (x,)
        for s in sizes:
            if isinstance(s, torch.SymInt) and s.node.shape_env is not None:
                for symbol in s.node.expr.free_symbols:
                    ranges[str(symbol)] = str(s.node.shape_env.var_to_range.get(symbol))
    return repr(sorted(ranges.items()))


def _input_description(x: Any) -> Any:
    """What the compiled code depends on in an input: a tensor's layout, a value's repr; of an
    opaque object (DTensor's graphs pass some along untouched, lowering's OpaqueInput) only its
    type, as its repr holds an address that differs per process."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), tuple(x.stride()), str(x.dtype), str(x.device))
    if x is None or isinstance(x, (int, float, bool, str, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return repr(x)
    return f"opaque {type(x).__module__}.{type(x).__qualname__} {getattr(x, 'script_class_name', '')}"


def _constants_digest(gm: torch.fx.GraphModule) -> str:
    digest = hashlib.sha256()
    with unset_fake_temporarily():  # constants are real tensors; the compile runs under fake mode
        for name, value in sorted(graph_constants(gm).items()):
            digest.update(name.encode())
            digest.update(repr((tuple(value.shape), value.dtype)).encode())
            digest.update(value.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def graph_constants(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    constants = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(value := getattr(gm, node.target, None), torch.Tensor):
            constants[node.name] = value
    return constants


def store(cache_dir: Path, key: str, source: str, objects: list, summary: GraphSummary) -> None:
    try:
        encoded = [encode_object(o) for o in objects]
    except Unencodable as e:  # this graph is simply not cached
        log.debug("cache: graph %s not stored: %s", key[:16], e)
        return
    entry = {"source": source, "objects": encoded, "summary": asdict(summary)}
    write_entry(entry_path(cache_dir, "graphs", key, ".json"), key, entry)


def load(cache_dir: Path, key: str) -> tuple[str, list, GraphSummary] | None:
    """The entry of `key`, or None when there is none; raises when it fails its checks
    (the caller discards it: any failure while loading rebuilds the graph)."""
    entry = read_entry(entry_path(cache_dir, "graphs", key, ".json"), key)
    if entry is None:
        return None
    objects = [decode_object(o) for o in entry["objects"]]
    return entry["source"], objects, GraphSummary(**entry["summary"])


def discard_entry(cache_dir: Path, key: str, reason: BaseException) -> None:
    discard(reason, entry_path(cache_dir, "graphs", key, ".json"))


# ---- the wrapper's objects as plain JSON ----------------------------------------------------


class Unencodable(Exception):
    pass


# ember's own functions a wrapper may call in place of an aten op, by name (only these: a cache
# entry never names code to import)
WRAPPER_FUNCTIONS = {"linear_by_size": linear_by_size}


def encode_object(value: Any) -> dict:
    """A wrapper object (an op that is not an aten OpOverload literal) as JSON: by name."""
    if isinstance(value, torch._ops.OpOverload):
        encoded: dict = {"op": value._schema.name, "overload": value._overloadname}
    elif isinstance(value, torch._ops.OpOverloadPacket):
        encoded = {"op": value._qualified_op_name}
    elif isinstance(value, torch._ops.HigherOrderOperator):
        encoded = {"higher_order": value.name()}
    elif isinstance(value, complex):
        encoded = {"complex": [value.real, value.imag]}
    elif any(value is f for f in WRAPPER_FUNCTIONS.values()):
        encoded = {"function": value.__name__}
    else:
        raise Unencodable(f"no plain encoding for a {type(value).__name__}")
    decoded = decode_object(encoded)
    if decoded is not value and decoded != value:
        raise Unencodable(f"{value!r} does not come back by name")
    return encoded


def decode_object(encoded: dict) -> Any:
    if "function" in encoded:
        if encoded["function"] not in WRAPPER_FUNCTIONS:
            raise CorruptEntry(f"unknown wrapper function {encoded['function']!r}")
        return WRAPPER_FUNCTIONS[encoded["function"]]
    if "complex" in encoded:
        real, imag = encoded["complex"]
        return complex(real, imag)
    if "higher_order" in encoded:
        return getattr(torch.ops.higher_order, encoded["higher_order"])
    if "op" in encoded:
        namespace, name = encoded["op"].split("::")
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, encoded["overload"] or "default") if "overload" in encoded else packet
    raise CorruptEntry(f"unknown object encoding {encoded!r}")
