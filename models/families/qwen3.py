"""Qwen3: Llama with a per-head RMSNorm on q and k before rope and an explicit ``head_dim``;
Qwen3-VL's text model, the same with multimodal rope."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import WEIGHT_RULES
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
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


def qwen3_vl_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Qwen3-VL's text model (``text_config`` of a ``Qwen3VLForConditionalGeneration``): Qwen3
    whose rope turns each frequency with one of a token's three positions, interleaved
    (``mrope_section``; transformers always interleaves Qwen3-VL's)."""
    text = {**(hf.get("text_config") or hf)}
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    cfg = config_from_hf(text)
    params = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    section = params.get("mrope_section") or (24, 20, 20)
    rope = replace(cfg.attention.rope, mrope_section=tuple(section), mrope_interleaved=True)
    return replace(cfg, attention=replace(cfg.attention, rope=rope))


# The text model of a ``Qwen3VLForConditionalGeneration`` checkpoint, under
# ``model.language_model.``; the image encoder's tensors (``model.visual.``) are the encoder's.
QWEN3_VL_WEIGHT_RULES = nested_rules(WEIGHT_RULES, "language_model", r"model\.visual\..*")
