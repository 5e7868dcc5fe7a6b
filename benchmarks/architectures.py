"""Correctness over many architectures: tiny random-weight `transformers` models through ember.

    python -m benchmarks.architectures [NAME ...] [--modes infer,train,dyn,bf16] [--json out.json]

Each model (about 77: decoders, encoders, encoder-decoders, vision and speech models, mixtures of
experts, state-space models; nothing downloaded) runs in its own process, so a crash or a hang in
one does not end the sweep, under EMBER_STRICT=1 with a fresh cache, in up to three modes:
  infer   an eval forward;
  train   (about half of them) forward with a loss, backward: the loss, logits and every gradient;
  dyn     three eval calls at other (batch, source, target) sizes, the second of which makes dynamo
          recompile with symbolic shapes (decoders get left padding here);
  bf16    an eval forward under CPU autocast to bfloat16, eager's and ember's against float64.
The reference is the model copied to float64 and run eagerly; ember is flagged (WRONG) where its
error, relative to the reference's largest value, is above 1e-4 and more than 10 times eager
float32's. Where the float64 run gives a non-finite value that float32 eager does not, ember is
compared with float32 eager instead. One line per model and mode; per-model logs in a temporary
folder (printed at the end). A first run found three silent or crashing bugs that the model suite
never met: an as_strided extern's base reused while its view was read (Longformer), a symbolic
reshape of a channels-last tensor read as a view (PoolFormer, dynamic), a saved step slice
returned dense (Funnel, ProphetNet training).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

PER_MODE_LIMIT = 180
MODES = os.environ.get("EMBER_ARCHITECTURE_MODES", "infer,train,dyn,bf16").split(",")  # (--modes)
THREADS = int(os.environ.get("EMBER_ARCHITECTURE_THREADS", "1"))  # (--threads)
REL_TOL = 1e-4


# ----------------------------------------------------------------------------------------
# model zoo (built lazily in the child)
# ----------------------------------------------------------------------------------------

B, S, T, V = 2, 16, 12, 500  # batch, source length, target length, vocab; `dyn` mode changes B, S, T


DECODER_MASK = False
SIZES = [(2, 16, 12), (3, 11, 7), (2, 23, 9)]  # dyn mode: (batch, source len, target len) per call


def set_sizes(b, s, t):
    global B, S, T
    B, S, T = b, s, t


def _ids(gen, n=None, v=V):
    import torch

    return torch.randint(3, v, (B, S if n is None else n), generator=gen)


def _mask(n=None):
    import torch

    m = torch.ones(B, S if n is None else n, dtype=torch.long)
    m[1, -3:] = 0
    return m


def _img(gen, c=3, hw=32):
    import torch

    return torch.randn(B, c, hw, hw, generator=gen)


def zoo():
    import transformers as t

    dec = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        use_cache=False,
    )

    def causal(cfg_cls, model_cls, **kw):
        def build():
            return model_cls(cfg_cls(**kw))

        def inputs(gen, train):
            ids = _ids(gen)
            d = {"input_ids": ids}
            if DECODER_MASK:  # left padding on row 1
                m = _mask()
                m[1] = 0
                m[1, 3:] = 1
                d["attention_mask"] = m
            if train:
                d["labels"] = ids
            return d

        return build, inputs

    def encoder(cfg_cls, model_cls, mask=True, **kw):
        def build():
            return model_cls(cfg_cls(**kw))

        def inputs(gen, train):
            ids = _ids(gen)
            d = {"input_ids": ids}
            if mask:
                d["attention_mask"] = _mask()
            if train:
                d["labels"] = ids
            return d

        return build, inputs

    def seq2seq(cfg_cls, model_cls, **kw):
        def build():
            return model_cls(cfg_cls(**kw))

        def inputs(gen, train):
            ids = _ids(gen)
            d = {"input_ids": ids, "attention_mask": _mask()}
            tgt = _ids(gen, n=T)
            if train:
                d["labels"] = tgt
            else:
                d["decoder_input_ids"] = tgt
            return d

        return build, inputs

    def vision(cfg_cls, model_cls, hw=32, num_labels=None, **kw):
        def build():
            cfg = cfg_cls(**kw)
            if num_labels:
                cfg.num_labels = num_labels
            return model_cls(cfg)

        def inputs(gen, train):
            import torch

            d = {"pixel_values": _img(gen, hw=hw)}
            if train and num_labels:
                d["labels"] = torch.randint(0, num_labels, (B,), generator=gen)
            elif train:  # semantic segmentation (segformer: 2 labels by default)
                d["labels"] = torch.randint(0, 2, (B, hw, hw), generator=gen)
            return d

        return build, inputs

    bert_like = dict(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )

    M = {}
    # ---- decoders
    M["mistral"] = causal(t.MistralConfig, t.MistralForCausalLM, num_key_value_heads=2, sliding_window=8, **dec)
    M["qwen2"] = causal(t.Qwen2Config, t.Qwen2ForCausalLM, num_key_value_heads=2, **dec)
    M["phi"] = causal(t.PhiConfig, t.PhiForCausalLM, partial_rotary_factor=0.5, **dec)
    M["phi3"] = causal(t.Phi3Config, t.Phi3ForCausalLM, pad_token_id=0, **dec)
    M["gemma"] = causal(t.GemmaConfig, t.GemmaForCausalLM, num_key_value_heads=1, head_dim=16, **dec)
    M["gemma2"] = causal(
        t.Gemma2Config,
        t.Gemma2ForCausalLM,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        **dec,
    )
    M["falcon"] = causal(
        t.FalconConfig,
        t.FalconForCausalLM,
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        alibi=True,
        use_cache=False,
    )
    M["falcon_new"] = causal(
        t.FalconConfig,
        t.FalconForCausalLM,
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        new_decoder_architecture=True,
        num_kv_heads=2,
        use_cache=False,
    )
    M["gpt_neox"] = causal(t.GPTNeoXConfig, t.GPTNeoXForCausalLM, rotary_pct=0.25, use_parallel_residual=True, **dec)
    M["gptj"] = causal(
        t.GPTJConfig,
        t.GPTJForCausalLM,
        vocab_size=V,
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        n_positions=64,
        use_cache=False,
    )
    M["opt"] = causal(
        t.OPTConfig,
        t.OPTForCausalLM,
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=128,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
        use_cache=False,
    )
    M["bloom"] = causal(
        t.BloomConfig, t.BloomForCausalLM, vocab_size=V, hidden_size=64, n_layer=2, n_head=4, use_cache=False
    )
    M["codegen"] = causal(
        t.CodeGenConfig,
        t.CodeGenForCausalLM,
        vocab_size=V,
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        n_positions=64,
        n_ctx=64,
        use_cache=False,
    )
    M["gpt_bigcode"] = causal(
        t.GPTBigCodeConfig,
        t.GPTBigCodeForCausalLM,
        vocab_size=V,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        multi_query=True,
        use_cache=False,
    )
    # ---- encoders
    M["distilbert"] = encoder(
        t.DistilBertConfig,
        t.DistilBertForMaskedLM,
        vocab_size=V,
        dim=64,
        n_layers=2,
        n_heads=4,
        hidden_dim=128,
        max_position_embeddings=64,
    )
    M["roberta"] = encoder(t.RobertaConfig, t.RobertaForMaskedLM, pad_token_id=1, **bert_like)
    M["albert"] = encoder(t.AlbertConfig, t.AlbertForMaskedLM, embedding_size=32, **bert_like)
    M["electra"] = encoder(t.ElectraConfig, t.ElectraForMaskedLM, embedding_size=32, **bert_like)
    M["deberta_v2"] = encoder(
        t.DebertaV2Config,
        t.DebertaV2ForMaskedLM,
        relative_attention=True,
        position_buckets=8,
        max_relative_positions=16,
        pos_att_type=["p2c", "c2p"],
        norm_rel_ebd="layer_norm",
        share_att_key=True,
        **bert_like,
    )
    M["mpnet"] = encoder(t.MPNetConfig, t.MPNetForMaskedLM, **bert_like)
    # ---- encoder-decoder
    M["bart"] = seq2seq(
        t.BartConfig,
        t.BartForConditionalGeneration,
        vocab_size=V,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        use_cache=False,
    )
    M["marian"] = seq2seq(
        t.MarianConfig,
        t.MarianMTModel,
        vocab_size=V,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        pad_token_id=V - 1,
        decoder_start_token_id=V - 1,
        use_cache=False,
    )
    M["t5"] = seq2seq(
        t.T5Config,
        t.T5ForConditionalGeneration,
        vocab_size=V,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu",
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,
    )

    def whisper():
        def build():
            cfg = t.WhisperConfig(
                vocab_size=V,
                num_mel_bins=16,
                d_model=64,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=128,
                decoder_ffn_dim=128,
                max_source_positions=16,
                max_target_positions=32,
                pad_token_id=V - 1,
                decoder_start_token_id=V - 2,
                use_cache=False,
            )
            return t.WhisperForConditionalGeneration(cfg)

        def inputs(gen, train):
            import torch

            d = {"input_features": torch.randn(B, 16, 32, generator=gen)}
            tgt = _ids(gen, n=T, v=V - 3)
            if train:
                d["labels"] = tgt
            else:
                d["decoder_input_ids"] = tgt
            return d

        return build, inputs

    M["whisper"] = whisper()

    # CLIP's and SigLIP's two towers
    layers = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    text_and_vision = {
        "text_config": {**layers, "vocab_size": V, "max_position_embeddings": 32},
        "vision_config": {**layers, "image_size": 32, "patch_size": 8},
    }

    def clip():
        def build():
            cfg = t.CLIPConfig(
                **text_and_vision,
                projection_dim=32,
            )
            return t.CLIPModel(cfg)

        def inputs(gen, train):
            d = {"input_ids": _ids(gen), "attention_mask": _mask(), "pixel_values": _img(gen)}
            if train:
                d["return_loss"] = True
            return d

        return build, inputs

    M["clip"] = clip()
    # ---- vision
    M["swin"] = vision(
        t.SwinConfig,
        t.SwinForImageClassification,
        num_labels=5,
        image_size=32,
        patch_size=2,
        embed_dim=16,
        depths=[1, 2],
        num_heads=[2, 4],
        window_size=4,
    )
    M["deit"] = vision(
        t.DeiTConfig,
        t.DeiTForImageClassification,
        num_labels=5,
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )
    M["beit"] = vision(
        t.BeitConfig,
        t.BeitForImageClassification,
        num_labels=5,
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        use_relative_position_bias=True,
        use_mean_pooling=True,
        layer_scale_init_value=0.1,
    )
    M["mobilenet_v2"] = vision(
        t.MobileNetV2Config, t.MobileNetV2ForImageClassification, num_labels=5, image_size=32, depth_multiplier=0.25
    )
    M["efficientnet"] = vision(
        t.EfficientNetConfig,
        t.EfficientNetForImageClassification,
        num_labels=5,
        image_size=32,
        width_coefficient=0.25,
        depth_coefficient=0.25,
        hidden_dim=320,
    )
    M["regnet"] = vision(
        t.RegNetConfig,
        t.RegNetForImageClassification,
        num_labels=5,
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        groups_width=8,
    )
    M["segformer"] = vision(
        t.SegformerConfig,
        t.SegformerForSemanticSegmentation,
        hw=64,
        num_labels=None,
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[4, 2],
        hidden_sizes=[16, 32],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        decoder_hidden_size=32,
    )
    M["convnextv2"] = vision(
        t.ConvNextV2Config,
        t.ConvNextV2ForImageClassification,
        num_labels=5,
        num_channels=3,
        num_stages=2,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        image_size=32,
    )

    # ================= second batch =================
    M["llama_rope3"] = causal(
        t.LlamaConfig,
        t.LlamaForCausalLM,
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=True,
        **dec,
    )
    M["qwen3"] = causal(t.Qwen3Config, t.Qwen3ForCausalLM, num_key_value_heads=2, head_dim=16, **dec)
    M["qwen2_moe"] = causal(
        t.Qwen2MoeConfig,
        t.Qwen2MoeForCausalLM,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        output_router_logits=True,
        **dec,
    )
    M["mixtral"] = causal(
        t.MixtralConfig,
        t.MixtralForCausalLM,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        **dec,
    )
    M["cohere"] = causal(
        t.CohereConfig, t.CohereForCausalLM, num_key_value_heads=2, logit_scale=0.5, use_qk_norm=False, **dec
    )
    M["mpt"] = causal(
        t.MptConfig,
        t.MptForCausalLM,
        vocab_size=V,
        d_model=64,
        n_layers=2,
        n_heads=4,
        max_seq_len=64,
        expansion_ratio=2,
        use_cache=False,
    )
    M["gpt2"] = causal(
        t.GPT2Config,
        t.GPT2LMHeadModel,
        vocab_size=V,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        scale_attn_by_inverse_layer_idx=True,
        reorder_and_upcast_attn=True,
        use_cache=False,
    )
    M["gpt_neo"] = causal(
        t.GPTNeoConfig,
        t.GPTNeoForCausalLM,
        vocab_size=V,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
        max_position_embeddings=64,
        use_cache=False,
    )
    M["starcoder2"] = causal(
        t.Starcoder2Config, t.Starcoder2ForCausalLM, num_key_value_heads=2, sliding_window=8, **dec
    )
    M["stablelm"] = causal(
        t.StableLmConfig,
        t.StableLmForCausalLM,
        num_key_value_heads=2,
        qk_layernorm=True,
        partial_rotary_factor=0.25,
        use_parallel_residual=True,
        **dec,
    )
    M["olmo"] = causal(t.OlmoConfig, t.OlmoForCausalLM, num_key_value_heads=2, clip_qkv=2.0, **dec)
    M["nemotron"] = causal(
        t.NemotronConfig, t.NemotronForCausalLM, num_key_value_heads=2, partial_rotary_factor=0.5, **dec
    )
    M["granite"] = causal(
        t.GraniteConfig,
        t.GraniteForCausalLM,
        num_key_value_heads=2,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
        **dec,
    )
    M["gemma3_text"] = causal(
        t.Gemma3TextConfig,
        t.Gemma3ForCausalLM,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        sliding_window_pattern=2,
        layer_types=["sliding_attention", "full_attention"],
        **dec,
    )
    M["recurrent_gemma"] = causal(
        t.RecurrentGemmaConfig,
        t.RecurrentGemmaForCausalLM,
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        lru_width=64,
        attention_window_size=8,
        conv1d_width=4,
        block_types=["recurrent", "attention"],
        use_cache=False,
    )
    M["mamba"] = causal(
        t.MambaConfig,
        t.MambaForCausalLM,
        vocab_size=V,
        hidden_size=64,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        use_cache=False,
    )
    M["rwkv"] = causal(
        t.RwkvConfig,
        t.RwkvForCausalLM,
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        attention_hidden_size=64,
        intermediate_size=128,
        context_length=64,
        use_cache=False,
    )
    M["biogpt"] = causal(t.BioGptConfig, t.BioGptForCausalLM, **dec)
    M["xglm"] = causal(
        t.XGLMConfig,
        t.XGLMForCausalLM,
        vocab_size=V,
        d_model=64,
        num_layers=2,
        attention_heads=4,
        ffn_dim=128,
        max_position_embeddings=64,
        use_cache=False,
    )
    # encoders
    M["fnet"] = encoder(
        t.FNetConfig,
        t.FNetForMaskedLM,
        mask=False,
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    M["funnel"] = encoder(
        t.FunnelConfig,
        t.FunnelForMaskedLM,
        vocab_size=V,
        block_sizes=[1, 1],
        block_repeats=[1, 1],
        d_model=64,
        n_head=4,
        d_head=16,
        d_inner=128,
        num_decoder_layers=1,
    )
    M["xlnet"] = encoder(
        t.XLNetConfig,
        t.XLNetLMHeadModel,
        mask=True,
        vocab_size=V,
        d_model=64,
        n_layer=2,
        n_head=4,
        d_inner=128,
        use_mems_eval=False,
        use_mems_train=False,
    )
    M["convbert"] = encoder(
        t.ConvBertConfig, t.ConvBertForMaskedLM, embedding_size=64, conv_kernel_size=5, head_ratio=2, **bert_like
    )
    M["squeezebert"] = encoder(
        t.SqueezeBertConfig,
        t.SqueezeBertForMaskedLM,
        embedding_size=64,
        q_groups=2,
        k_groups=2,
        v_groups=2,
        post_attention_groups=2,
        intermediate_groups=4,
        output_groups=4,
        **bert_like,
    )
    M["longformer"] = encoder(
        t.LongformerConfig, t.LongformerForMaskedLM, attention_window=4, pad_token_id=1, **bert_like
    )
    M["big_bird"] = encoder(t.BigBirdConfig, t.BigBirdForMaskedLM, attention_type="original_full", **bert_like)
    # encoder-decoder
    M["pegasus"] = seq2seq(
        t.PegasusConfig,
        t.PegasusForConditionalGeneration,
        vocab_size=V,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        use_cache=False,
    )
    M["m2m100"] = seq2seq(
        t.M2M100Config,
        t.M2M100ForConditionalGeneration,
        vocab_size=V,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        use_cache=False,
    )
    M["prophetnet"] = seq2seq(
        t.ProphetNetConfig,
        t.ProphetNetForConditionalGeneration,
        vocab_size=V,
        hidden_size=64,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_encoder_layers=2,
        num_decoder_layers=2,
        num_encoder_attention_heads=4,
        num_decoder_attention_heads=4,
        ngram=2,
        num_buckets=8,
        relative_max_distance=16,
        max_position_embeddings=64,
        use_cache=False,
    )
    M["long_t5"] = seq2seq(
        t.LongT5Config,
        t.LongT5ForConditionalGeneration,
        vocab_size=V,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        local_radius=4,
        encoder_attention_type="transient-global",
        global_block_size=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,
    )
    M["switch"] = seq2seq(
        t.SwitchTransformersConfig,
        t.SwitchTransformersForConditionalGeneration,
        vocab_size=V,
        d_model=64,
        d_kv=16,
        d_ff=128,
        expert_capacity=32,
        num_layers=2,
        num_sparse_encoder_layers=1,
        num_decoder_layers=2,
        num_sparse_decoder_layers=1,
        num_heads=4,
        num_experts=4,
        relative_attention_num_buckets=8,
        router_jitter_noise=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,
    )
    # vision
    M["vit"] = vision(
        t.ViTConfig,
        t.ViTForImageClassification,
        num_labels=5,
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )
    M["dinov2"] = vision(
        t.Dinov2Config,
        t.Dinov2ForImageClassification,
        num_labels=5,
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        mlp_ratio=2,
        layerscale_value=0.5,
        use_swiglu_ffn=True,
    )
    M["levit"] = vision(
        t.LevitConfig,
        t.LevitForImageClassification,
        num_labels=5,
        image_size=64,
        hw=64,
        hidden_sizes=[32, 48, 64],
        num_attention_heads=[1, 2, 2],
        depths=[1, 1, 1],
        key_dim=[8, 8, 8],
        down_ops=[["Subsample", 8, 1, 4, 2, 2], ["Subsample", 8, 2, 4, 2, 2]],
    )
    M["mobilevit"] = vision(
        t.MobileViTConfig,
        t.MobileViTForImageClassification,
        num_labels=5,
        image_size=64,
        hw=64,
        hidden_sizes=[32, 48, 64],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
        patch_size=2,
        num_attention_heads=2,
    )
    M["poolformer"] = vision(
        t.PoolFormerConfig,
        t.PoolFormerForImageClassification,
        num_labels=5,
        depths=[1, 1, 1, 1],
        hidden_sizes=[8, 16, 24, 32],
    )
    M["cvt"] = vision(
        t.CvtConfig,
        t.CvtForImageClassification,
        num_labels=5,
        embed_dim=[16, 32],
        num_heads=[1, 2],
        depth=[1, 2],
        patch_sizes=[7, 3],
        patch_stride=[4, 2],
        patch_padding=[2, 1],
        mlp_ratio=[2.0, 2.0],
        attention_drop_rate=[0.0, 0.0],
        drop_rate=[0.0, 0.0],
        drop_path_rate=[0.0, 0.0],
        qkv_bias=[True, True],
        cls_token=[False, True],
        qkv_projection_method=["dw_bn", "dw_bn"],
        kernel_qkv=[3, 3],
        padding_kv=[1, 1],
        stride_kv=[2, 2],
        padding_q=[1, 1],
        stride_q=[1, 1],
    )
    M["resnet"] = vision(
        t.ResNetConfig,
        t.ResNetForImageClassification,
        num_labels=5,
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="bottleneck",
        downsample_in_bottleneck=True,
    )
    M["convnext"] = vision(
        t.ConvNextConfig,
        t.ConvNextForImageClassification,
        num_labels=5,
        num_stages=2,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_scale_init_value=0.5,
    )
    M["focalnet"] = vision(
        t.FocalNetConfig,
        t.FocalNetForImageClassification,
        num_labels=5,
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        focal_levels=[2, 2],
        focal_windows=[3, 3],
        use_post_layernorm_in_modulation=True,
        use_layerscale=True,
    )
    M["pvt_v2"] = vision(
        t.PvtV2Config,
        t.PvtV2ForImageClassification,
        num_labels=5,
        image_size=32,
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
    )

    def siglip():
        def build():
            cfg = t.SiglipConfig(
                **text_and_vision,
            )
            return t.SiglipModel(cfg)

        def inputs(gen, train):
            d = {"input_ids": _ids(gen), "pixel_values": _img(gen)}
            if train:
                d["return_loss"] = True
            return d

        return build, inputs

    M["siglip"] = siglip()

    def audio(cfg_cls, model_cls, ctc=False, **kw):
        def build():
            return model_cls(cfg_cls(**kw))

        def inputs(gen, train):
            import torch

            d = {"input_values": torch.randn(B, 400 + 37 * (S - 16), generator=gen)}
            if train and ctc:
                d["labels"] = torch.randint(1, 20, (B, 5), generator=gen)
            return d

        return build, inputs

    w2v = dict(
        vocab_size=20,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(16, 16, 16),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
        mask_time_prob=0.0,
        ctc_loss_reduction="mean",
        pad_token_id=0,
    )
    M["wav2vec2"] = audio(t.Wav2Vec2Config, t.Wav2Vec2ForCTC, ctc=True, feat_extract_norm="group", **w2v)
    M["hubert"] = audio(
        t.HubertConfig,
        t.HubertForCTC,
        ctc=True,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
        conv_bias=True,
        **w2v,
    )
    return M


TRAIN = {
    "mistral",
    "phi",
    "gemma2",
    "falcon",
    "gpt_neox",
    "opt",
    "bloom",
    "gpt_bigcode",
    "distilbert",
    "albert",
    "deberta_v2",
    "t5",
    "bart",
    "whisper",
    "clip",
    "swin",
    "mobilenet_v2",
    "convnextv2",
    "segformer",
    "qwen2_moe",
    "mixtral",
    "recurrent_gemma",
    "mamba",
    "rwkv",
    "funnel",
    "xlnet",
    "convbert",
    "longformer",
    "long_t5",
    "switch",
    "prophetnet",
    "dinov2",
    "levit",
    "mobilevit",
    "resnet",
    "focalnet",
    "siglip",
    "wav2vec2",
    "hubert",
    "gpt_neo",
    "olmo",
}

ORDER = [
    "mistral",
    "qwen2",
    "phi",
    "phi3",
    "gemma",
    "gemma2",
    "falcon",
    "falcon_new",
    "gpt_neox",
    "gptj",
    "opt",
    "bloom",
    "codegen",
    "gpt_bigcode",
    "distilbert",
    "roberta",
    "albert",
    "electra",
    "deberta_v2",
    "mpnet",
    "bart",
    "marian",
    "t5",
    "whisper",
    "clip",
    "swin",
    "deit",
    "beit",
    "mobilenet_v2",
    "efficientnet",
    "regnet",
    "segformer",
    "convnextv2",
]
ORDER2 = [
    "llama_rope3",
    "qwen3",
    "qwen2_moe",
    "mixtral",
    "cohere",
    "mpt",
    "gpt2",
    "gpt_neo",
    "starcoder2",
    "stablelm",
    "olmo",
    "nemotron",
    "granite",
    "gemma3_text",
    "recurrent_gemma",
    "mamba",
    "rwkv",
    "biogpt",
    "xglm",
    "fnet",
    "funnel",
    "xlnet",
    "convbert",
    "squeezebert",
    "longformer",
    "big_bird",
    "pegasus",
    "m2m100",
    "prophetnet",
    "long_t5",
    "switch",
    "vit",
    "dinov2",
    "levit",
    "mobilevit",
    "poolformer",
    "cvt",
    "resnet",
    "convnext",
    "focalnet",
    "pvt_v2",
    "siglip",
    "wav2vec2",
    "hubert",
]


# ----------------------------------------------------------------------------------------
# child: checks for one model
# ----------------------------------------------------------------------------------------


def zero_dropout(cfg):
    """Every dropout-like float in a config (and its sub-configs) set to 0."""
    from transformers import PretrainedConfig

    for k, v in list(vars(cfg).items()):
        if isinstance(v, PretrainedConfig):
            zero_dropout(v)
        elif isinstance(v, float) and any(s in k for s in ("dropout", "pdrop", "drop_path", "layerdrop", "drop_rate")):
            setattr(cfg, k, 0.0)


def tensors_of(out):
    """The floating tensors of a model output, flattened with names."""
    import torch

    res = []

    def walk(x, name):
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                res.append((name, x))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{name}.{k}" if name else k)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{name}[{i}]")
        elif hasattr(x, "to_tuple"):
            walk(dict(x.items()), name)

    walk(out, "")
    return res


def rel_err(x, ref, floor=0.0):
    """max|x - ref| / max(max|ref|, floor); floor keeps analytically-zero gradients (f64 noise ~1e-20) from
    turning float32 rounding into huge relative errors."""
    import torch

    x = x.detach().double()
    ref = ref.detach().double()
    if x.shape != ref.shape:
        return float("inf"), f"shape {tuple(x.shape)} vs {tuple(ref.shape)}"
    fin_x, fin_r = torch.isfinite(x), torch.isfinite(ref)
    if not torch.equal(fin_x, fin_r):
        return float("inf"), f"nonfinite mismatch ({int((~fin_x).sum())} vs {int((~fin_r).sum())})"
    if not bool(fin_r.any()):
        return 0.0, ""
    scale = ref[fin_r].abs().max().item()
    err = (x[fin_r] - ref[fin_r]).abs().max().item()
    return err / max(scale, floor, 1e-30), ""


def _finite_max(x):
    """The largest finite |x| (0 if none): the scale of a gradient whose float64 run overflowed somewhere."""
    import torch

    finite = x.detach()[torch.isfinite(x.detach())]
    return finite.abs().max().item() if finite.numel() else 0.0


def cast_inputs(inputs, dtype):
    import torch

    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inputs.items()}


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout(f"mode took more than {PER_MODE_LIMIT}s")


def flag(ember_e, eager_e):
    return ember_e > REL_TOL and ember_e > 10 * eager_e and ember_e > 1e-5


def run64(m64, inputs, backward=False):
    """The float64 reference, with float64 as the default dtype (xglm builds torch.full(finfo(f64).min) in
    the default dtype)."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = m64(**inputs)
        if backward:
            out.loss.backward()
    finally:
        torch.set_default_dtype(old)
    return out


