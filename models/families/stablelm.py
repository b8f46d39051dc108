"""StableLM (2): LayerNorm with biases, partial rotary, optional q/k/v biases, optional
per-head q/k LayerNorm and optional parallel attention + MLP residual."""

from __future__ import annotations

from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import LAYER, WEIGHT_RULES
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.weights import WeightRule


def stablelm_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    eps = float(hf.get("layer_norm_eps", 1e-5))
    return llama_like(
        hf,
        attention={
            "qkv_bias": bool(hf.get("use_qkv_bias", False)),
            "o_bias": False,
            "qk_norm": NormConfig("layer", eps) if hf.get("qk_layernorm") else None,
            "qk_norm_per_head": True,
        },
        norm=NormConfig("layer", eps),
        parallel_residual=bool(hf.get("use_parallel_residual", False)),
    )


STABLELM_WEIGHT_RULES = (
    *(r for r in WEIGHT_RULES if r.field not in ("q_norm", "k_norm")),
    WeightRule(r"model\.norm\.bias", "final_norm_b"),
    WeightRule(LAYER + r"input_layernorm\.bias", "attn_norm_b", per_layer=True),
    WeightRule(LAYER + r"post_attention_layernorm\.bias", "mlp_norm_b", per_layer=True),
    WeightRule(LAYER + r"self_attn\.q_layernorm\.norms\.(\d+)\.weight", "q_norm", per_layer=True),
    WeightRule(LAYER + r"self_attn\.k_layernorm\.norms\.(\d+)\.weight", "k_norm", per_layer=True),
)
