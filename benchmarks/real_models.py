"""Real models at real sizes, for `python -m benchmarks.run --suite real`: inference at batch 1 and 8,
and training steps of the text models at batch 2.

`transformers` models built from configs with random weights (nothing is downloaded): GPT-2 small
(12 layers, width 768), BERT-base, a LLaMA-style decoder (small hidden, grouped-query attention,
rotary embeddings), T5-small (encoder and decoder), ViT-base, ConvNeXt-tiny and ResNet-50. Each is a
workload per batch size (`gpt2_small_b1`, `gpt2_small_b8`, ...), so `--models` picks them one by
one: at these sizes a workload takes minutes on a small machine (each compiler, the float64
reference, at least five timing rounds). Text models read 128 tokens per sample (T5's decoder 32),
vision models one 224 x 224 image per sample. The runner, its columns and its correctness check
(against a float64 copy of the model) are benchmarks/run.py's; factories seed the RNG so the warm
compile subprocess builds identical workloads. `quick` gives tiny configs, for the smoke test.

Training steps (`gpt2_small_train`, `llama_gqa_train`, `bert_base_train`): the language-model loss
on 2 x 128 tokens (BERT's masked-LM loss with every token its own label), forward and backward,
no optimizer, every dropout probability 0 so that the compiled gradients can be checked against
float64 eager's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.suite import Workload, has_transformers

BATCHES = (1, 8)
TOKENS, DECODER_TOKENS, IMAGE = 128, 32, 224


class MainOutputs(nn.Module):
    """Calls a `transformers` model with keyword inputs and returns its main tensors (not a ModelOutput)."""

    def __init__(self, model: nn.Module, input_names: tuple[str, ...], keys: tuple[str, ...]):
        super().__init__()
        self.model, self.input_names, self.keys = model, input_names, keys

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(**dict(zip(self.input_names, inputs)))
        return tuple(out[key] for key in self.keys)


def _tokens(batch: int, vocab: int, quick: bool, length: int = TOKENS) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, 16 if quick else length))


def _images(batch: int, quick: bool) -> torch.Tensor:
    return torch.randn(batch, 3, 32 if quick else IMAGE, 32 if quick else IMAGE)


def gpt2_small(batch: int, quick: bool) -> tuple[nn.Module, tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=1, n_embd=64, n_head=4, vocab_size=1000) if quick else {}  # defaults: 12 x 768, 50257
    config = GPT2Config(**size, use_cache=False)
    model = MainOutputs(GPT2LMHeadModel(config), ("input_ids",), ("logits",))
    return model, (_tokens(batch, config.vocab_size, quick),)


def bert_base(batch: int, quick: bool) -> tuple[nn.Module, tuple]:
    from transformers import BertConfig, BertModel

    size = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=256) if quick else {}
    config = BertConfig(**size)  # defaults: 12 layers, 768 wide, 12 heads, vocab 30522
    model = MainOutputs(BertModel(config), ("input_ids",), ("last_hidden_state", "pooler_output"))
    return model, (_tokens(batch, config.vocab_size, quick),)


def llama_gqa(batch: int, quick: bool) -> tuple[nn.Module, tuple]:
    """8 layers, width 512, 8 query heads sharing 2 key/value heads, rotary embeddings, SwiGLU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, width = (1, 64) if quick else (8, 512)
    config = LlamaConfig(hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                         max_position_embeddings=2048, use_cache=False)  # fmt: skip
    model = MainOutputs(LlamaForCausalLM(config), ("input_ids",), ("logits",))
    return model, (_tokens(batch, config.vocab_size, quick),)


def t5_small(batch: int, quick: bool) -> tuple[nn.Module, tuple]:
    from transformers import T5Config, T5ForConditionalGeneration

    size = dict(num_layers=1, num_decoder_layers=1, d_model=64, d_ff=128, num_heads=4, d_kv=16) if quick else {}
    config = T5Config(**size, use_cache=False)  # defaults: 6 + 6 layers, width 512, 8 heads, vocab 32128
    model = MainOutputs(T5ForConditionalGeneration(config), ("input_ids", "decoder_input_ids"), ("logits",))
    return model, (_tokens(batch, config.vocab_size, quick), _tokens(batch, config.vocab_size, quick, DECODER_TOKENS))