def f64_copy(model):

    m64 = copy.deepcopy(model).double()
    cfg = getattr(m64, "config", None)
    if cfg is not None and getattr(cfg, "_experts_implementation", None) not in (None, "eager", "batched_mm"):
        cfg._experts_implementation = "batched_mm"  # grouped_mm has no float64 kernel
    return m64


def check(name, build, make_inputs, mode):
    train = mode == "train"
    import torch

    import ember

    ember.metrics.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = build()
    if train:
        if getattr(model, "config", None) is not None:
            zero_dropout(model.config)
        for m in model.modules():
            if isinstance(m, torch.nn.modules.dropout._DropoutNd):
                m.p = 0.0
            for k, v in list(vars(m).items()):  # float attributes read by functional dropout / drop path
                if isinstance(v, float) and "drop" in k.lower():
                    setattr(m, k, 0.0)
        model.train()
    else:
        model.eval()
    gen = torch.Generator().manual_seed(1)
    inputs = make_inputs(gen, train)
    m64 = f64_copy(model)
    m_eager = copy.deepcopy(model)
    m_ember = copy.deepcopy(model)
    in64 = cast_inputs(inputs, torch.float64)
    res = {"name": name, "mode": mode}

    if mode == "dyn":
        global DECODER_MASK
        DECODER_MASK = True
        cm = torch.compile(m_ember, backend="ember")
        pairs = []
        t0 = time.time()
        try:
            for i, sz in enumerate(SIZES):
                set_sizes(*sz)
                inp = make_inputs(gen, False)
                i64 = cast_inputs(inp, torch.float64)
                with torch.no_grad():
                    ref = tensors_of(run64(m64, i64))
                    eag = tensors_of(m_eager(**inp))
                    got = tensors_of(cm(**inp))
                if len(got) != len(ref):
                    res["note"] = f"call {i}: {len(got)} outputs vs {len(ref)}"
                pairs += [((f"call{i}{sz}:{a[0]}", a[1]), b, c) for a, b, c in zip(ref, eag, got)]
        finally:
            DECODER_MASK = False
            set_sizes(*SIZES[0])
        res["compile_s"] = round(time.time() - t0, 1)
    elif mode == "bf16":  # CPU autocast: eager's and ember's bfloat16 results against float64
        with torch.no_grad():
            ref = tensors_of(run64(m64, in64))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                eag = tensors_of(m_eager(**inputs))
                t0 = time.time()
                got = tensors_of(torch.compile(m_ember, backend="ember")(**inputs))
                res["compile_s"] = round(time.time() - t0, 1)
        pairs = list(zip(ref, eag, got))
        if len(got) != len(ref):
            res["note"] = f"{len(got)} outputs vs {len(ref)}"
    elif not train:
        with torch.no_grad():
            ref = tensors_of(run64(m64, in64))
            eag = tensors_of(m_eager(**inputs))
            t0 = time.time()
            cm = torch.compile(m_ember, backend="ember")
            got = tensors_of(cm(**inputs))
            res["compile_s"] = round(time.time() - t0, 1)
            # second call: the cached/compiled path again
            got2 = tensors_of(cm(**inputs))
        pairs = list(zip(ref, eag, got))
        if len(got) != len(ref):
            res["note"] = f"{len(got)} outputs vs {len(ref)}"
        if len(got2) == len(got):
            rerun = max((rel_err(a[1], b[1])[0] for a, b in zip(got2, got)), default=0.0)
            if rerun > 0:
                res["rerun_diff"] = rerun
    else:
        out64 = run64(m64, in64, backward=True)
        oe = m_eager(**inputs)
        oe.loss.backward()
        # determinism check of eager f32 (dropout really off?)
        chk = copy.deepcopy(model)
        oc = chk(**inputs)
        if not torch.equal(oc.loss, oe.loss):
            res["note"] = "eager f32 not deterministic (dropout on?)"
        t0 = time.time()
        cm = torch.compile(m_ember, backend="ember")
        og = cm(**inputs)
        og.loss.backward()
        res["compile_s"] = round(time.time() - t0, 1)
        pairs = [(("loss", out64.loss), ("loss", oe.loss), ("loss", og.loss))]
        # also the main output (logits) of the training forward
        for key in ("logits", "logits_per_image"):
            if key in out64 and out64[key] is not None:
                pairs.append(((key, out64[key]), (key, oe[key]), (key, og[key])))
        n_nograd = 0
        for (pn, p64), pe, pg in zip(m64.named_parameters(), m_eager.parameters(), m_ember.parameters()):
            if p64.grad is None:
                if pg.grad is not None and pg.grad.abs().max() > 0:
                    res.setdefault("grad_extra", []).append(pn)
                continue
            if pg.grad is None:
                n_nograd += 1
                res.setdefault("grad_missing", []).append(pn)
                continue
            pairs.append(((f"grad:{pn}", p64.grad), (pn, pe.grad), (pn, pg.grad)))
    return summarize(res, pairs)


