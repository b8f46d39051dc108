"""Qwen3: Llama with a per-head RMSNorm on q and k before rope and an explicit ``head_dim``.

Everything but the config translation is Llama's; the q/k norm fields are declared there.
"""

from __future__ import annotations

from typing import Any

from models.llama import LlamaConfig
from models.qwen2 import reject_sliding_window


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    """Qwen3's HF config: Llama's names; the q/k norms share ``rms_norm_eps``."""
    reject_sliding_window(hf)
    if hf.get("attention_bias"):
        raise ValueError("Qwen3 with attention_bias (biased q/k/v/o projections) is not supported")
    return LlamaConfig.from_hf(hf, qk_norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
