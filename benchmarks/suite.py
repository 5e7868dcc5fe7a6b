"""The benchmark workloads: a registry of small, realistic CPU models and programs.

Each entry is a factory `make(quick) -> Workload | None`. A `Workload` is a named tuple
`(name, model, inputs, is_training, bytes_moved)`:

    model        an `nn.Module` or a plain function; for inference `model(*inputs)` gives the
                 outputs; for training (`is_training`) it gives a scalar loss, and the runner
                 times the whole step (zero grads, forward, loss, backward)
    optimizer    for a training workload, optionally `make(parameters) -> torch.optim.Optimizer`:
                 then the step also runs `optimizer.step()`, and the compilers compile the whole
                 step (forward, backward, update) as one function, each on its own copy of the
                 model and optimizer
    inputs       example inputs, float32 unless they are token ids or class targets
    bytes_moved  only for memory-bound micro-benchmarks: the least bytes a perfect kernel
                 reads and writes, so the runner can report GB/s

`quick=True` gives tiny sizes for the smoke test. A factory returns None when a package it
needs (`transformers`) is missing; the runner prints a note and skips it.
Every factory seeds the RNG, so two processes build identical workloads (the warm compile
measurement relies on that).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Workload(NamedTuple):
    name: str
    model: Callable[..., Any]
    inputs: tuple[Any, ...]
    is_training: bool
    bytes_moved: int | None = None
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None


# ---------------------------------------------------------------------------------------------
# Small models written by hand


class MLP(nn.Module):
    """Linear -> LayerNorm -> GELU, `depth` times."""

    def __init__(self, width: int, depth: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Attention(nn.Module):
    """Multi-head self-attention with explicit matmul and softmax (no fused SDPA)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        head_dim = dim // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.heads, head_dim).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
        weights = torch.softmax(scores, dim=-1)
        mixed = torch.matmul(weights, v).transpose(1, 2).reshape(batch, seq, dim)
        return self.out(mixed)


def pointwise_chain(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """About 25 elementwise ops, transcendentals included; values stay bounded."""
    a = torch.sigmoid(x) * torch.tanh(y) + 0.5 * z
    b = torch.exp(-(x * x)) - torch.cos(y) * torch.sin(z)
    c = torch.where(a > 0, a, 0.1 * a) + torch.log1p(torch.abs(b))
    d = torch.sqrt(torch.abs(c) + 1.0) * torch.erf(x - z)
    e = torch.clamp(d * y, -3.0, 3.0) / (1.0 + z * z)
    return F.gelu(e) + torch.maximum(a, b) - torch.minimum(c, d) * 0.25


class Reductions(nn.Module):
    """Row normalizations and reductions, plus column sums, over one 2-D input."""

    def __init__(self, width: int):
        super().__init__()
        self.ln_weight = nn.Parameter(torch.randn(width))
        self.ln_bias = nn.Parameter(torch.randn(width))
        self.rms_weight = nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        width = x.shape[-1]
        layer_norm = F.layer_norm(x, (width,), self.ln_weight, self.ln_bias)
        rms_norm = F.rms_norm(x, (width,), self.rms_weight, eps=1e-6)
        logsumexp = torch.logsumexp(x, dim=-1)
        var, mean = torch.var_mean(x, dim=-1)
        column_sums = x.sum(dim=0)
        return layer_norm, rms_norm, logsumexp, var, mean, column_sums


class ConvNet(nn.Module):
    """Three conv -> BatchNorm -> ReLU blocks, global average pool, linear classifier."""

    def __init__(self, classes: int = 10):
        super().__init__()
        channels = [(3, 32, 1), (32, 64, 2), (64, 64, 1)]
        blocks: list[nn.Module] = []
        for cin, cout, stride in channels:
            blocks += [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(64, classes)
        for module in self.modules():
            if isinstance(module, nn.BatchNorm2d):  # non-trivial running statistics
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.data.uniform_(0.5, 1.5)
                module.bias.data.uniform_(-0.2, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class MLPClassifierLoss(nn.Module):
    """A classifier MLP whose forward returns the cross-entropy loss (for the training step)."""

    def __init__(self, features: int, width: int, classes: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes)
        )

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), target)