def summarize(res, pairs):
    """Fill `res` from (reference, eager, ember) pairs of named tensors: the worst error, the flagged
    pairs, ember's metrics and dynamo's graph breaks, and the status (WRONG where any pair is flagged
    or a gradient is missing). Shared with benchmarks/timm_sweep.py."""
    worst = None
    flagged = []
    # a gradient's (or a running statistic's) error is relative to at least 1e-3 of the largest of its kind:
    # one that is analytically zero is float64 noise (~1e-20), against which float32 rounding looks huge
    scales = {
        kind: max((_finite_max(r) for (rn, r), _, _ in pairs if rn.startswith(kind)), default=0.0)
        for kind in ("grad:", "buffer:")
    }
    for (rn, r), (_, e), (_, g) in pairs:
        floor = next((1e-3 * scale for kind, scale in scales.items() if rn.startswith(kind)), 0.0)
        ge, gnote = rel_err(g, r, floor)
        ee, enote = rel_err(e, r, floor)
        if gnote.startswith("nonfinite") and enote.startswith("nonfinite"):
            # the float64 reference itself has NaN/inf where float32 eager has none (e.g. a fully masked row
            # with finfo(float64).min): compare ember with eager float32 instead
            ge, gnote = rel_err(g, e, floor)
            ee = 0.0
            rn = rn + "(vs eager f32: f64 ref nonfinite)"
            res["ref_nonfinite"] = res.get("ref_nonfinite", 0) + 1
        if worst is None or ge > worst[1]:
            worst = (rn, ge, ee)
        if gnote or flag(ge, ee):
            flagged.append((rn, ge, ee, gnote))
    from torch._dynamo.utils import counters

    import ember

    mt = ember.metrics
    res["ember"] = {
        "graphs": mt.graphs_compiled,
        "failed": mt.graphs_failed,
        "kernels": mt.kernels_generated,
        "fallback_ops": dict(mt.fallback_ops),
        "symbolic_fallbacks": dict(mt.symbolic_fallbacks),
    }
    res["graph_breaks"] = sum(counters["graph_break"].values())
    res["worst"] = worst
    res["n_compared"] = len(pairs)
    flagged.sort(key=lambda x: -x[1])
    res["flagged"] = flagged[:6]
    res["n_flagged"] = len(flagged)
    res["status"] = "WRONG" if flagged or res.get("grad_missing") else "ok"
    return res


