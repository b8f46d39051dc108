"""Gemma, Gemma 2 and Gemma 3 (text): RMSNorm weights stored as offsets from 1, embeddings scaled
by sqrt(hidden_size), GeGLU MLPs; Gemma 2/3 add norms after attention and after the MLP and
alternate sliding-window and global layers; Gemma 2 soft-caps attention scores and final
logits; Gemma 3 norms q and k and gives sliding layers their own rope base."""

from __future__ import annotations

import math
from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import (
    ATTENTION_RULES,
    GATED_MLP_RULES,
    GLOBAL_RULES,
    LAYER,
    sliding_flags,
)
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.layers.rotary import RopeConfig, rope_from_hf
from jax_llm_runtime.models.weights import WeightRule, nested_rules


def _common(hf: dict[str, Any]) -> dict[str, Any]:
    """The DecoderConfig fields every Gemma shares."""
    return {
        "norm": NormConfig("rms_one", float(hf.get("rms_norm_eps", 1e-6))),
        "activation": hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        "embed_scale": math.sqrt(int(hf["hidden_size"])),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def _softmax_scale(hf: dict[str, Any]) -> float | None:
    scalar = hf.get("query_pre_attn_scalar")
    return None if scalar is None else float(scalar) ** -0.5


def _sliding_layers(hf: dict[str, Any], pattern: int) -> tuple[bool, ...]:
    """``layer_types`` when listed, else every ``pattern``-th layer is global (HF's default)."""
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
    return sliding_flags(layer_types, num_layers)


def gemma_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    return llama_like(hf, **_common(hf))


def gemma2_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    slides = _sliding_layers(hf, 2)
    window = hf.get("sliding_window")
    return llama_like(
        hf,
        attention={
            "softmax_scale": _softmax_scale(hf),
            "soft_cap": hf.get("attn_logit_softcapping"),
            "sliding_window": int(window) if window and any(slides) else None,
        },
        sandwich_norms=True,
        final_soft_cap=hf.get("final_logit_softcapping"),
        sliding_layers=slides if window and any(slides) else (),
        **_common(hf),
    )


def _gemma3_ropes(hf: dict[str, Any], head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) ropes: transformers 5 nests them under ``rope_parameters`` by layer kind;
    older configs give ``rope_theta`` (+ ``rope_scaling``) and ``rope_local_base_freq``."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        base = {"max_position_embeddings": hf.get("max_position_embeddings")}
        full = rope_from_hf({**base, "rope_parameters": params["full_attention"]}, head_dim)
        local = params.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10000.0}
        return full, rope_from_hf({**base, "rope_parameters": local}, head_dim)
    full = rope_from_hf({**hf, "rope_theta": hf.get("rope_theta", 1_000_000.0)}, head_dim)
    local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    return full, RopeConfig(theta=local_theta, rotary_dim=head_dim)


def gemma3_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Gemma 3 text, or the ``text_config`` of a multimodal Gemma 3 checkpoint."""
    text = hf.get("text_config") or hf
    if text.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an encoder) cannot generate")
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    rope, local_rope = _gemma3_ropes(text, head_dim)
    slides = _sliding_layers(text, int(text.get("sliding_window_pattern", 6)))
    window = text.get("sliding_window")
    sliding = bool(window) and any(slides)
    return llama_like(
        {**text, "rope_parameters": None, "rope_scaling": None},
        attention={
            "rope": rope,
            "local_rope": local_rope if sliding else None,
            "softmax_scale": _softmax_scale(text),
            "soft_cap": text.get("attn_logit_softcapping"),
            "sliding_window": int(window) if sliding else None,
            "qk_norm": NormConfig("rms_one", float(text.get("rms_norm_eps", 1e-6))),
        },
        sandwich_norms=True,
        final_soft_cap=text.get("final_logit_softcapping"),
        sliding_layers=slides if sliding else (),
        **_common(text),
    )


GEMMA_WEIGHT_RULES = (*GLOBAL_RULES, *ATTENTION_RULES, *GATED_MLP_RULES)
# Gemma 1 names its pre-MLP norm like Llama; Gemma 2/3 have four norms per layer.
GEMMA1_WEIGHT_RULES = (
    *GEMMA_WEIGHT_RULES,
    WeightRule(LAYER + r"post_attention_layernorm\.weight", "mlp_norm", per_layer=True),
)
GEMMA2_WEIGHT_RULES = (
    *GEMMA_WEIGHT_RULES,
    WeightRule(LAYER + r"post_attention_layernorm\.weight", "attn_post_norm", per_layer=True),
    WeightRule(LAYER + r"pre_feedforward_layernorm\.weight", "mlp_norm", per_layer=True),
    WeightRule(LAYER + r"post_feedforward_layernorm\.weight", "mlp_post_norm", per_layer=True),
)
GEMMA3_MULTIMODAL_WEIGHT_RULES = nested_rules(
    GEMMA2_WEIGHT_RULES, "language_model", r"model\.(vision_tower|multi_modal_projector)\..*"
)
