"""Mistral v0.1-v0.3 (sliding window on every layer when configured), Ministral (per-layer
``layer_types``) and Mistral 3 / Ministral 3 (yarn rope, a position-dependent query scale, and,
for the multimodal checkpoints, a text model nested under ``text_config``)."""

from __future__ import annotations

from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import WEIGHT_RULES, sliding_flags
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.weights import nested_rules


def mistral_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    window = hf.get("sliding_window")
    num_layers = int(hf["num_hidden_layers"])
    return llama_like(
        hf,
        attention={"sliding_window": int(window) if window else None},
        sliding_layers=(True,) * num_layers if window else (),
    )


def ministral_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Ministral lists each layer's attention kind in ``layer_types``."""
    num_layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types") or (
        ["sliding_attention" if window else "full_attention"] * num_layers
    )
    flags = sliding_flags(layer_types, num_layers)
    if not window or not any(flags):
        return llama_like(hf)
    return llama_like(hf, attention={"sliding_window": int(window)}, sliding_layers=flags)


def ministral3_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Ministral 3 text, or Mistral 3's ``text_config``: yarn rope plus Llama 4's query scale
    1 + beta * log(1 + floor(position / original_max_position_embeddings))."""
    text = hf.get("text_config") or hf
    params = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    beta = params.get("llama_4_scaling_beta")
    scale = None
    if beta:
        scale = (float(beta), int(params["original_max_position_embeddings"]))
    window = text.get("sliding_window")
    num_layers = int(text["num_hidden_layers"])
    return llama_like(
        text,
        attention={
            "position_query_scale": scale,
            "sliding_window": int(window) if window else None,
        },
        sliding_layers=(True,) * num_layers if window else (),
    )


# The text model of the multimodal checkpoint; its image encoder loads apart
# (models.families.mistral3_vision).
MISTRAL3_WEIGHT_RULES = nested_rules(
    WEIGHT_RULES, "language_model", r"model\.(vision_tower|multi_modal_projector)\..*"
)
