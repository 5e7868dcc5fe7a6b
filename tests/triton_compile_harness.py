"""Run by tests/test_triton_compile.py as `python -m tests.triton_compile_harness`, in a process
without TRITON_INTERPRET (a launcher's own compile needs Triton's real jit functions), on a
machine that may have no GPU: one graph compiled for the Triton backend on the GPU path, its
kernels' configurations compiled by the compile pool for the CUDA target sm_90, then compiled
again here as the first call would, counting Triton's cache hits. Nothing is launched. Prints
one JSON line of counts. With the argument `symbolic`, the graph is one with dynamic shapes,
compiled once with sizes as kernel arguments (Note: symbolic blocks, ember/codegen/blocks.py); with
`horizontal`, one whose kernels are the parts of a horizontal kernel.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

TARGET = ("cuda", 90, 32)


def program(x, w, table, idx):
    """A softmax (a reduction with several candidates), a large pointwise kernel with a random
    op (a seed by value), an embedding (an error flag) and a tiny reduction (one candidate)."""
    probabilities = torch.softmax(x, -1)
    noisy = x * 2 + torch.rand_like(x) * w
    rows = torch.nn.functional.embedding(idx, table)
    return probabilities, noisy, rows, w.sum()


def stand_in_cuda_launchers() -> list:
    """Patches ember so a graph compiles by the GPU path for a stand-in sm_90 on this machine;
    returns the list every Triton launcher the wrappers load (on cuda:0) is appended to."""
    from ember import compile_graph as graph_module
    from ember.compile_triton import TritonBackend
    from ember.runtime import triton as triton_runtime
    from ember.wrapper import runtime as wrapper_runtime

    triton_runtime.device_facts = lambda device: (TARGET, "stand-in sm_90")
    graph_module.backend_for = lambda device, config: TritonBackend(interpret=False)
    launchers, load_kernel = [], wrapper_runtime.load_triton_kernel

    def load_for_cuda(root, relative, sha256, name, device=None, **launch):
        launchers.append(load_kernel(root, relative, sha256, name, torch.device("cuda", 0), **launch))
        return launchers[-1]

    wrapper_runtime.load_triton_kernel = load_for_cuda
    return launchers


def compile_for_cuda(cache: Path) -> list:
    """The graph of `program` compiled by the GPU path (the backend and the wrapper's launchers
    told they serve CUDA device 0); the launchers its wrapper made."""
    from ember import compile_graph as graph_module
    from ember.config import load

    launchers = stand_in_cuda_launchers()
    inputs = [torch.randn(256, 1000), torch.randn(1000), torch.randn(50, 64), torch.randint(0, 50, (8,))]
    gm = make_fx(program)(*inputs)
    # each kernel its own launcher (horizontal fusion would launch the random one and the embedding as one)
    graph_module.compile_graph(gm, inputs, load(cache_dir=str(cache), graph_cache=False, horizontal_fusion=False))
    return launchers


def symbolic_program(x, y):
    """Pointwise, a looped row reduction over a symbolic length, a scan and a nested reduction."""
    z = torch.softmax(x * 2 + y, dim=-1)
    return z.sum(0), x.cumsum(1), torch.nn.functional.cross_entropy(x, y.argmax(-1))


def compile_symbolic_for_cuda(cache: Path) -> list:
    """`symbolic_program` compiled once with dynamic=True by the GPU path (Note: symbolic blocks,
    ember/codegen/blocks.py), as `compile_for_cuda` does; the calls launch nothing."""
    from ember.runtime import triton as triton_runtime
    from ember.runtime.triton_sized import SizedTritonLauncher

    launchers = stand_in_cuda_launchers()
    triton_runtime.TritonLauncher.__call__ = lambda self, *args: None  # nothing launched (no GPU)
    SizedTritonLauncher.__call__ = lambda self, *args: None  # type: ignore[method-assign]
    compiled = torch.compile(symbolic_program, backend="ember", dynamic=True)
    for n, m in ((5, 40), (9, 300)):
        compiled(torch.randn(n, m), torch.randn(n, m))
    return launchers


def horizontal_program(a, b, c, s):
    """Independent pointwise results of several sizes (one of them random: a seed by value, and a
    0-d one): one horizontal kernel (Note: horizontal fusion, ember/schedule/horizontal.py)."""
    return a * 2 + 1, b.exp() + torch.rand_like(b), c.sin(), s + 1


def compile_horizontal_for_cuda(cache: Path) -> list:
    """`horizontal_program` compiled by the GPU path, as `compile_for_cuda` does."""
    from ember import compile_graph as graph_module
    from ember.config import load

    launchers = stand_in_cuda_launchers()
    inputs = [torch.randn(300, 7), torch.randn(5000), torch.randn(3), torch.randn(())]
    gm = make_fx(horizontal_program)(*inputs)
    graph_module.compile_graph(gm, inputs, load(cache_dir=str(cache), graph_cache=False))
    return launchers


def entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def main() -> None:
    import triton

    import ember
    from ember.runtime.triton_compile import compile_kernel
    from ember.runtime.triton_pool import compile_pool

    symbolic = sys.argv[1:] == ["symbolic"]
    makers = {"symbolic": compile_symbolic_for_cuda, "horizontal": compile_horizontal_for_cuda}
    make = makers.get(sys.argv[1] if sys.argv[1:] else "", compile_for_cuda)
    launchers = make(Path(os.environ["EMBER_CACHE_DIR"]))
    pool = compile_pool()
    requests, failures = [], []
    for launcher in launchers:
        every_aligned = (True,) * len(launcher.signature)
        for config in launcher.tuning_plan("stand-in sm_90"):
            request = launcher.request(config, launcher.signature, every_aligned, TARGET)
            future = pool.pending(request)
            failure = "never submitted" if future is None else future.exception(timeout=600)
            failures += [str(failure)] if failure is not None else []
            requests.append((launcher, request))
    triton_cache = Path(triton.knobs.cache.dir)
    before = entries(triton_cache)
    hits: list[bool] = []
    triton.knobs.compilation.listener = lambda **event: hits.append(event["cache_hit"])
    for launcher, request in requests:  # as the first call compiles them (runtime/triton.py compiled_kernel)
        compile_kernel(getattr(launcher.module, request.function), request)
    added = entries(triton_cache) - before
    # a control: the same kernel for unaligned pointers is another kernel, which the pool never built
    launcher, request = requests[0]
    unaligned = launcher.request(launcher.tuning_plan("stand-in sm_90")[0], launcher.signature,
                                 (False,) * len(launcher.signature), TARGET)  # fmt: skip
    compile_kernel(getattr(launcher.module, unaligned.function), unaligned)
    wide = 0  # a symbolic kernel's 64-bit-index twin, which calls past its size cap compile in the process
    for launcher in launchers if symbolic else []:
        if getattr(launcher, "size_cap", 0):
            config = launcher.tuning_plan("stand-in sm_90")[0]
            every_aligned = (True,) * len(launcher.signature)
            request = launcher.request(config, launcher.signature, every_aligned, TARGET, wide=True)
            compile_kernel(getattr(launcher.module, request.function), request)
            wide += 1
    report = {
        "kernels": len(launchers),
        "plans": sorted(len(launcher.tuning_plan("stand-in sm_90")) for launcher in launchers),
        "requests": len(requests),
        "precompiled": ember.metrics.triton_configs_precompiled,
        "in_process": ember.metrics.triton_compiles_in_process,
        "failures": failures,
        "hits": hits[: len(requests)].count(True),
        "misses": hits[: len(requests)].count(False),
        "added_entries": len(added),
        "control_hit": hits[len(requests)],
        "workers": len(pool.worker_pids()),
        "error_flag_kernels": sum(1 for launcher in launchers if launcher.signature[-1] == "*i64"),
        "by_value_kernels": sum(1 for launcher in launchers if "i64" in launcher.signature),
        "symbolic_graphs": ember.metrics.symbolic_graphs,
        "symbolic_grid_kernels": sum(1 for launcher in launchers if hasattr(launcher, "classify")),
        "wide_compiled": wide,
        "horizontal_groups": ember.metrics.horizontal_groups,
    }
    print("harness: " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
