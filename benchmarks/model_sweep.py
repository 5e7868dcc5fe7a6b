"""A correctness sweep over Hugging Face `transformers` architectures built from tiny configs.

    PYTHONPATH=$PWD python -m benchmarks.model_sweep [--only NAME ...] [--no-train]

Each model (2 layers, hidden 64, vocab 500, random weights; nothing is downloaded) is
compiled with `torch.compile(model, backend="ember")` under strict mode (EMBER_STRICT=1:
a graph ember cannot compile raises instead of running eagerly) and checked twice against
eager run on a float64 copy of the model with the same inputs:

    inference  the first output under `torch.no_grad()` in eval mode
    training   one backward of a fixed random projection of that output (train mode, every
               dropout probability in the config set to 0), parameter gradients compared

Eager float32 is measured against the same float64 reference, so a mismatch can be told from
float32 rounding: a result is `wrong` only when ember's error passes the tolerance (rtol=atol=1e-4
on values scaled by the reference's largest magnitude) and is more than 10x eager float32's.
The table also gives dynamo graph breaks and ember's fallbacks (aten calls it has no lowering
for; not failures).
"""

from __future__ import annotations

import argparse
import copy
import os
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

BATCH, SEQ, VOCAB, HIDDEN = 2, 16, 500, 64
TOLERANCE = 1e-4


@dataclass
class Case:
    name: str
    make: Callable[[Any], torch.nn.Module]  # transformers module -> model (float32, random weights)
    inputs: Callable[[], dict[str, torch.Tensor]]


@dataclass
class Outcome:
    status: str = "skipped"  # ok / wrong / error / skipped
    detail: str = ""
    error: float = 0.0  # ember's largest scaled error against float64
    eager_error: float = 0.0  # eager float32's
    graph_breaks: int = 0
    fallbacks: Counter = field(default_factory=Counter)


def text_inputs(with_mask: bool = True) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        if not with_mask:
            return {"input_ids": ids}
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, -3:] = 0  # right padding in the second row
        return {"input_ids": ids, "attention_mask": mask}

    return make


