"""Stage `renderer` (GPU): a kernel AST and its block plan -> one Triton module (the prelude, then
one @triton.jit function per variant the plan names: pointwise, or persistent and looped; Note:
blocks for a kernel AST, renderer/triton.py). Scan kernels render with renderer/triton_scan.py.
"""

from __future__ import annotations

from ember.codegen.blocks import BlockPlan
from ember.renderer.common import RenderedKernel, kernel_errors, kernel_params
from ember.renderer.triton import _Renderer, tl_type
from ember.renderer.triton_prelude import PRELUDE
from ember.renderer.triton_scan import ScanRenderer


def render_triton(name: str, sink, plan: BlockPlan, written: frozenset[str], scalars: frozenset[str] = frozenset()
                  ) -> RenderedKernel:  # fmt: skip
    """`sink` is the kernel AST after `codegen/phases.block_rewrite`, `plan` what codegen/blocks.py
    decided for it. `scalars`: one-element int64 buffers (the random seed and offsets) the kernel takes by
    value rather than as a pointer: no device buffer to fill per call. Typed int64 and never
    specialized, so every value runs one compiled kernel."""
    renderer: type[_Renderer] = ScanRenderer if plan.shape.scans else _Renderer
    params = kernel_params(sink.toposort, written)
    for _, dtype, _ in params:
        tl_type(dtype)
    errors = kernel_errors(sink.toposort)
    names = [f"{p}: tl.int64" if p in scalars else p for p, _, _ in params]
    signature = ", ".join(names + (["ember_error"] if errors else []))
    by_value = sorted(scalars & {p for p, _, _ in params})
    jit = f"@triton.jit(do_not_specialize={by_value!r})" if by_value else "@triton.jit"
    functions = []
    for variant in plan.variants:
        lines = renderer(sink, plan.shape, errors, variant == "persistent", plan.index_bits, scalars).render()
        blocks = "XBLOCK: tl.constexpr" + ("" if plan.shape.pointwise else ", RBLOCK: tl.constexpr")
        head = f"{jit}\ndef {name}_{variant}({signature}, {blocks}):\n"
        functions.append(head + "\n".join(lines) + "\n")
    source = PRELUDE + renderer.prelude + "\n\n" + "\n\n".join(functions)
    return RenderedKernel(name, source, params, errors, launch=plan.launch)
