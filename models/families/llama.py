"""Llama (and the many checkpoints that share its layout: SmolLM, Yi, DeepSeek-R1-Distill-Llama,
Mistral, Qwen2/3), as a configuration of the shared decoder.

``config_from_hf`` is the one reader of the HF ``config.json`` names that Llama-like models
share; architecture files pass what they add.
"""

from __future__ import annotations

from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.layers.attention import AttentionConfig
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.layers.rotary import rope_from_hf
from jax_llm_runtime.models.weights import WeightRule

LAYER = r"model\.layers\.(\d+)\."


def config_from_hf(
    hf: dict[str, Any], *, attention: dict[str, Any] | None = None, **fields: Any
) -> DecoderConfig:
    """A DecoderConfig from Llama's HF names; ``attention`` and ``fields`` add or override
    AttentionConfig and DecoderConfig fields (their callers read their own HF names)."""
    num_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
    # transformers 5 moved partial_rotary_factor into rope_parameters for some architectures.
    partial = hf.get("partial_rotary_factor") or (hf.get("rope_parameters") or {}).get(
        "partial_rotary_factor", 1.0
    )
    rotary_dim = int(head_dim * float(partial))
    attention_fields: dict[str, Any] = {
        "num_heads": num_heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or num_heads),
        "head_dim": head_dim,
        "rope": rope_from_hf(hf, rotary_dim),
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
        **(attention or {}),
    }
    decoder_fields: dict[str, Any] = {
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": int(hf["hidden_size"]),
        "intermediate_size": int(hf["intermediate_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "norm": NormConfig("rms", float(hf.get("rms_norm_eps", 1e-6))),
        "activation": hf.get("hidden_act", "silu"),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        **fields,
    }
    if decoder_fields["mlp_bias"] and decoder_fields.get("gated_mlp", True):
        raise ValueError("mlp_bias (biased gated MLP projections) is not supported")
    return DecoderConfig(attention=AttentionConfig(**attention_fields), **decoder_fields)


def sliding_flags(layer_types: list[str], num_layers: int) -> tuple[bool, ...]:
    """Which layers slide, from transformers' ``layer_types`` (one of "sliding_attention" or
    "full_attention" per layer)."""
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ValueError(
            f"layer_types must name 'sliding_attention' or 'full_attention' for each of "
            f"{num_layers} layers, got {layer_types}"
        )
    return tuple(t == "sliding_attention" for t in layer_types)


def llama_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Llama 1/2/3 (Yi, DeepSeek-R1-Distill-Llama, SmolLM): no sliding window."""
    return config_from_hf(hf)


# Checkpoint-name rules shared by the Llama-like families; each family composes its table from
# these and adds what it names differently (first match wins).
GLOBAL_RULES = (
    WeightRule(r"model\.embed_tokens\.weight", "embed"),
    WeightRule(r"model\.norm\.weight", "final_norm"),
    WeightRule(r"lm_head\.weight", "lm_head", transpose=True),
)
ATTENTION_RULES = (
    WeightRule(LAYER + r"input_layernorm\.weight", "attn_norm", per_layer=True),
    WeightRule(LAYER + r"self_attn\.q_proj\.weight", "wq", transpose=True, per_layer=True),
    WeightRule(LAYER + r"self_attn\.k_proj\.weight", "wk", transpose=True, per_layer=True),
    WeightRule(LAYER + r"self_attn\.v_proj\.weight", "wv", transpose=True, per_layer=True),
    WeightRule(LAYER + r"self_attn\.o_proj\.weight", "wo", transpose=True, per_layer=True),
    WeightRule(LAYER + r"self_attn\.q_proj\.bias", "bq", per_layer=True),
    WeightRule(LAYER + r"self_attn\.k_proj\.bias", "bk", per_layer=True),
    WeightRule(LAYER + r"self_attn\.v_proj\.bias", "bv", per_layer=True),
    WeightRule(LAYER + r"self_attn\.o_proj\.bias", "bo", per_layer=True),
    WeightRule(LAYER + r"self_attn\.q_norm\.weight", "q_norm", per_layer=True),
    WeightRule(LAYER + r"self_attn\.k_norm\.weight", "k_norm", per_layer=True),
    WeightRule(LAYER + r"self_attn\.rotary_emb\.inv_freq", None),
)
DOWN_RULE = WeightRule(LAYER + r"mlp\.down_proj\.weight", "w_down", transpose=True, per_layer=True)
GATED_MLP_RULES = (
    WeightRule(LAYER + r"mlp\.gate_proj\.weight", "w_gate", transpose=True, per_layer=True),
    WeightRule(LAYER + r"mlp\.up_proj\.weight", "w_up", transpose=True, per_layer=True),
    DOWN_RULE,
)
FUSED_GATE_UP_RULE = WeightRule(
    LAYER + r"mlp\.gate_up_proj\.weight", ("w_gate", "w_up"), transpose=True, per_layer=True
)
WEIGHT_RULES = (
    *GLOBAL_RULES,
    *ATTENTION_RULES,
    WeightRule(LAYER + r"post_attention_layernorm\.weight", "mlp_norm", per_layer=True),
    *GATED_MLP_RULES,
)