def child(name):
    import torch

    torch.set_num_threads(THREADS)
    import transformers

    transformers.logging.set_verbosity_error()
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    M = zoo()
    build, make_inputs = M[name]
    modes = [m for m in MODES if m != "train" or name in TRAIN]
    run_modes(name, modes, lambda mode: check(name, build, make_inputs, mode))


def run_modes(name, modes, check_mode):
    """Each mode under PER_MODE_LIMIT with dynamo reset before it; one `RESULT {json}` line per mode on
    stdout, a crash's traceback on stderr. Shared with benchmarks/timm_sweep.py."""
    import torch

    signal.signal(signal.SIGALRM, _alarm)
    for mode in modes:
        torch._dynamo.reset()
        t0 = time.time()
        signal.alarm(PER_MODE_LIMIT)
        try:
            res = check_mode(mode)
        except Timeout as e:
            res = {"name": name, "mode": mode, "status": "SKIP", "error": str(e)}
        except Exception as e:
            tb = traceback.format_exc()
            print(tb, file=sys.stderr)
            msg = str(e).strip().splitlines()
            res = {
                "name": name,
                "mode": mode,
                "status": "CRASH",
                "error": f"{type(e).__name__}: {msg[0][:300] if msg else ''}",
                "ember_frames": [ln.strip() for ln in tb.splitlines() if "/ember/" in ln and "File" in ln][-4:],
            }
        finally:
            signal.alarm(0)
        res["secs"] = round(time.time() - t0, 1)
        print("RESULT " + json.dumps(res, default=str), flush=True)


