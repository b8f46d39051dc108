"""Qwen2 (and Qwen2.5): Llama with biases on the q, k and v projections.

Everything but the config translation is Llama's; the bias fields are declared there.
"""

from __future__ import annotations

from typing import Any

from models.llama import LlamaConfig


def reject_sliding_window(hf: dict[str, Any]) -> None:
    """Qwen2-family checkpoints may turn on per-layer sliding windows; none of ours run them yet."""
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise ValueError(
            "sliding-window attention on some layers (use_sliding_window) is not supported for "
            f"{(hf.get('architectures') or ['this model'])[0]} yet; set it to false in config.json"
        )


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    """Qwen2's HF config: Llama's names, q/k/v biases always on."""
    reject_sliding_window(hf)
    return LlamaConfig.from_hf(hf, qkv_bias=True)
