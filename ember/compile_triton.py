"""The Triton backend (Note: backends, backend.py): each kernel through the shared codegen steps
(codegen/phases.block_rewrite: REDUCE and SCAN stay, for block reductions), a block plan
(codegen/blocks.py: from the limits the backend declares), block lowering of each variant
(codegen/block_lowering.py), the shared linearizer, renderer/triton.py, and a module in the cache
whose launch configurations the compile pool compiles when the wrapper loads it.

compile_graph picks the backend per graph from its inputs' device (`backend_for`): CUDA inputs
go to Triton; CPU inputs to C++, unless `config.backend == "triton"`, which runs Triton
kernels on CPU tensors under Triton's interpreter (how CI tests it).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import ember
from ember.backend import Capabilities, GeneratedKernels, has_work
from ember.codegen.blocks import BlockLimits, BlockPlan, plan_blocks
from ember.codegen.horizontal import build_horizontal_ast
from ember.codegen.kernel import build_kernel_ast
from ember.codegen.linearize import linearize
from ember.codegen.phases import block_lowering, block_rewrite, number_ranges
from ember.codegen.shared_loops import reduce_loop_count
from ember.config import Config
from ember.debug.log import DebugDump
from ember.errors import EmberError, stage
from ember.ir import LoweredGraph
from ember.lower.random import SEED_BUFFER, is_scalar_argument
from ember.lower.split_reductions import SplitPolicy, split_reductions
from ember.metrics import metrics
from ember.renderer.common import RenderedKernel, kernel_params
from ember.renderer.triton_horizontal import HorizontalPart, render_triton_horizontal
from ember.renderer.triton_math import UNRENDERABLE
from ember.renderer.triton_module import render_triton
from ember.runtime.cache import content_hash
from ember.runtime.triton import write_module
from ember.runtime.triton_pool import compile_pool
from ember.schedule import KernelStep, dying_buffers
from ember.uop.ops import UOp
from ember.wrapper.python import KernelBinary


class TritonBackend:
    """Triton kernels over blocks, on the GPU or (CPU tensors) under Triton's interpreter."""

    name = "triton"
    source_suffix = "py"
    # block reductions combine in a tree, not in eager's CPU order
    capabilities = Capabilities(unrenderable=UNRENDERABLE, ordered_reductions=False, blocks=BlockLimits())

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def prepare(self, graph: LoweredGraph, lowering, config: Config) -> None:
        """Reductions with too few outputs to fill the GPU split over many programs (Note: split
        reductions). On the GPU, the compile pool's workers start now, while the graph is
        scheduled and generated (Note: the compile pool, runtime/triton_pool.py)."""
        split_reductions(graph, lowering, SplitPolicy(config.split_reductions))
        if not self.interpret:
            compile_pool(config.compile_threads).start()

    def generate(self, graph: LoweredGraph, steps: list, config: Config, debug: DebugDump,
                 timings: dict[str, float]) -> GeneratedKernels:  # fmt: skip
        generated: dict[tuple, RenderedKernel] = {}  # Note: kernels generated once (compile_cpp.py)
        with stage("codegen", timings):
            limits = replace(self.capabilities.blocks or BlockLimits(), exp_sum_maximum=config.online_softmax,
                             native_bfloat16=not self.interpret, pointwise_rows=config.pointwise_rows)  # fmt: skip
            seed_in_memory = config.cuda_graphs and not self.interpret  # Note: random numbers in CUDA graphs
            dying = dying_buffers(graph, steps)  # a kernel may write over one (Note: in-place kernels)
            rendered = {i: codegen_triton_kernel(s, limits, config.check_ir, generated, seed_in_memory, dying[i],
                                                 graph.scalar_inputs)
                        for i, s in enumerate(steps) if has_work(s)}  # fmt: skip
        metrics.add(kernels_codegen=len(generated))
        with stage("runtime", timings):
            binaries = compile_triton_kernels(rendered, config, self.interpret)
        for kernel, _, _ in rendered.values():
            debug.write(f"kernels/{kernel.name}.{self.source_suffix}", kernel.source)
        kernels = [kernel for kernel, _, _ in rendered.values()]
        return GeneratedKernels(binaries, len(rendered), sum(k.reduce_loops for k in kernels),
                                row_kernels=sum(k.in_rows for k in kernels))  # fmt: skip


def codegen_triton_kernel(step: KernelStep, limits: BlockLimits, check_ir: bool = False,
                          generated: dict[tuple, RenderedKernel] | None = None, seed_in_memory: bool = False,
                          dying: dict | None = None, scalar_inputs: frozenset[str] = frozenset()
                          ) -> tuple[RenderedKernel, tuple[str, ...], dict[str, str]]:  # fmt: skip
    """One kernel: AST, block rewrite phases, block plan (codegen/blocks.py), render. Names the op
    when it fails. `generated`: the kernels already generated for this graph by AST (Note:
    kernels generated once, compile_cpp.py). `seed_in_memory`: the random seed is read from a
    one-element device buffer, not taken by value (Note: random numbers in CUDA graphs).
    `dying`: the buffers whose last use is this kernel, which it may write over (Note: in-place
    kernels, codegen/kernel.py); gives which it does. `scalar_inputs`: the graph's 0-d CPU inputs
    taken by value (Note: host scalars by value, schedule/host_scalars.py)."""
    try:
        if step.parts:  # Note: horizontal fusion (schedule/horizontal.py); its parts write in place never
            return (*codegen_triton_horizontal(step, limits, check_ir, generated, seed_in_memory, scalar_inputs), {})
        ast = build_kernel_ast(step.group, step.stored, dying, step.alignment, step.bodies)
        scalars = by_value(ast.params, seed_in_memory, scalar_inputs)
        key = (number_ranges(ast.sink), ast.outputs, scalars)
        kernel = generated.get(key) if generated is not None else None
        if kernel is None:
            sink = block_rewrite(key[0], check_ir, limits.native_bfloat16)
            plan = plan_blocks(sink, limits)
            programs = block_programs(sink, plan, check_ir)
            kernel = render_triton(f"triton_{sink.key[:16]}", programs, plan, ast.outputs, scalars)
            kernel.reduce_loops = reduce_loop_count(programs["looped"]) if "looped" in programs else 0
            kernel.in_rows = plan.in_rows
            if generated is not None:
                generated[key] = kernel
        return kernel, ast.arguments(kernel.params), ast.inplace
    except Exception as e:
        origins = ", ".join(o for c in step.group for o in c.origins)
        raise EmberError("codegen", f"{type(e).__name__}: {e}", origins) from e


