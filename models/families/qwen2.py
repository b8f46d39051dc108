"""Qwen2 (Qwen2.5, QwQ, DeepSeek-R1-Distill-Qwen): Llama with biases on q, k and v, and
optional sliding windows on the layers from ``max_window_layers`` on."""

from __future__ import annotations

from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.families.llama import sliding_flags


def qwen_sliding_layers(hf: dict[str, Any]) -> tuple[tuple[bool, ...], int | None]:
    """Per-layer sliding flags and the window. transformers lists ``layer_types``; older configs
    say ``use_sliding_window`` with layers from ``max_window_layers`` on sliding."""
    num_layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window") or not window:
        return (), None
    if layer_types := hf.get("layer_types"):
        flags = sliding_flags(layer_types, num_layers)
    else:
        first = int(hf.get("max_window_layers", num_layers))
        flags = tuple(i >= first for i in range(num_layers))
    return (flags, int(window)) if any(flags) else ((), None)


def config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Qwen2's HF config: Llama's names, q/k/v biases always on, o_proj without bias."""
    slides, window = qwen_sliding_layers(hf)
    return llama_like(
        hf,
        attention={"qkv_bias": True, "o_bias": False, "sliding_window": window},
        sliding_layers=slides,
    )