def bandwidth_chain(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Eight cheap ops: memory-bound, so a fused kernel is limited by reading a, b, c and writing one output."""
    t = a * b + c
    t = torch.where(t > 0, t, t * 0.5)
    t = t - a * c
    return (t + b) * 0.25


# ---------------------------------------------------------------------------------------------
# Factories


def make_mlp(quick: bool) -> Workload:
    torch.manual_seed(0)
    batch, width = (8, 64) if quick else (64, 512)
    return Workload("mlp", MLP(width).eval(), (torch.randn(batch, width),), False)


def make_attention(quick: bool) -> Workload:
    torch.manual_seed(0)
    batch, seq, dim, heads = (2, 16, 32, 4) if quick else (4, 128, 256, 4)
    return Workload("attention", Attention(dim, heads).eval(), (torch.randn(batch, seq, dim),), False)


def relu(x: torch.Tensor) -> torch.Tensor:
    """F.relu behind a function the encoder layer's fast path does not recognize (see make_encoder_layer)."""
    return F.relu(x)


def make_encoder_layer(quick: bool, fused: bool = True) -> Workload:
    """Note: the encoder layer's fast path
    In eval mode without grad, nn.TransformerEncoderLayer runs one fused native op
    (aten._transformer_encoder_layer_fwd), in eager and, traced by dynamo, in compiled code
    too: `encoder_layer` measures what users get. Inductor calls that op; ember decomposes it
    into ops it fuses (lower/transformer_fastpath.py). `encoder_layer_unfused` gives the same
    layer an activation the fast path does not recognize, so eager and the compilers all run
    it op by op."""
    torch.manual_seed(0)
    batch, seq, dim, ffn = (2, 16, 32, 64) if quick else (8, 64, 256, 1024)
    layer = nn.TransformerEncoderLayer(
        d_model=dim,
        nhead=4,
        dim_feedforward=ffn,
        batch_first=True,
        norm_first=True,
        dropout=0.0,
        activation=F.relu if fused else relu,
    )
    name = "encoder_layer" if fused else "encoder_layer_unfused"
    return Workload(name, layer.eval(), (torch.randn(batch, seq, dim),), False)


def make_encoder_layer_unfused(quick: bool) -> Workload:
    return make_encoder_layer(quick, fused=False)


def make_pointwise_chain(quick: bool) -> Workload:
    torch.manual_seed(0)
    numel = 1 << 14 if quick else 1 << 22
    inputs = tuple(torch.randn(numel // 1024, 1024) for _ in range(3))
    return Workload("pointwise_chain", pointwise_chain, inputs, False)


def make_reductions(quick: bool) -> Workload:
    torch.manual_seed(0)
    rows, width = (64, 128) if quick else (2048, 1024)
    return Workload("reductions", Reductions(width).eval(), (torch.randn(rows, width),), False)


def make_convnet(quick: bool) -> Workload:
    torch.manual_seed(0)
    batch, size = (2, 16) if quick else (8, 64)
    return Workload("convnet", ConvNet().eval(), (torch.randn(batch, 3, size, size),), False)


def make_mlp_train(quick: bool) -> Workload:
    torch.manual_seed(0)
    batch, features, width, classes = (8, 32, 64, 10) if quick else (128, 512, 1024, 100)
    model = MLPClassifierLoss(features, width, classes).train()
    return Workload("mlp_train", model, (torch.randn(batch, features), torch.randint(0, classes, (batch,))), True)


def make_bandwidth(quick: bool) -> Workload:
    torch.manual_seed(0)
    numel = 1 << 20 if quick else 1 << 24
    inputs = tuple(torch.randn(numel) for _ in range(3))
    bytes_moved = 4 * numel * 4  # three float32 inputs read, one float32 output written
    return Workload("bandwidth", bandwidth_chain, inputs, False, bytes_moved)


def column_sum(x: torch.Tensor) -> torch.Tensor:
    """A reduction over the outer axis of a row-major matrix (Note: lane accumulators, codegen/lanes.py)."""
    return x.sum(dim=0)


def full_sum(x: torch.Tensor) -> torch.Tensor:
    """A reduction of every element to one: split over the threads, then combined."""
    return x.sum()


def make_column_sum(quick: bool) -> Workload:
    torch.manual_seed(0)
    rows, width = (64, 128) if quick else (8192, 1024)
    return Workload("column_sum", column_sum, (torch.randn(rows, width),), False, 4 * rows * width)


def make_full_sum(quick: bool) -> Workload:
    torch.manual_seed(0)
    numel = 1 << 16 if quick else 1 << 24
    return Workload("full_sum", full_sum, (torch.randn(numel),), False, 4 * numel)


# ---------------------------------------------------------------------------------------------
# Hugging Face models: random weights from a config built here, never downloaded


class HuggingFaceOutput(nn.Module):
    """Calls a `transformers` model on input_ids and returns its main tensors (not a ModelOutput)."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(input_ids=input_ids, use_cache=False)
        return tuple(out[key] for key in self.keys)


def has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _token_ids(quick: bool, vocab: int) -> tuple[torch.Tensor]:
    batch, seq = (2, 16) if quick else (4, 128)
    return (torch.randint(0, vocab, (batch, seq)),)


def make_gpt2(quick: bool) -> Workload | None:
    if not has_transformers():
        return None
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    layers, width = (1, 64) if quick else (2, 256)
    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=0, eos_token_id=0
    )
    model = HuggingFaceOutput(GPT2LMHeadModel(config).eval(), ("logits",))
    return Workload("gpt2", model, _token_ids(quick, 1000), False)


def make_bert(quick: bool) -> Workload | None:
    if not has_transformers():
        return None
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    layers, width = (1, 64) if quick else (2, 256)
    config = BertConfig(
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * width,
        vocab_size=1000,
        max_position_embeddings=256,
    )
    model = HuggingFaceOutput(BertModel(config).eval(), ("last_hidden_state", "pooler_output"))
    return Workload("bert", model, _token_ids(quick, 1000), False)


def make_llama(quick: bool) -> Workload | None:
    if not has_transformers():
        return None
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    layers, width = (1, 64) if quick else (2, 256)
    config = LlamaConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1000,
        max_position_embeddings=256,
    )
    model = HuggingFaceOutput(LlamaForCausalLM(config).eval(), ("logits",))
    return Workload("llama", model, _token_ids(quick, 1000), False)


class HuggingFaceLoss(nn.Module):
    """A causal language model's loss on its own input_ids (next-token prediction)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def make_gpt2_adamw(quick: bool) -> Workload | None:
    """A GPT-2 training step with AdamW under one torch.compile: forward, backward and the
    optimizer's update of every parameter and state (4 layers, width 256, 4 heads, vocab 1000,
    2 x 128 tokens, no dropout). lr is small so that one step moves no weight by more than the
    runner's tolerance, whatever the sign of a gradient that is zero up to rounding."""
    if not has_transformers():
        return None
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    layers, width, seq = (1, 64, 16) if quick else (4, 256, 128)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = HuggingFaceLoss(GPT2LMHeadModel(config).train())
    ids = (torch.randint(0, 1000, (2, seq)),)
    return Workload("gpt2_adamw", model, ids, True, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4))


# The registry, in the order the runner goes through it.
WORKLOADS: dict[str, Callable[[bool], Workload | None]] = {
    "mlp": make_mlp,
    "attention": make_attention,
    "encoder_layer": make_encoder_layer,
    "encoder_layer_unfused": make_encoder_layer_unfused,
    "pointwise_chain": make_pointwise_chain,
    "reductions": make_reductions,
    "convnet": make_convnet,
    "gpt2": make_gpt2,
    "bert": make_bert,
    "llama": make_llama,
    "mlp_train": make_mlp_train,
    "gpt2_adamw": make_gpt2_adamw,
    "bandwidth": make_bandwidth,
    "column_sum": make_column_sum,
    "full_sum": make_full_sum,
}


def build(name: str, quick: bool = False) -> Workload | None:
    """The workload called `name`, or None when a package it needs is missing."""
    if name not in WORKLOADS:
        raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name](quick)
