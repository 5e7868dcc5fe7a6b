"""Stage `renderer` (GPU): a kernel AST -> one Triton module (the prelude, then one @triton.jit
function per variant: pointwise, or persistent and looped; Note: blocks for a kernel AST,
renderer/triton.py). Scan kernels render with renderer/triton_scan.py.
"""

from __future__ import annotations

from ember.renderer.common import RenderedKernel, kernel_errors, kernel_params
from ember.renderer.triton import _Renderer, index_bits, kernel_shape, tl_type
from ember.renderer.triton_prelude import PRELUDE
from ember.renderer.triton_scan import ScanRenderer, scan_kernel_shape
from ember.uop.ops import Ops, UOp


def render_triton(name: str, sink: UOp, written: frozenset[str], scalars: frozenset[str] = frozenset()
                  ) -> RenderedKernel:  # fmt: skip
    """`sink` is the kernel AST after `codegen/phases.block_rewrite`. `scalars`: one-element int64 buffers
    (the random seed) the kernel takes by value rather than as a pointer: no device buffer to
    fill per call. Typed int64 and never specialized, so every value runs one compiled kernel."""
    renderer: type[_Renderer] = _Renderer
    if any(u.op is Ops.SCAN for u in sink.toposort):
        renderer, shape = ScanRenderer, scan_kernel_shape(sink)
    else:
        shape = kernel_shape(sink)
    params = kernel_params(sink.toposort, written)
    for _, dtype, _ in params:
        tl_type(dtype)
    errors = kernel_errors(sink.toposort)
    names = [f"{p}: tl.int64" if p in scalars else p for p, _, _ in params]
    signature = ", ".join(names + (["ember_error"] if errors else []))
    by_value = sorted(scalars & {p for p, _, _ in params})
    jit = f"@triton.jit(do_not_specialize={by_value!r})" if by_value else "@triton.jit"
    bits = index_bits(sink, shape)
    if shape.pointwise:
        variants = ["pointwise"]
    else:
        variants = (["persistent"] if shape.rnumel <= renderer.persistent_limit else []) + ["looped"]
    functions = []
    for variant in variants:
        lines = renderer(sink, shape, errors, variant == "persistent", bits, scalars).render()
        blocks = "XBLOCK: tl.constexpr" + ("" if shape.pointwise else ", RBLOCK: tl.constexpr")
        head = f"{jit}\ndef {name}_{variant}({signature}, {blocks}):\n"
        functions.append(head + "\n".join(lines) + "\n")
    source = PRELUDE + renderer.prelude + "\n\n" + "\n\n".join(functions)
    launch = {"variants": variants, "xnumel": shape.xnumel, "rnumel": shape.rnumel}
    if shape.xextent > shape.xnumel:  # Note: nested reductions (renderer/triton.py)
        launch["xextent"] = shape.xextent
    return RenderedKernel(name, source, params, errors, launch=launch)
