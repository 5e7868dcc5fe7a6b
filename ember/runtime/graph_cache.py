"""The graph cache: a graph compiled before (same FX code, input metadata, constants,
config and versions) is loaded from disk in a new process, skipping lowering, scheduling,
codegen and gcc. An entry is the wrapper's source, its non-literal objects and a summary
for metrics and `ember explain`; written atomically (Note: cache safety), and an entry
that fails to load (corrupt, or a kernel file removed) is deleted and rebuilt.
"""

from __future__ import annotations

import base64
import hashlib
import json
import pickle
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ember.runtime.cache import content_hash, entry_path, write_atomic


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


def graph_key(gm: torch.fx.GraphModule, example_inputs: list[Any], config_key: str, versions: str) -> str:
    inputs = [
        (tuple(x.shape), tuple(x.stride()), str(x.dtype), str(x.device)) if isinstance(x, torch.Tensor) else repr(x)
        for x in example_inputs
    ]
    return content_hash(gm.code, repr(inputs), _constants_digest(gm), config_key, versions, torch.__version__)


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
        packed = base64.b64encode(pickle.dumps(objects)).decode()
    except Exception:  # an object with no pickle: this graph is simply not cached
        return
    entry = {"source": source, "objects": packed, "summary": asdict(summary)}
    write_atomic(entry_path(cache_dir, "graphs", key, ".json"), json.dumps(entry))


def load(cache_dir: Path, key: str) -> tuple[str, list, GraphSummary] | None:
    path = entry_path(cache_dir, "graphs", key, ".json")
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text())
        objects = pickle.loads(base64.b64decode(entry["objects"]))
        return entry["source"], objects, GraphSummary(**entry["summary"])
    except Exception:
        discard(cache_dir, key)
        return None


def discard(cache_dir: Path, key: str) -> None:
    entry_path(cache_dir, "graphs", key, ".json").unlink(missing_ok=True)