# ----------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------


def fmt(res):
    st = res["status"]
    head = f"{res['name']:13s} {res['mode']:5s} {st:5s} {res.get('secs', 0):6.1f}s"
    if st in ("ok", "WRONG") and res.get("worst"):
        wn, ge, ee = res["worst"]
        precision = "bf16" if res["mode"] == "bf16" else "f32"
        head += f"  worst ember {ge:.1e} (eager {precision} {ee:.1e}) at {wn}"
        if res.get("n_flagged"):
            head += f"  | {res['n_flagged']}/{res['n_compared']} flagged: " + "; ".join(
                f"{n} ember {g:.1e} eager {e:.1e} {note}" for n, g, e, note in res["flagged"][:3]
            )
        em = res.get("ember", {})
        head += f"  [graphs {em.get('graphs')} kern {em.get('kernels')} breaks {res.get('graph_breaks')}"
        head += f" fb {em['fallback_ops']}]" if em.get("fallback_ops") else "]"
        if em.get("failed"):
            head += f" EMBER_FAILED={em['failed']}"
        if em.get("symbolic_fallbacks"):
            head += f"  per-shape: {em['symbolic_fallbacks']}"
        for k in ("grad_missing", "grad_extra", "note", "rerun_diff", "ref_nonfinite"):
            if res.get(k):
                head += f"  {k}={res[k]}"
    else:
        head += f"  {res.get('error', '')}"
        if res.get("ember_frames"):
            head += "\n" + " " * 16 + " <- ".join(reversed(res["ember_frames"]))
    return head


