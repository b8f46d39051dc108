"""Qwen3: Llama with a per-head RMSNorm on q and k before rope and an explicit ``head_dim``;
Qwen3-VL's text model, the same with multimodal rope, and Qwen3-VL-MoE's, Qwen3-MoE's with it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import WEIGHT_RULES
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.families.moe_models import (
    QWEN_MOE_WEIGHT_RULES,
    qwen3_moe_config_from_hf,
)
from jax_llm_runtime.models.families.qwen2 import qwen_sliding_layers
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.weights import nested_rules


def config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Qwen3's HF config: Llama's names; the q/k norms share ``rms_norm_eps``."""
    slides, window = qwen_sliding_layers(hf)
    qk_norm = NormConfig("rms", float(hf.get("rms_norm_eps", 1e-6)))
    return llama_like(
        hf,
        attention={"qk_norm": qk_norm, "sliding_window": window},
        sliding_layers=slides,
    )


def with_mrope(cfg: DecoderConfig, text: dict[str, Any], default: tuple[int, ...]) -> DecoderConfig:
    """``cfg`` whose rope turns each frequency with one of a token's three positions,
    interleaved as transformers always does for Qwen3-VL and Qwen3.5 (``mrope_section`` of the
    text config's rope dict, else ``default``)."""
    params = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    section = tuple(params.get("mrope_section") or default)
    rope = replace(cfg.attention.rope, mrope_section=section, mrope_interleaved=True)
    return replace(cfg, attention=replace(cfg.attention, rope=rope))


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's ``text_config``, with the top level's ``tie_word_embeddings``
    (transformers ties the head by it; Qwen3-VL-MoE's text config defaults to True beside a
    top-level False)."""
    text = {**(hf.get("text_config") or hf)}
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def qwen3_vl_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Qwen3-VL's text model (``text_config`` of a ``Qwen3VLForConditionalGeneration``): Qwen3
    with multimodal rope."""
    text = _text_config(hf)
    return with_mrope(config_from_hf(text), text, (24, 20, 20))


def qwen3_vl_moe_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Qwen3-VL-MoE's text model: Qwen3-MoE (its router always renormalizes the top-k
    weights) with multimodal rope."""
    text = {**_text_config(hf), "norm_topk_prob": True}
    return with_mrope(qwen3_moe_config_from_hf(text), text, (24, 20, 20))


# The text model of a ``Qwen3VLForConditionalGeneration`` checkpoint, under
# ``model.language_model.``; the image encoder's tensors (``model.visual.``) are the encoder's.
QWEN3_VL_WEIGHT_RULES = nested_rules(WEIGHT_RULES, "language_model", r"model\.visual\..*")
QWEN3_VL_MOE_WEIGHT_RULES = nested_rules(
    QWEN_MOE_WEIGHT_RULES, "language_model", r"model\.visual\..*"
)
