"""Architectures by HF ``architectures`` name (the GGUF loader translates GGUF names to these)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from jax_llm_runtime.models import checkpoint, decoder
from jax_llm_runtime.models.families import (
    gemma,
    gemma3_vision,
    gemma4,
    glm4,
    glm4_moe,
    gpt_oss,
    llama,
    llama4,
    minimax_m2,
    mistral,
    mistral3_vision,
    moe_models,
    phi,
    qwen2,
    qwen3,
    qwen3_next,
    qwen3_vl_vision,
    stablelm,
)
from jax_llm_runtime.models.vision.encoder import VisionSpec


@dataclass(frozen=True)
class ModelSpec:
    """How to build, load and run one architecture.

    ``config_from_hf`` reads an HF config dict; ``load(config, tensors, dtype, num_tensors)``
    builds the split model (``models.state.ModelWeights``) from HF-named tensors;
    ``forward(config, weights, cache, batch)``
    returns ``(logits, cache)``. ``hidden_states(config, weights, tokens, positions, lengths)``,
    when the architecture has one, returns the final-normed hidden states of every position
    without touching the KV cache (used for embeddings); ``lm_head(config, weights, h)`` turns
    such states into logits (used for prompt logprobs). Configs expose ``num_layers``,
    ``num_kv_heads``, ``head_dim``, ``vocab_size`` and ``max_position_embeddings``.
    ``vision``, for a vision-language model whose images are served, is its image encoder
    (``models.vision.encoder.VisionSpec``), read from the same HF config and checkpoint.
    """

    hf_architecture: str
    config_from_hf: Callable[[dict[str, Any]], Any]
    load: Callable[[Any, Iterable[tuple[str, np.ndarray]], Any, int | None], Any]
    forward: Callable[..., Any]
    hidden_states: Callable[..., Any] | None = None
    lm_head: Callable[..., Any] | None = None
    vision: VisionSpec | None = None


def _decoder(
    hf_architecture: str,
    config_from_hf: Callable[[dict[str, Any]], Any],
    rules: tuple,
    load: Callable[..., Any] = checkpoint.load,
    vision: VisionSpec | None = None,
) -> ModelSpec:
    """A configuration of the shared decoder; ``load`` takes the checkpoint rules by keyword."""
    return ModelSpec(
        hf_architecture,
        config_from_hf,
        partial(load, rules=rules),
        decoder.forward,
        decoder.hidden_states,
        decoder.lm_head,
        vision,
    )


_SPECS = {
    spec.hf_architecture: spec
    for spec in (
        _decoder("LlamaForCausalLM", llama.llama_config_from_hf, llama.WEIGHT_RULES),
        _decoder(
            "Llama4ForCausalLM",
            llama4.llama4_config_from_hf,
            llama4.LLAMA4_WEIGHT_RULES,
            llama4.load,
        ),
        _decoder(
            "Llama4ForConditionalGeneration",
            llama4.llama4_config_from_hf,
            llama4.LLAMA4_MULTIMODAL_WEIGHT_RULES,
            llama4.load,
        ),
        _decoder("MistralForCausalLM", mistral.mistral_config_from_hf, llama.WEIGHT_RULES),
        _decoder("MinistralForCausalLM", mistral.ministral_config_from_hf, llama.WEIGHT_RULES),
        _decoder("Ministral3ForCausalLM", mistral.ministral3_config_from_hf, llama.WEIGHT_RULES),
        _decoder(
            "Mistral3ForConditionalGeneration",
            mistral.ministral3_config_from_hf,
            mistral.MISTRAL3_WEIGHT_RULES,
            mistral3_vision.load_text,
            vision=mistral3_vision.MISTRAL3_VISION,
        ),
        _decoder("Qwen2ForCausalLM", qwen2.config_from_hf, llama.WEIGHT_RULES),
        _decoder("Qwen3ForCausalLM", qwen3.config_from_hf, llama.WEIGHT_RULES),
        _decoder(
            "Qwen3VLForConditionalGeneration",
            qwen3.qwen3_vl_config_from_hf,
            qwen3.QWEN3_VL_WEIGHT_RULES,
            qwen3_vl_vision.load_text,
            vision=qwen3_vl_vision.QWEN3_VL_VISION,
        ),
        _decoder(
            "Qwen3VLMoeForConditionalGeneration",
            qwen3.qwen3_vl_moe_config_from_hf,
            qwen3.QWEN3_VL_MOE_WEIGHT_RULES,
            qwen3_vl_vision.load_text_moe,
            vision=qwen3_vl_vision.QWEN3_VL_VISION,
        ),
        _decoder("GemmaForCausalLM", gemma.gemma_config_from_hf, gemma.GEMMA1_WEIGHT_RULES),
        _decoder("Gemma2ForCausalLM", gemma.gemma2_config_from_hf, gemma.GEMMA2_WEIGHT_RULES),
        _decoder("Gemma3ForCausalLM", gemma.gemma3_config_from_hf, gemma.GEMMA2_WEIGHT_RULES),
        _decoder(
            "Gemma3ForConditionalGeneration",
            gemma.gemma3_config_from_hf,
            gemma.GEMMA3_MULTIMODAL_WEIGHT_RULES,
            gemma3_vision.load_text,
            vision=gemma3_vision.GEMMA3_VISION,
        ),
        _decoder(
            "Gemma4ForCausalLM",
            gemma4.gemma4_config_from_hf,
            gemma4.GEMMA4_WEIGHT_RULES,
            gemma4.load,
        ),
        _decoder(
            "Gemma4ForConditionalGeneration",
            gemma4.gemma4_config_from_hf,
            gemma4.GEMMA4_MULTIMODAL_WEIGHT_RULES,
            gemma4.load,
        ),
        _decoder("PhiForCausalLM", phi.phi2_config_from_hf, phi.PHI2_WEIGHT_RULES),
        _decoder("Phi3ForCausalLM", phi.phi3_config_from_hf, phi.PHI3_WEIGHT_RULES),
        _decoder(
            "StableLmForCausalLM", stablelm.stablelm_config_from_hf, stablelm.STABLELM_WEIGHT_RULES
        ),
        _decoder("Glm4ForCausalLM", glm4.glm4_config_from_hf, glm4.GLM4_WEIGHT_RULES),
        _decoder(
            "MixtralForCausalLM", moe_models.mixtral_config_from_hf, moe_models.MIXTRAL_WEIGHT_RULES
        ),
        _decoder(
            "Qwen2MoeForCausalLM",
            moe_models.qwen2_moe_config_from_hf,
            moe_models.QWEN_MOE_WEIGHT_RULES,
        ),
        _decoder(
            "Qwen3MoeForCausalLM",
            moe_models.qwen3_moe_config_from_hf,
            moe_models.QWEN_MOE_WEIGHT_RULES,
        ),
        _decoder("GptOssForCausalLM", gpt_oss.gpt_oss_config_from_hf, gpt_oss.GPT_OSS_WEIGHT_RULES),
        _decoder(
            "DeepseekV2ForCausalLM",
            moe_models.deepseek_config_from_hf,
            moe_models.DEEPSEEK_WEIGHT_RULES,
        ),
        _decoder(
            "Glm4MoeForCausalLM",
            glm4_moe.glm4_moe_config_from_hf,
            glm4_moe.GLM4_MOE_WEIGHT_RULES,
            glm4_moe.load,
        ),
        _decoder(
            "Glm4MoeLiteForCausalLM",
            glm4_moe.glm4_moe_lite_config_from_hf,
            glm4_moe.GLM4_MOE_LITE_WEIGHT_RULES,
            glm4_moe.load,
        ),
        _decoder(
            "MiniMaxM2ForCausalLM",
            minimax_m2.minimax_m2_config_from_hf,
            minimax_m2.MINIMAX_M2_WEIGHT_RULES,
        ),
        _decoder(
            "Qwen3NextForCausalLM",
            qwen3_next.qwen3_next_config_from_hf,
            qwen3_next.QWEN3_NEXT_WEIGHT_RULES,
        ),
        _decoder(
            "Qwen3_5ForCausalLM",
            qwen3_next.qwen3_5_config_from_hf,
            qwen3_next.QWEN3_5_WEIGHT_RULES,
        ),
        _decoder(
            "Qwen3_5ForConditionalGeneration",
            qwen3_next.qwen3_5_vl_config_from_hf,
            qwen3_next.QWEN3_5_MULTIMODAL_WEIGHT_RULES,
            qwen3_vl_vision.load_text,
            vision=qwen3_vl_vision.QWEN3_5_VISION,
        ),
        _decoder(
            "Qwen3_5MoeForCausalLM",
            qwen3_next.qwen3_5_config_from_hf,
            qwen3_next.QWEN3_5_MOE_WEIGHT_RULES,
        ),
        _decoder(
            "Qwen3_5MoeForConditionalGeneration",
            qwen3_next.qwen3_5_vl_config_from_hf,
            qwen3_next.QWEN3_5_MOE_MULTIMODAL_WEIGHT_RULES,
            qwen3_vl_vision.load_text,
            vision=qwen3_vl_vision.QWEN3_5_VISION,
        ),
        _decoder(
            "DeepseekV3ForCausalLM",
            moe_models.deepseek_config_from_hf,
            moe_models.DEEPSEEK_WEIGHT_RULES,
        ),
    )
}


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


def model_config_from_hf(hf: dict[str, Any]) -> tuple[ModelSpec, Any]:
    """The spec and model config for an HF ``config.json`` dict, or a ValueError naming what is
    wrong (unsupported architecture, a missing or malformed key)."""
    arch = (hf.get("architectures") or [None])[0]
    spec = get_model_spec(arch)
    try:
        return spec, spec.config_from_hf(hf)
    except KeyError as e:
        raise ValueError(f"{arch} config is missing the key {e.args[0]!r}") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"{arch} config has a malformed value: {e}") from None
