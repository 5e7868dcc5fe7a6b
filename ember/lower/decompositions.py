"""ember's decomposition table: composite aten ops rewritten into ops ember lowers.

It starts from torch's core-aten decompositions (what AOTAutograd would use for an
export-style graph) and removes the ops ember lowers directly, because a direct lowering
produces fewer, simpler UOps than the decomposition.
"""

from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions

aten = torch.ops.aten

LOWERED_DIRECTLY = [aten.gelu, aten.hardtanh]


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    for packet in LOWERED_DIRECTLY:
        for overload in packet.overloads():
            table.pop(getattr(packet, overload), None)
    return table