def by_value(params: tuple[str, ...], seed_in_memory: bool, scalar_inputs: frozenset[str] = frozenset()
             ) -> frozenset[str]:  # fmt: skip
    """The parameters (p0, p1, ...) passed by value: the random seed and offsets, but the seed where it
    is read from device memory (Note: random numbers in CUDA graphs), and the graph's 0-d CPU
    inputs that it takes by value (Note: host scalars by value, schedule/host_scalars.py)."""
    return frozenset(f"p{i}" for i, buffer in enumerate(params)
                     if (is_scalar_argument(buffer) and not (seed_in_memory and buffer == SEED_BUFFER))
                     or buffer in scalar_inputs)  # fmt: skip


def codegen_triton_horizontal(step: KernelStep, limits: BlockLimits, check_ir: bool,
                              generated: dict[tuple, RenderedKernel] | None, seed_in_memory: bool,
                              scalar_inputs: frozenset[str] = frozenset()
                              ) -> tuple[RenderedKernel, tuple[str, ...]]:  # fmt: skip
    """A horizontal kernel: each part's pointwise block program (once per distinct part AST of the
    graph), then one function whose program ids are split among the parts (renderer/triton_horizontal.py)."""
    ast = build_horizontal_ast(step)
    scalars = by_value(ast.params, seed_in_memory, scalar_inputs)
    generated = generated if generated is not None else {}
    parts, keys = [], []
    for part, rename in zip(ast.parts, ast.renames):
        mine = frozenset(local for local, name in rename.items() if name in scalars)
        key = ("horizontal part", number_ranges(part.sink), part.outputs, mine)
        if key not in generated:
            sink = block_rewrite(key[1], check_ir, limits.native_bfloat16)
            plan = plan_blocks(sink, limits, rows=False)
            if plan.variants != ("pointwise",) or not isinstance(plan.shape.xnumel, int):
                raise ValueError(f"a part of a horizontal kernel is not pointwise over static sizes: {plan.variants}")
            generated[key] = (sink.key, block_programs(sink, plan, check_ir)["pointwise"], plan)  # type: ignore[assignment]
        sink_key, program, plan = generated[key]  # type: ignore[misc]
        parts.append(HorizontalPart(program, plan.index_bits, plan.shape.xnumel, rename, mine))
        keys.append(f"{sink_key}:{sorted(rename.items())}:{sorted(mine)}")
    params: dict[str, tuple] = {}
    for part in parts:
        params |= {part.rename[n]: (part.rename[n], d, w) for n, d, w in kernel_params(part.program, frozenset())}
    ordered = [(n, d, n in ast.outputs) for n, d, _ in sorted(params.values(), key=lambda p: int(p[0][1:]))]
    kernel = render_triton_horizontal(f"triton_h{content_hash(*keys)[:16]}", parts, ordered, scalars)
    return kernel, ast.arguments(kernel.params)


def block_programs(sink: UOp, plan: BlockPlan, check_ir: bool = False) -> dict[str, list[UOp]]:
    """Each variant of `plan`: the kernel lowered to blocks (Note: block lowering), checked
    against the spec's block stage when `check_ir`, linearized."""
    return {variant: linearize(block_lowering(sink, plan, variant, check_ir)) for variant in plan.variants}


def compile_triton_kernels(rendered: dict[int, tuple[RenderedKernel, tuple[str, ...], dict[str, str]]],
                           config: Config, interpret: bool) -> dict[int, KernelBinary]:  # fmt: skip
    """Writes each module into the cache; its launch configurations compile when the wrapper loads
    it, in the compile pool (runtime/triton.py `TritonLauncher.precompile`). A kernel that writes
    over an input is tuned on a copy of it, as of every buffer it writes (`benchmark`)."""
    binaries = {}
    for i, (kernel, params, inplace) in rendered.items():
        path, sha256, cached = write_module(kernel.source, Path(config.cache_dir), interpret, ember.__version__)
        metrics.add(code_cache_hits=cached, code_cache_misses=not cached)
        errors = tuple((e.error, e.message) for e in kernel.errors)
        written = [j for j, (_, _, w) in enumerate(kernel.params) if w]
        launch = {
            **kernel.launch,
            "written": written,
            "interpret": interpret,
            "autotune": config.autotune,
            "tuned": config.tuning_candidates,
        }
        binaries[i] = KernelBinary(kernel.name, path, kernel.name, params, errors, inplace, triton=launch,
                                   sha256=sha256, variables=kernel.variables)  # fmt: skip
    return binaries