def seq2seq_inputs() -> dict[str, torch.Tensor]:
    return {**text_inputs()(), "decoder_input_ids": torch.randint(0, VOCAB, (BATCH, SEQ // 2))}


def image_inputs() -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(BATCH, 3, 32, 32)}


def audio_inputs() -> dict[str, torch.Tensor]:
    return {"input_values": torch.randn(BATCH, 1600)}


def whisper_inputs() -> dict[str, torch.Tensor]:
    return {"input_features": torch.randn(BATCH, 16, 16), "decoder_input_ids": torch.randint(0, VOCAB, (BATCH, 8))}


def small(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments common to the tiny configs, with `overrides` for names that differ."""
    return {"vocab_size": VOCAB, **overrides}


def cases() -> list[Case]:
    decoder = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    decoder_kv = dict(decoder, num_key_value_heads=2, max_position_embeddings=64)
    encoder = dict(decoder, max_position_embeddings=64)

    def lm(config: str, model: str, **kwargs: Any) -> Callable[[Any], torch.nn.Module]:
        def make(t: Any) -> torch.nn.Module:
            settings = getattr(t, config)(**small(**kwargs))
            zero_dropout(settings)  # before the model is built: modules copy the probabilities
            return getattr(t, model)(settings)

        return make

    return [
        Case("distilbert", lm("DistilBertConfig", "DistilBertForMaskedLM", dim=HIDDEN, n_layers=2, n_heads=4,
                              hidden_dim=128, max_position_embeddings=64), text_inputs()),
        Case("roberta", lm("RobertaConfig", "RobertaForMaskedLM", **encoder), text_inputs()),
        Case("albert", lm("AlbertConfig", "AlbertForMaskedLM", embedding_size=32, **encoder), text_inputs()),
        Case("electra", lm("ElectraConfig", "ElectraForMaskedLM", embedding_size=32, **encoder), text_inputs()),
        Case("t5", lm("T5Config", "T5ForConditionalGeneration", d_model=HIDDEN, d_kv=16, d_ff=128, num_layers=2,
                      num_heads=4, relative_attention_num_buckets=8), seq2seq_inputs),
        Case("bart", lm("BartConfig", "BartForConditionalGeneration", d_model=HIDDEN, encoder_layers=1,
                        decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, max_position_embeddings=64), seq2seq_inputs),
        Case("gpt_neo", lm("GPTNeoConfig", "GPTNeoForCausalLM", hidden_size=HIDDEN, num_layers=2, num_heads=4,
                           attention_types=[[["global", "local"], 1]], window_size=8, max_position_embeddings=64),
             text_inputs()),
        Case("gptj", lm("GPTJConfig", "GPTJForCausalLM", n_embd=HIDDEN, n_layer=2, n_head=4, rotary_dim=8,
                        n_positions=64), text_inputs()),
        Case("opt", lm("OPTConfig", "OPTForCausalLM", hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                       ffn_dim=128, word_embed_proj_dim=HIDDEN, max_position_embeddings=64), text_inputs()),
        Case("bloom", lm("BloomConfig", "BloomForCausalLM", hidden_size=HIDDEN, n_layer=2, n_head=4), text_inputs()),
        Case("mistral", lm("MistralConfig", "MistralForCausalLM", sliding_window=8, **decoder_kv), text_inputs()),
        Case("qwen2", lm("Qwen2Config", "Qwen2ForCausalLM", **decoder_kv), text_inputs()),
        Case("phi", lm("PhiConfig", "PhiForCausalLM", partial_rotary_factor=0.5, **decoder_kv), text_inputs()),
        Case("falcon", lm("FalconConfig", "FalconForCausalLM", hidden_size=HIDDEN, num_hidden_layers=2,
                          num_attention_heads=4, new_decoder_architecture=False, multi_query=True), text_inputs()),
        Case("vit", lm("ViTConfig", "ViTForImageClassification", image_size=32, patch_size=8, num_labels=10,
                       **decoder), image_inputs),
        Case("wav2vec2", lm("Wav2Vec2Config", "Wav2Vec2ForCTC", conv_dim=(32, 32), conv_stride=(5, 2),
                            conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                            **decoder), audio_inputs),
        Case("whisper", lm("WhisperConfig", "WhisperForConditionalGeneration", d_model=HIDDEN, encoder_layers=1,
                           decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=8,
                           max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None),
             whisper_inputs),
        Case("gemma", lm("GemmaConfig", "GemmaForCausalLM", head_dim=16, **decoder_kv), text_inputs()),
        Case("mixtral", lm("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                           experts_implementation="eager", **decoder_kv), text_inputs()),
        Case("deberta_v2", lm("DebertaV2Config", "DebertaV2ForMaskedLM", **encoder), text_inputs()),
        Case("convnext", lm("ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[16, 32],
                            depths=[1, 1], num_stages=2, num_labels=10, image_size=32), image_inputs),
        Case("swin", lm("SwinConfig", "SwinForImageClassification", image_size=32, patch_size=4, embed_dim=16,
                        depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10), image_inputs),
    ]  # fmt: skip


def first_output(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output[0] if isinstance(output, tuple) else next(v for v in output.values() if isinstance(v, torch.Tensor))


def scaled_error(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-30) -> float:
    """The largest |got - want| over atol + rtol * |want|, atol scaled by want's largest magnitude (at
    least `floor`: a gradient that is zero up to rounding is measured on the model's gradient scale)."""
    scale = max(want.abs().max().item() if want.numel() else 0.0, floor)
    diff = (got.double() - want).abs()
    return (diff / (TOLERANCE * scale + TOLERANCE * want.abs())).max().item() if want.numel() else 0.0


def verdict(outcome: Outcome, ember_error: float, eager_error: float, what: str) -> None:
    outcome.error, outcome.eager_error = ember_error, eager_error
    if ember_error != ember_error or (ember_error > 1 and ember_error > 10 * eager_error):
        outcome.status, outcome.detail = (
            "wrong",
            f"{what}: error {ember_error:.3g}x tol (eager fp32 {eager_error:.3g}x)",
        )
    else:
        outcome.status = "ok"


def describe(error: BaseException) -> str:
    from ember.errors import EmberError

    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, EmberError):
            return f"ember[{cause.stage}{'/' + cause.op if cause.op else ''}]: {str(cause).splitlines()[0][:300]}"
        cause = cause.__cause__ or getattr(cause, "inner_exception", None)
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def run_compiled(model: torch.nn.Module, inputs: dict[str, torch.Tensor], outcome: Outcome, step: Callable) -> Any:
    from torch._dynamo.utils import counters

    import ember

    torch._dynamo.reset()
    counters.clear()
    ember.metrics.reset()
    try:
        return step(torch.compile(model, backend="ember"), inputs)
    except Exception as e:  # noqa: BLE001 - every failure is recorded, the sweep goes on
        outcome.status, outcome.detail = "error", describe(e)
        if os.environ.get("SWEEP_TRACEBACK"):
            traceback.print_exc()
        return None
    finally:
        outcome.graph_breaks = sum(counters["graph_break"].values())
        outcome.fallbacks = Counter(ember.metrics.fallback_ops)


def double_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}


def check_inference(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> Outcome:
    outcome, reference = Outcome(), copy.deepcopy(model).double()
    with torch.no_grad():
        want = first_output(reference(**double_inputs(inputs)))
        eager = first_output(model(**inputs))
        got = run_compiled(model, inputs, outcome, lambda m, x: first_output(m(**x)))
    if got is not None:
        verdict(outcome, scaled_error(got, want), scaled_error(eager, want), "output")
    return outcome


def gradients(model: torch.nn.Module, inputs: dict[str, torch.Tensor], weights: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = first_output(model(**inputs))
    (out * weights.to(out.dtype)).sum().backward()
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def check_training(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> Outcome:
    outcome = Outcome()
    model = copy.deepcopy(model).train()
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        shape = first_output(model(**inputs)).shape
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    want = gradients(reference, double_inputs(inputs), weights)
    eager = gradients(copy.deepcopy(model), inputs, weights)
    got = run_compiled(model, inputs, outcome, lambda m, x: gradients(m, x, weights))
    if got is not None:
        names = [n for n, _ in model.named_parameters()]
        floor = 1e-2 * max(w.abs().max().item() for w in want if w.numel())
        errors = [
            (scaled_error(g, w, floor), scaled_error(e, w, floor), n) for g, w, e, n in zip(got, want, eager, names)
        ]
        worst = max(errors, key=lambda t: t[0] if t[0] == t[0] else float("inf"))
        verdict(outcome, worst[0], max(e for _, e, _ in errors), f"grad {worst[2]}")
        if os.environ.get("SWEEP_VERBOSE"):
            for error, eager_error, name in sorted(errors, reverse=True)[: int(os.environ["SWEEP_VERBOSE"])]:
                print(f"  {name}: {error:.3g} (eager fp32 {eager_error:.3g})")
    return outcome


def zero_dropout(config: Any) -> None:
    for name, value in list(vars(config).items()):
        if isinstance(value, float) and any(
            word in name for word in ("dropout", "pdrop", "_prob", "layerdrop", "drop_path")
        ):
            setattr(config, name, 0.0)
    for sub in ("encoder", "decoder", "text_config", "vision_config"):
        if hasattr(config, sub) and hasattr(getattr(config, sub), "__dict__"):
            zero_dropout(getattr(config, sub))


def sweep(selected: list[Case], train: bool) -> list[tuple[str, Outcome, Outcome]]:
    import transformers

    rows = []
    for case in selected:
        torch.manual_seed(0)
        try:
            model = case.make(transformers)
        except Exception as e:  # noqa: BLE001 - a config this transformers version lacks
            rows.append((case.name, Outcome(detail=f"build: {describe(e)}"), Outcome()))
            continue
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        model.eval()
        inputs = case.inputs()
        try:
            inference = check_inference(model, inputs)
            training = check_training(model, inputs) if train else Outcome()
        except Exception as e:  # noqa: BLE001 - eager itself failed: a bad case, not an ember result
            rows.append((case.name, Outcome(detail=f"eager: {describe(e)}"), Outcome()))
            continue
        rows.append((case.name, inference, training))
        print(f"{case.name}: inference {inference.status} {inference.detail} | training {training.status} "
              f"{training.detail}", flush=True)  # fmt: skip
    return rows


def print_table(rows: list[tuple[str, Outcome, Outcome]]) -> None:
    print("\nerr: ember's largest error in tolerances (eager float32's in parentheses); breaks: inference/training")
    print(f"{'model':<11} {'inference':<9} {'err':>18} {'training':<9} {'err':>18} {'breaks':>6}  fallback ops")
    for name, inference, training in rows:
        fallbacks = inference.fallbacks + training.fallbacks
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(fallbacks.items())) or "-"
        breaks = f"{inference.graph_breaks}/{training.graph_breaks}"
        errors = [f"{o.error:.3g} ({o.eager_error:.3g})" for o in (inference, training)]
        print(f"{name:<11} {inference.status:<9} {errors[0]:>18} {training.status:<9} {errors[1]:>18} "
              f"{breaks:>6}  {ops}")  # fmt: skip
    problems = [(n, w, o) for n, i, t in rows for w, o in (("inference", i), ("training", t)) if o.detail]
    if problems:
        print("\nDetails:")
        for name, what, outcome in problems:
            print(f"  {name} {what}: {outcome.status}: {outcome.detail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="model names to run (default: all)")
    parser.add_argument("--no-train", action="store_true", help="inference only")
    args = parser.parse_args()
    os.environ["EMBER_STRICT"] = "1"
    all_cases = cases()
    selected = [c for c in all_cases if not args.only or c.name in args.only]
    if args.only and len(selected) != len(args.only):
        parser.error(f"unknown model; choose from {', '.join(c.name for c in all_cases)}")
    print_table(sweep(selected, train=not args.no_train))


if __name__ == "__main__":
    main()