def driver(names, json_path=None):
    def n_modes(name):
        return len([m for m in MODES if m != "train" or name in TRAIN])

    command = [sys.executable, os.path.abspath(__file__), "--child"]
    run_children(names, command, n_modes, json_path, "architectures", THREADS)


def run_children(names, child_command, n_modes, json_path, label, threads):
    """Each model in a process of its own (`child_command + [name]`) under EMBER_STRICT=1 with a fresh
    cache; its RESULT lines printed as they come, a child that died or hung reported as a crash. Shared
    with benchmarks/timm_sweep.py."""
    logdir = tempfile.mkdtemp(prefix=f"ember_{label}_")
    allres = []
    t_all = time.time()
    for name in names:
        env = dict(
            os.environ,
            EMBER_STRICT="1",
            OMP_NUM_THREADS=str(threads),
            EMBER_CACHE_DIR=tempfile.mkdtemp(prefix=f"ember_sweep_{name}_"),
        )
        try:
            p = subprocess.run(
                child_command + [name],
                env=env,
                capture_output=True,
                text=True,
                timeout=PER_MODE_LIMIT * n_modes(name) + 120,
            )
            out, err, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = "timeout"
        with open(os.path.join(logdir, f"{name}.log"), "w") as f:
            f.write(out + "\n---- stderr ----\n" + err)
        results = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
        if not results or len(results) < n_modes(name):
            lastlines = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or [""]
            results.append(
                {"name": name, "mode": "?", "status": "CRASH", "error": f"child exited rc={rc}: {lastlines[0][:300]}"}
            )
        for r in results:
            print(fmt(r), flush=True)
            allres.append(r)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(allres, f, indent=1, default=str)
    print(f"total {time.time() - t_all:.0f}s; logs in {logdir}", flush=True)
    return allres


