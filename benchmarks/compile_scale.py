"""Cold compile time against model depth, per ember stage, with each stage's growth.

    python -m benchmarks.compile_scale [--cases gpt2-2,gpt2-6,...] [--inductor] [--json out.json]

Small benchmarks hide quadratic and cubic costs (STYLE.md, habit 17): this compiles the
same model family at several depths and prints, per stage of `ember.metrics.compile_seconds`,
the seconds at each depth and the growth between consecutive depths next to the growth of
the model (a stage that grows linearly has a ratio near the depth ratio).

Cases (CPU, random weights, nothing downloaded):
    gpt2-L        GPT-2 training (forward + backward, loss in the graph), width 128, L layers
    llama-L       LLaMA-style training, width 128, L layers
    resnet50      ResNet-50 training (bottleneck, depths 3/4/6/3), batch 2 at 64x64
    gpt2-L-adamw  `torch.compile(step)` around forward, backward and AdamW.step()

Each stage is shown as wall seconds and, in brackets, the CPU seconds of the compiling thread
(`time.thread_time`, which waiting for other processes on a busy machine does not inflate; gcc
runs in other processes, so `runtime` has almost none). Growth ratios use the CPU seconds when
the stage has any, so they compare the code's work rather than the machine's load.

Every compile is cold: ember's EMBER_CACHE_DIR and inductor's TORCHINDUCTOR_CACHE_DIR point
at fresh temporary folders for each case, inductor's FX graph cache is off, and dynamo is
reset between cases. Timings are wall times: read them with the load average printed first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import ember
from ember import compile_cpp, compile_graph, compile_triton, errors

DEFAULT_CASES = "gpt2-2,gpt2-6,gpt2-12,gpt2-24,llama-4,llama-16,resnet50,gpt2-12-adamw"
STAGES = ("aot_autograd", "graph_key", "passes", "lower", "schedule", "codegen", "render", "runtime", "wrapper",
          "graph_cache_store")  # fmt: skip


@dataclass
class CaseResult:
    case: str
    ember_s: float = 0.0
    inductor_s: float | None = None
    stages: dict[str, float] = field(default_factory=dict)
    stages_cpu: dict[str, float] = field(default_factory=dict)  # the compiling thread's CPU seconds
    kernels: int = 0
    fusions: int = 0
    refusals: int = 0
    distinct: int = 0  # kernels that went through codegen (the distinct ones: Note: kernels generated once)
    gcc_runs: int = 0
    error: str | None = None


def gpt2_training(layers: int) -> tuple[torch.nn.Module, tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1000, n_positions=128, n_embd=128, n_head=4, n_layer=layers)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 1000, (2, 64))
    return LossOf(model), (ids, ids)


def llama_training(layers: int) -> tuple[torch.nn.Module, tuple]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, 1000, (2, 64))
    return LossOf(model), (ids, ids)


def resnet50_training() -> tuple[torch.nn.Module, tuple]:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(layer_type="bottleneck", depths=[3, 4, 6, 3], num_labels=10)
    model = ResNetForImageClassification(config).train()
    return ImageLossOf(model), (torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,)))


class LossOf(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels, use_cache=False).loss


class ImageLossOf(LossOf):
    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.model(pixel_values=pixels, labels=labels).loss


def training_step(model: torch.nn.Module, inputs: tuple, backend: str) -> Callable[[], Any]:
    """The first training step (forward with the loss, backward): what the user waits for."""
    compiled = torch.compile(model, backend=backend, dynamic=False)

    def step() -> Any:
        loss = compiled(*inputs)
        loss.backward()
        return loss

    return step


def whole_step_with_adamw(model: torch.nn.Module, inputs: tuple, backend: str) -> Callable[[], Any]:
    """`torch.compile` around forward, backward and AdamW.step(), as many training loops do."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> Any:
        optimizer.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        optimizer.step()
        return loss

    return torch.compile(step, backend=backend, dynamic=False)


def build_case(case: str) -> tuple[torch.nn.Module, tuple, Callable]:
    parts = case.split("-")
    if parts[0] == "resnet50":
        return (*resnet50_training(), training_step)
    family, layers = parts[0], int(parts[1])
    model, inputs = gpt2_training(layers) if family == "gpt2" else llama_training(layers)
    wrap = whole_step_with_adamw if parts[-1] == "adamw" else training_step
    return model, inputs, wrap


def timed_compile(case: str, backend: str) -> float:
    """Seconds of the first call (compile + one run) with fresh caches."""
    model, inputs, wrap = build_case(case)
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory(prefix=f"compile-scale-{backend}-") as cache:
        os.environ["EMBER_CACHE_DIR" if backend == "ember" else "TORCHINDUCTOR_CACHE_DIR"] = cache
        step = wrap(model, inputs, backend)
        start = time.perf_counter()
        step()
        return time.perf_counter() - start


