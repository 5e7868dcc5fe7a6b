"""Stage `renderer` (C++): the loops of a 2-D tiling (Note: 2-D tiles, codegen/tiling.py).

A tile loop steps its variable by the tile size; an element loop runs from its tile loop's
variable to the end of that tile or of the dim, whichever comes first, so the tiles at the
edges are partial and every size is handled. The end is a constant computed before the loop,
so `omp simd` and `parallel for` see loops in OpenMP's canonical form.
"""

from __future__ import annotations

from ember.codegen.tiling import is_element_loop, is_tile_loop
from ember.renderer.common import size_expression
from ember.uop.ops import UOp


def loop_lines(loop: UOp, tile: int = 0) -> tuple[list[str], str]:
    """(lines before the loop's pragma, its `for` line) for any RANGE; `tile` overrides the
    tile size the codegen chose (KernelChoices.tile)."""
    var, size = loop.arg.name, size_expression(loop.src[0])  # a constant, or symbolic (Note: symbolic sizes)
    if is_tile_loop(loop):
        return [], f"for (int64_t {var} = 0; {var} < {size}; {var} += {tile or loop.arg.tile}) {{"
    if is_element_loop(loop):
        start, step = loop.src[1].arg.name, tile or loop.src[1].arg.tile
        end = f"{var}_end"
        declaration = f"const int64_t {end} = {start} + {step} < {size} ? {start} + {step} : {size};"
        return [declaration], f"for (int64_t {var} = {start}; {var} < {end}; {var}++) {{"
    return [], f"for (int64_t {var} = 0; {var} < {size}; {var}++) {{"