def vit_base(batch: int, quick: bool) -> tuple[nn.Module, tuple]:
    from transformers import ViTConfig, ViTModel

    size = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=256, image_size=32,
                patch_size=8) if quick else {}  # fmt: skip
    config = ViTConfig(**size)  # defaults: 12 layers, 768 wide, 16 x 16 patches of 224 x 224
    model = MainOutputs(ViTModel(config), ("pixel_values",), ("last_hidden_state", "pooler_output"))
    return model, (_images(batch, quick),)


def convnext_tiny(batch: int, quick: bool) -> tuple[nn.Module, tuple]:
    from transformers import ConvNextConfig, ConvNextModel

    size = dict(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128]) if quick else {}
    config = ConvNextConfig(**size)  # defaults: ConvNeXt-tiny, depths 3-3-9-3, widths 96-768
    model = MainOutputs(ConvNextModel(config), ("pixel_values",), ("last_hidden_state", "pooler_output"))
    return model, (_images(batch, quick),)


def resnet50(batch: int, quick: bool) -> tuple[nn.Module, tuple]:
    from transformers import ResNetConfig, ResNetModel

    size = dict(depths=[1, 1, 1, 1], hidden_sizes=[32, 64, 128, 256], embedding_size=16) if quick else {}
    config = ResNetConfig(**size)  # defaults: ResNet-50, bottleneck blocks 3-4-6-3
    model = MainOutputs(ResNetModel(config), ("pixel_values",), ("last_hidden_state", "pooler_output"))
    return model, (_images(batch, quick),)


MODELS: dict[str, Callable[[int, bool], tuple[nn.Module, tuple]]] = {
    "gpt2_small": gpt2_small, "bert_base": bert_base, "llama_gqa": llama_gqa, "t5_small": t5_small,
    "vit_base": vit_base, "convnext_tiny": convnext_tiny, "resnet50": resnet50,
}  # fmt: skip


def _factory(name: str, batch: int) -> Callable[[bool], Workload | None]:
    def make(quick: bool) -> Workload | None:
        if not has_transformers():
            return None
        torch.manual_seed(0)
        model, inputs = MODELS[name](batch, quick)
        return Workload(f"{name}_b{batch}", model.eval(), inputs, False)

    return make


class LanguageModelLoss(nn.Module):
    """A `transformers` language model's loss with its own input ids as labels (a causal model's
    next-token loss, a masked model's loss on every token)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


def gpt2_small_train(quick: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=1, n_embd=64, n_head=4, vocab_size=1000) if quick else {}
    return GPT2LMHeadModel(GPT2Config(**size, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def llama_gqa_train(quick: bool) -> nn.Module:
    """The inference workload's LLaMA-style model (8 layers, width 512, GQA 8/2, SwiGLU)."""
    return llama_gqa(1, quick)[0].model


def bert_base_train(quick: bool) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    size = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=256) if quick else {}
    return BertForMaskedLM(BertConfig(**size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


TRAINING: dict[str, Callable[[bool], nn.Module]] = {
    "gpt2_small_train": gpt2_small_train, "llama_gqa_train": llama_gqa_train, "bert_base_train": bert_base_train,
}  # fmt: skip


def _training_factory(name: str) -> Callable[[bool], Workload | None]:
    def make(quick: bool) -> Workload | None:
        if not has_transformers():
            return None
        torch.manual_seed(0)
        model = TRAINING[name](quick)
        tokens = _tokens(TRAINING_BATCH, model.config.vocab_size, quick)
        return Workload(name, LanguageModelLoss(model).train(), (tokens,), True)

    return make


TRAINING_BATCH = 2

# The registry, model by model, each at batch 1 then 8 (`--models gpt2_small_b1,resnet50_b8`),
# then the training steps.
WORKLOADS: dict[str, Callable[[bool], Any]] = {
    **{f"{name}_b{batch}": _factory(name, batch) for name in MODELS for batch in BATCHES},
    **{name: _training_factory(name) for name in TRAINING},
}
