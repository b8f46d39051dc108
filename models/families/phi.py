"""Phi-2 (LayerNorm, parallel attention and MLP, partial rotary, biases everywhere) and
Phi-3 / Phi-3.5 / Phi-4 (Llama with fused qkv and gate_up projections, longrope scaling)."""

from __future__ import annotations

from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import DOWN_RULE, FUSED_GATE_UP_RULE, GLOBAL_RULES, LAYER
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.weights import WeightRule


def phi2_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    norm = NormConfig("layer", float(hf.get("layer_norm_eps", 1e-5)))
    return llama_like(
        hf,
        attention={
            "qkv_bias": True,
            "o_bias": True,
            "qk_norm": norm if hf.get("qk_layernorm") else None,
        },
        norm=norm,
        activation=hf.get("hidden_act", "gelu_new"),
        gated_mlp=False,
        mlp_bias=True,
        parallel_residual=True,
        lm_head_bias=True,
    )


def phi3_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    window = hf.get("sliding_window")
    num_layers = int(hf["num_hidden_layers"])
    return llama_like(
        hf,
        attention={"sliding_window": int(window) if window else None},
        sliding_layers=(True,) * num_layers if window else (),
    )


PHI2_WEIGHT_RULES = (
    WeightRule(r"model\.embed_tokens\.weight", "embed"),
    WeightRule(r"model\.final_layernorm\.weight", "final_norm"),
    WeightRule(r"model\.final_layernorm\.bias", "final_norm_b"),
    WeightRule(r"lm_head\.weight", "lm_head", transpose=True),
    WeightRule(r"lm_head\.bias", "lm_head_b"),
    WeightRule(LAYER + r"input_layernorm\.weight", "attn_norm", per_layer=True),
    WeightRule(LAYER + r"input_layernorm\.bias", "attn_norm_b", per_layer=True),
    WeightRule(LAYER + r"self_attn\.q_proj\.weight", "wq", transpose=True, per_layer=True),
    WeightRule(LAYER + r"self_attn\.k_proj\.weight", "wk", transpose=True, per_layer=True),
    WeightRule(LAYER + r"self_attn\.v_proj\.weight", "wv", transpose=True, per_layer=True),
    WeightRule(LAYER + r"self_attn\.dense\.weight", "wo", transpose=True, per_layer=True),
    WeightRule(LAYER + r"self_attn\.q_proj\.bias", "bq", per_layer=True),
    WeightRule(LAYER + r"self_attn\.k_proj\.bias", "bk", per_layer=True),
    WeightRule(LAYER + r"self_attn\.v_proj\.bias", "bv", per_layer=True),
    WeightRule(LAYER + r"self_attn\.dense\.bias", "bo", per_layer=True),
    WeightRule(LAYER + r"self_attn\.q_layernorm\.weight", "q_norm", per_layer=True),
    WeightRule(LAYER + r"self_attn\.q_layernorm\.bias", "q_norm_b", per_layer=True),
    WeightRule(LAYER + r"self_attn\.k_layernorm\.weight", "k_norm", per_layer=True),
    WeightRule(LAYER + r"self_attn\.k_layernorm\.bias", "k_norm_b", per_layer=True),
    WeightRule(LAYER + r"mlp\.fc1\.weight", "w_up", transpose=True, per_layer=True),
    WeightRule(LAYER + r"mlp\.fc1\.bias", "b_up", per_layer=True),
    WeightRule(LAYER + r"mlp\.fc2\.weight", "w_down", transpose=True, per_layer=True),
    WeightRule(LAYER + r"mlp\.fc2\.bias", "b_down", per_layer=True),
)
PHI3_WEIGHT_RULES = (
    *GLOBAL_RULES,
    WeightRule(LAYER + r"input_layernorm\.weight", "attn_norm", per_layer=True),
    WeightRule(
        LAYER + r"self_attn\.qkv_proj\.weight", ("wq", "wk", "wv"), transpose=True, per_layer=True
    ),
    WeightRule(LAYER + r"self_attn\.o_proj\.weight", "wo", transpose=True, per_layer=True),
    WeightRule(LAYER + r"post_attention_layernorm\.weight", "mlp_norm", per_layer=True),
    FUSED_GATE_UP_RULE,
    DOWN_RULE,
)
