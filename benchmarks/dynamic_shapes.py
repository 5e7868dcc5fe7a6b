"""Dynamic shapes (Note: symbolic sizes): a generate() loop end to end, and symbolic kernels against static ones.

    OMP_NUM_THREADS=1 python -m benchmarks.dynamic_shapes generate [--layers 2 --width 128] [--tokens 64]
                                                                   [--prompt 8] [--batch 1] [--rounds 5]
    OMP_NUM_THREADS=1 python -m benchmarks.dynamic_shapes steady [--cases gpt2-tiny,gpt2,bert,llama,resnet]
                                                                 [--rounds 20]
    python -m benchmarks.dynamic_shapes steady --device cuda [--cases gpt2-768,llama-768,gpt2,llama]

`generate`: GPT-2 (random weights, transformers' DynamicCache) writes `--tokens` tokens greedily
after a prompt, eager and `torch.compile(model, backend="ember", dynamic=True)`. It prints the
graphs dynamo traced and ember compiled, the first compiled loop (compile included) against an
eager loop, then eager and compiled loops interleaved (`--rounds` each): the main thread's CPU
seconds (`time.thread_time`, which waiting for other processes on a busy machine does not
inflate) and wall seconds. Before anything is timed, eager runs the model once, so transformers'
own first-call costs are no one's. Run it twice with one EMBER_CACHE_DIR to see a warm graph
cache (the second process loads ember's graphs; dynamo and AOTAutograd still trace).

`steady`: each case compiled twice by ember, with static sizes (`dynamic=False`, one graph per
shape) and with symbolic ones (`dynamic=True`, one graph), called in turns at each shape; the
CPU milliseconds per call (one thread) of both and their ratio, minimum over `--rounds`. With
`--device cuda` the models run on the GPU (Triton kernels; symbolic ones: Note: symbolic blocks,
ember/codegen/blocks.py) and a call is timed by wall clock from a synchronized GPU to a
synchronized GPU.

With OMP_NUM_THREADS=1 the CPU time of the one thread is all the work; the load average is
printed first.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import ember


def load_average() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---- generate ---------------------------------------------------------------------------------------


def gpt2(layers: int, width: int, vocab: int = 1000) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(2, width // 64), vocab_size=vocab,
                        n_positions=1024, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def generate(model: Callable, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    """Greedy decoding with a KV cache: the prompt once, then one token per call."""
    from transformers.cache_utils import DynamicCache

    cache, ids, out = DynamicCache(), prompt, []
    with torch.no_grad():
        for _ in range(tokens):
            step = model(input_ids=ids, cache=cache, use_cache=True)
            cache, ids = step.past_key_values, step.logits[:, -1:].argmax(-1)
            out.append(ids)
    return torch.cat(out, 1)


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """fn's result, main-thread CPU seconds, wall seconds."""
    cpu, wall = time.thread_time(), time.perf_counter()
    result = fn()
    return result, time.thread_time() - cpu, time.perf_counter() - wall


def run_generate(args: argparse.Namespace) -> None:
    model = gpt2(args.layers, args.width, args.vocab)
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt))
    with torch.no_grad():
        model(input_ids=torch.randint(0, args.vocab, (args.batch, 3)), use_cache=False)  # transformers' first call
    eager = functools.partial(generate, model, prompt, args.tokens)
    compiled_model = torch.compile(model, backend="ember", dynamic=True)
    compiled = functools.partial(generate, compiled_model, prompt, args.tokens)
    print(f"GPT-2 {args.layers} layers, width {args.width}, vocab {args.vocab}; batch {args.batch}, "
          f"prompt {args.prompt}, {args.tokens} tokens; {load_average()}")  # fmt: skip
    want, eager_cpu, eager_wall = timed(eager)
    got, first_cpu, first_wall = timed(compiled)
    if not torch.equal(got, want):
        print(f"tokens differ from eager's at {(got != want).nonzero()[:1].tolist()}")
    m = ember.metrics
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"graphs: dynamo {graphs}, ember symbolic {m.symbolic_graphs}, per shape {m.shape_specializations}, "
          f"loaded from the graph cache {m.graph_cache_hits}, failed {m.graphs_failed}")  # fmt: skip
    stages = ", ".join(f"{k} {v:.2f}" for k, v in sorted(m.compile_seconds.items(), key=lambda kv: -kv[1])[:6])
    print(f"compile seconds (wall): {stages}")
    print(f"first compiled loop (compile included): cpu {first_cpu:.3f} s, wall {first_wall:.3f} s; "
          f"eager loop: cpu {eager_cpu:.3f} s, wall {eager_wall:.3f} s")  # fmt: skip
    samples: dict[str, list[tuple[float, float]]] = {"eager": [], "ember": []}
    for _ in range(args.rounds):
        for name, fn in (("eager", eager), ("ember", compiled)):
            samples[name].append(timed(fn)[1:])
    for name, values in samples.items():
        cpu, wall = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        print(f"{name:6s} loop, median of {args.rounds}: cpu {cpu:.3f} s ({cpu / args.tokens * 1e3:.2f} ms/token), "
              f"wall {wall:.3f} s")  # fmt: skip
    print(load_average())


# ---- steady: symbolic kernels against static ones ----------------------------------------------------


def _static_call(model: Callable, *args: Any) -> Any:  # two code objects: dynamo caches the two
    return model(*args)  # compiles apart


def _symbolic_call(model: Callable, *args: Any) -> Any:
    return model(*args)


class Case:
    def __init__(self, name: str, model: Callable, make_inputs: Callable[..., tuple], shapes: list[tuple],
                 module: torch.nn.Module | None = None):  # fmt: skip
        self.name, self.model, self.make_inputs, self.shapes = name, model, make_inputs, shapes
        self.module = module  # what moves to the device


