"""Architectures by HF ``architectures`` name and by GGUF ``general.architecture``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from models import llama, qwen2, qwen3


@dataclass(frozen=True)
class ModelSpec:
    """How to build, load and run one architecture.

    ``config_from_hf`` reads an HF config dict; ``load(config, tensors, dtype, num_tensors)``
    builds the weight pytree from HF-named tensors; ``forward(config, weights, cache, batch)``
    returns ``(logits, cache)``. ``hidden_states(config, weights, tokens, positions, lengths)``,
    when the architecture has one, returns the final-normed hidden states of every position
    without touching the KV cache (used for embeddings); ``lm_head(config, weights, h)`` turns
    such states into logits (used for prompt logprobs). Configs expose ``num_layers``,
    ``num_kv_heads``, ``head_dim``, ``vocab_size`` and ``max_position_embeddings``.
    """

    hf_architecture: str
    config_from_hf: Callable[[dict[str, Any]], Any]
    load: Callable[[Any, Iterable[tuple[str, np.ndarray]], Any, int | None], Any]
    forward: Callable[..., Any]
    hidden_states: Callable[..., Any] | None = None
    lm_head: Callable[..., Any] | None = None


_SPECS = {
    spec.hf_architecture: spec
    for spec in (
        ModelSpec(
            "LlamaForCausalLM",
            llama.LlamaConfig.from_hf,
            llama.load,
            llama.forward,
            llama.hidden_states,
            llama.lm_head,
        ),
        ModelSpec(
            "Qwen2ForCausalLM",
            qwen2.config_from_hf,
            llama.load,
            llama.forward,
            llama.hidden_states,
            llama.lm_head,
        ),
        ModelSpec(
            "Qwen3ForCausalLM",
            qwen3.config_from_hf,
            llama.load,
            llama.forward,
            llama.hidden_states,
            llama.lm_head,
        ),
    )
}
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}


class UnsupportedArchitectureError(ValueError):
    pass


def get_model_spec(hf_architecture: str) -> ModelSpec:
    """The spec for an HF architecture name; an unknown one lists what is supported."""
    try:
        return _SPECS[hf_architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {hf_architecture!r} is not supported; supported: {', '.join(sorted(_SPECS))}"
        ) from None