STAGE_USERS = (compile_graph, compile_cpp, compile_triton)  # the modules that time ember's stages


@contextlib.contextmanager
def stage_cpu_seconds(into: dict[str, float]) -> Iterator[None]:
    """Adds each ember stage's CPU seconds (this thread) to `into`, around `errors.stage` where
    each of STAGE_USERS calls it (codegen and runtime are timed by the backends)."""
    real_stage = errors.stage

    @contextlib.contextmanager
    def stage(name: str, timings: dict[str, float]) -> Iterator[None]:
        start = time.thread_time()
        try:
            with real_stage(name, timings):
                yield
        finally:
            into[name] = into.get(name, 0.0) + time.thread_time() - start

    for module in STAGE_USERS:
        module.stage = stage  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in STAGE_USERS:
            module.stage = real_stage  # type: ignore[attr-defined]


def run_case(case: str, inductor: bool) -> CaseResult:
    result = CaseResult(case)
    ember.metrics.reset()
    try:
        with stage_cpu_seconds(result.stages_cpu):
            result.ember_s = timed_compile(case, "ember")
    except Exception as e:  # a case that fails is reported, the others still run
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return result
    seconds = ember.metrics.compile_seconds
    result.stages = {s: seconds[s] for s in STAGES if s in seconds}
    # dynamo's tracing, the first run of the compiled step, and anything outside ember's stages
    result.stages["other"] = max(0.0, result.ember_s - sum(v for s, v in result.stages.items() if s != "render"))
    result.kernels, result.fusions = ember.metrics.kernels_generated, ember.metrics.fusions
    result.refusals = ember.metrics.fusion_refusals
    result.distinct, result.gcc_runs = ember.metrics.kernels_codegen, ember.metrics.gcc_runs
    if inductor:
        result.inductor_s = timed_compile(case, "inductor")
    return result


def print_result(r: CaseResult) -> None:
    if r.error:
        print(f"{r.case:16s} ember error: {r.error}", flush=True)
        return
    versus = f"  inductor {r.inductor_s:7.1f}s  ratio {r.ember_s / r.inductor_s:4.2f}" if r.inductor_s else ""
    print(f"{r.case:16s} ember {r.ember_s:7.1f}s{versus}  kernels {r.kernels} fusions {r.fusions} "
          f"refusals {r.refusals} distinct {r.distinct} gcc {r.gcc_runs}", flush=True)  # fmt: skip
    cells = [f"{s} {v:.2f}" + (f" [{r.stages_cpu[s]:.2f}]" if s in r.stages_cpu else "") for s, v in r.stages.items()]
    print("    " + "  ".join(cells), flush=True)


def print_growth(results: list[CaseResult]) -> None:
    """Per family, each stage's growth between consecutive depths against the depth's growth."""
    by_family: dict[str, list[tuple[int, CaseResult]]] = {}
    for r in results:
        parts = r.case.split("-")
        if len(parts) == 2 and not r.error:
            by_family.setdefault(parts[0], []).append((int(parts[1]), r))
    for family, runs in by_family.items():
        runs.sort(key=lambda x: x[0])
        for (small, a), (large, b) in zip(runs, runs[1:]):
            cells = [f"{s} {_growth(a, b, s):5.2f}x" for s in b.stages if a.stages.get(s, 0) > 1e-3]
            print(f"growth {family} {small}->{large} layers ({large / small:.1f}x): total "
                  f"{b.ember_s / a.ember_s:5.2f}x  " + "  ".join(cells))  # fmt: skip


def _growth(a: CaseResult, b: CaseResult, stage: str) -> float:
    if a.stages_cpu.get(stage, 0.0) > 0.05:  # CPU seconds where the stage is the compiling thread's work
        return b.stages_cpu.get(stage, 0.0) / a.stages_cpu[stage]
    return b.stages[stage] / a.stages[stage]


def warm_up(inductor: bool) -> None:
    """Compiles a trivial function with each compiler, so that imports and worker start-up are
    not charged to the first case (as benchmarks/run.py does); turns inductor's FX graph cache off."""
    if inductor:
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = False
    for backend in ("ember", "inductor") if inductor else ("ember",):
        torch._dynamo.reset()
        with tempfile.TemporaryDirectory() as cache:
            os.environ["EMBER_CACHE_DIR" if backend == "ember" else "TORCHINDUCTOR_CACHE_DIR"] = cache
            torch.compile(lambda x: x.sin() + 1, backend=backend)(torch.randn(8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--inductor", action="store_true", help="also compile each case with inductor")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()}  cpus {os.cpu_count()}  torch {torch.__version__}", flush=True)
    warm_up(args.inductor)
    results = []
    for case in args.cases.split(","):
        results.append(run_case(case, args.inductor))
        print_result(results[-1])
    print_growth(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1)


if __name__ == "__main__":
    main()