def hugging_face(name: str, layers: int, width: int, shapes: list[tuple]) -> Case:
    import transformers

    torch.manual_seed(0)
    common = {"vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 0}
    if name.startswith("gpt2"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4,
                                                                     n_positions=256, **common))  # fmt: skip
    elif name == "bert":
        model = transformers.BertModel(transformers.BertConfig(
            hidden_size=width, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=4 * width,
            max_position_embeddings=256, vocab_size=1000))  # fmt: skip
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, **common))  # fmt: skip
    model = model.eval()

    def forward(ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids, use_cache=False)
        return out[0]

    return Case(name, forward, lambda b, s: (torch.randint(0, 1000, (b, s)),), shapes, model)


def residual_net(shapes: list[tuple]) -> Case:
    """A small ResNet (stem, max pool, two basic blocks, the second with stride 2) over image sizes:
    its channels-last convolutions ask a guard on the image size (Note: guards a compile adds)."""
    from torch import nn

    def block(inp: int, out: int, stride: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(inp, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out), nn.ReLU(),
                             nn.Conv2d(out, out, 3, 1, 1, bias=False), nn.BatchNorm2d(out))  # fmt: skip

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 32, 7, 2, 3, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))  # fmt: skip
            self.one, self.two = block(32, 32, 1), block(32, 64, 2)
            self.down = nn.Sequential(nn.Conv2d(32, 64, 1, 2, bias=False), nn.BatchNorm2d(64))
            self.head = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            x = torch.relu(x + self.one(x))
            x = torch.relu(self.down(x) + self.two(x))
            return self.head(x.mean((2, 3)))

    torch.manual_seed(0)
    model = Net().eval()
    return Case("resnet", model, lambda b, s: (torch.randn(b, 3, s, s),), shapes, model)


CASES: dict[str, Callable[[], Case]] = {
    "gpt2-tiny": lambda: hugging_face("gpt2-tiny", 2, 128, [(1, 8), (2, 17), (1, 33), (4, 64)]),
    # GPU sizes (--device cuda)
    "gpt2-768": lambda: hugging_face("gpt2-768", 4, 768, [(8, 256), (4, 250), (16, 100), (1, 37)]),
    "llama-768": lambda: hugging_face("llama-768", 4, 768, [(8, 256), (4, 250), (16, 100), (1, 37)]),
    "gpt2": lambda: hugging_face("gpt2", 2, 256, [(4, 128), (2, 50), (1, 16)]),
    "bert": lambda: hugging_face("bert", 2, 256, [(4, 128), (2, 50), (1, 16)]),
    "llama": lambda: hugging_face("llama", 2, 256, [(4, 128), (2, 50), (1, 16)]),
    "resnet": lambda: residual_net([(4, 96), (8, 160), (2, 224), (1, 64)]),
}


def cpu_ms(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * 1e3


def gpu_ms(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def run_case(case: Case, rounds: int, device: str = "cpu") -> list[str]:
    torch._dynamo.reset()
    if case.module is not None:
        case.module.to(device)
    measure = cpu_ms if device == "cpu" else gpu_ms
    static = torch.compile(functools.partial(_static_call, case.model), backend="ember", dynamic=False)
    symbolic = torch.compile(functools.partial(_symbolic_call, case.model), backend="ember", dynamic=True)
    rows = []
    with torch.no_grad():
        for shape in case.shapes:
            inputs = tuple(x.to(device) for x in case.make_inputs(*shape))
            want = case.model(*inputs)
            calls = {"static": functools.partial(static, *inputs), "symbolic": functools.partial(symbolic, *inputs)}
            for fn in calls.values():
                for _ in range(3):
                    torch.testing.assert_close(fn(), want, rtol=1e-3, atol=1e-3)
            samples: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(rounds):
                for name, fn in calls.items():
                    samples[name].append(measure(fn))
            best = {name: min(values) for name, values in samples.items()}
            ratio = best["symbolic"] / best["static"]
            rows.append(f"{case.name:10s} {str(shape):10s} static {best['static']:8.3f}  "
                        f"symbolic {best['symbolic']:8.3f}  ratio {ratio:.3f}")  # fmt: skip
    m = ember.metrics
    rows.append(f"{'':10s} graphs: symbolic {m.symbolic_graphs}, fallbacks {dict(m.symbolic_fallbacks)}, "
                f"guards added {sorted(m.size_guards)}")  # fmt: skip
    return rows


def run_steady(args: argparse.Namespace) -> None:
    what = "CPU ms per call, one thread" if args.device == "cpu" else f"wall ms per call on {args.device}"
    print(f"{what}, minimum of {args.rounds} interleaved rounds; {load_average()}")
    for name in args.cases.split(","):
        ember.metrics.reset()
        for row in run_case(CASES[name](), args.rounds, args.device):
            print(row, flush=True)
    print(load_average())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--width", type=int, default=128)
    g.add_argument("--vocab", type=int, default=1000)
    g.add_argument("--tokens", type=int, default=64)
    g.add_argument("--prompt", type=int, default=8)
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--rounds", type=int, default=5)
    s = sub.add_parser("steady")
    s.add_argument("--cases", default="gpt2-tiny,gpt2,bert,llama")
    s.add_argument("--rounds", type=int, default=20)
    s.add_argument("--device", default="cpu", help="cuda: the models on the GPU (Triton kernels)")
    args = parser.parse_args()
    if getattr(args, "device", "cpu") == "cpu" and os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: set OMP_NUM_THREADS=1, or kernels' worker threads are not counted")
    torch.set_num_threads(1)
    run_generate(args) if args.command == "generate" else run_steady(args)


if __name__ == "__main__":
    main()
