"""Qwen3: Llama with a per-head RMSNorm on q and k before rope and an explicit ``head_dim``."""

from __future__ import annotations

from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.families.qwen2 import qwen_sliding_layers
from jax_llm_runtime.models.layers.norms import NormConfig


def config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Qwen3's HF config: Llama's names; the q/k norms share ``rms_norm_eps``."""
    slides, window = qwen_sliding_layers(hf)
    qk_norm = NormConfig("rms", float(hf.get("rms_norm_eps", 1e-6)))
    return llama_like(
        hf,
        attention={"qk_norm": qk_norm, "sliding_window": window},
        sliding_layers=slides,
    )