def parse_sweep_args(prog: str, doc: str, known_names: list, known_modes: tuple, modes: list, threads: int,
                     env_prefix: str):  # fmt: skip
    """A sweep's command line (model names, --json, --modes, --threads), checked; the modes and threads
    exported as EMBER_<env_prefix>_MODES and _THREADS, which its children read."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"models (default: all {len(known_names)})")
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--modes", default=",".join(modes), help="among " + ",".join(known_modes))
    parser.add_argument("--threads", type=int, default=threads, help="torch's threads in each model's process")
    args = parser.parse_args()
    if set(args.modes.split(",")) - set(known_modes):
        parser.error(f"unknown modes in {args.modes!r}")
    unknown = [n for n in args.names if n not in known_names]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {' '.join(known_names)}")
    os.environ[f"EMBER_{env_prefix}_MODES"] = args.modes
    os.environ[f"EMBER_{env_prefix}_THREADS"] = str(args.threads)
    return args


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        args = parse_sweep_args("python -m benchmarks.architectures", __doc__, ORDER + ORDER2,
                                ("infer", "train", "dyn", "bf16"), MODES, THREADS, "ARCHITECTURE")  # fmt: skip
        MODES[:] = args.modes.split(",")
        THREADS = args.threads
        driver(args.names or ORDER + ORDER2, args.json)
