"""GLM-4 (``Glm4ForCausalLM``): biased q/k/v, norms after attention and after the MLP, a fused
gate_up projection, and rope on half of each head rotating adjacent pairs."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import (
    ATTENTION_RULES,
    DOWN_RULE,
    FUSED_GATE_UP_RULE,
    GLOBAL_RULES,
    LAYER,
)
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.weights import WeightRule


def glm4_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    cfg = llama_like(
        {"partial_rotary_factor": 0.5, **hf},
        attention={"qkv_bias": bool(hf.get("attention_bias", True)), "o_bias": False},
        sandwich_norms=True,
    )
    rope = dataclasses.replace(cfg.attention.rope, interleaved=True)
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, rope=rope))


GLM4_WEIGHT_RULES = (
    *GLOBAL_RULES,
    *ATTENTION_RULES,
    WeightRule(LAYER + r"post_self_attn_layernorm\.weight", "attn_post_norm", per_layer=True),
    WeightRule(LAYER + r"post_attention_layernorm\.weight", "mlp_norm", per_layer=True),
    WeightRule(LAYER + r"post_mlp_layernorm\.weight", "mlp_post_norm", per_layer=True),
    FUSED_GATE_UP_RULE,
    DOWN_RULE,
)
