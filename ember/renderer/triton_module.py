"""Stage `renderer` (GPU): the linearized block programs of one kernel -> one Triton module (the
prelude, then one @triton.jit function per variant the plan names: pointwise, or persistent and
looped; Note: blocks for a kernel AST, codegen/blocks.py).
"""

from __future__ import annotations

from ember.codegen.blocks import BlockPlan
from ember.renderer.common import RenderedKernel, kernel_errors, kernel_params, kernel_variables
from ember.renderer.triton import render_body, tl_type
from ember.renderer.triton_prelude import LOOP_BOUND_PRELUDE, PRELUDE
from ember.renderer.triton_scan import SCAN_PRELUDE
from ember.schedule.host_scalars import scalar_carrier
from ember.uop.ops import Ops, UOp


def render_triton(name: str, programs: dict[str, list[UOp]], plan: BlockPlan, written: frozenset[str],
                  scalars: frozenset[str] = frozenset()) -> RenderedKernel:  # fmt: skip
    """`programs`: each variant of `plan` (codegen/blocks.py) lowered to blocks and linearized
    (codegen/block_lowering.py). `scalars`: one-element buffers the kernel takes by value rather
    than as a pointer (the random seed and offsets, int64; 0-d CPU inputs, Note: host scalars by
    value): no device buffer to fill per call. The size variables it reads (Note: symbolic
    blocks, codegen/blocks.py) come after the buffers, typed int64. None is specialized, so every
    value runs one compiled kernel."""
    every = [u for program in programs.values() for u in program]
    params = kernel_params(every, written)
    for _, dtype, _ in params:
        tl_type(dtype)
    errors = kernel_errors(every)
    variables = kernel_variables(every)
    names = parameter_names(params, scalars) + [f"{v}: tl.int64" for v in variables]
    signature = ", ".join(names + (["ember_error"] if errors else []))
    by_value = sorted(scalars & {p for p, _, _ in params}) + list(variables)
    jit = f"@triton.jit(do_not_specialize={by_value!r})" if by_value else "@triton.jit"
    blocks = "XBLOCK: tl.constexpr" + ("" if plan.shape.pointwise else ", RBLOCK: tl.constexpr")
    functions = []
    for variant, program in programs.items():
        # Note: symbolic blocks: under a size cap, 32-bit index math with the sizes narrowed on
        # entry, and the same program with 64-bit index math for calls past the cap
        widths = [(variant, plan.index_bits)] + ([(f"{variant}_wide", 64)] if plan.size_cap else [])
        for function, bits in widths:
            narrowed = [f"    {v} = {v}.to(tl.int32)" for v in variables] if plan.size_cap and bits == 32 else []
            lines = narrowed + render_body(program, errors, bits, scalars)
            functions.append(f"{jit}\ndef {name}_{function}({signature}, {blocks}):\n" + "\n".join(lines) + "\n")
    scans = any(u.op is Ops.BLOCK_SCAN for u in every)
    symbolic_loops = any(u.op is Ops.RANGE and u.src[0].op is not Ops.CONST for u in every)
    preludes = PRELUDE + (SCAN_PRELUDE if scans else "") + (LOOP_BOUND_PRELUDE if symbolic_loops else "")
    source = preludes + "\n\n" + "\n\n".join(functions)
    launch = {**plan.launch, "arguments": argument_kinds(params, scalars, errors, variables)}
    if variables:
        launch |= {"variables": list(variables), "variables_at": len(params)}
    return RenderedKernel(name, source, params, errors, launch=launch, variables=variables)


def parameter_names(params: list, scalars: frozenset[str]) -> list[str]:
    """The buffers' parameters of a jit function: a pointer, or a value typed by its dtype."""
    return [f"{p}: {tl_type(scalar_carrier(dtype))}" if p in scalars else p for p, dtype, _ in params]


def argument_kinds(params: list, scalars: frozenset[str], errors: list, variables: tuple[str, ...] = ()) -> list[str]:
    """What each argument of a call is, for the compile ahead of it (Note: ember owns the Triton
    compile, runtime/triton_compile.py): `*<dtype>` a pointer to a buffer, `<dtype>` a value (a
    seed or offset, a size variable: int64; a 0-d CPU input, a float as its bits), and last the
    error flags, a pointer to int64 (Note: kernel errors on the GPU)."""
    kinds = [scalar_carrier(dtype).name if p in scalars else f"*{dtype.name}" for p, dtype, _ in params]
    kinds += ["int64"] * len(variables)
    return kinds + (["*int64"] if errors else [])
