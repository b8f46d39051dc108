"""GLM's mixture-of-experts models, both with DeepSeek V3's experts (sigmoid scores, a
correction bias that steers only the choice, grouped top-k, routed scaling, a shared expert)
after dense first layers:

- GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``): grouped-query attention with biased q/k/v, an
  optional RMS norm over each head of q and k, rope on the first half of each head (rotating
  halves, not adjacent pairs).
- GLM-4-MoE-lite (``Glm4MoeLiteForCausalLM``, GLM-4.7-Flash): DeepSeek V3 itself, multi-head
  latent attention included, with the dense layers named by ``mlp_layer_types``.

Released checkpoints also store ``num_nextn_predict_layers`` multi-token-prediction layers after
the last decoder layer (``model.layers.<num_hidden_layers + i>``); they serve speculative
decoding, which this runtime does not run, so the loader skips them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.models import checkpoint
from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import WEIGHT_RULES
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.families.moe_models import (
    DEEPSEEK_MOE_RULES,
    DEEPSEEK_WEIGHT_RULES,
    deepseek_moe,
    first_moe_layer,
)
from jax_llm_runtime.models.layers.mla import mla_config_from_hf
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.state import ModelWeights
from jax_llm_runtime.models.weights import WeightLoadError, WeightRule

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
# The next-token-prediction layers a released GLM checkpoint keeps (its config's
# ``num_nextn_predict_layers``: one for GLM-4.5, 4.6 and 4.7-Flash), at most.
MAX_NEXTN_LAYERS = 1


def glm4_moe_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    num_layers = int(hf["num_hidden_layers"])
    first = min(int(hf.get("first_k_dense_replace", 1)), num_layers)
    eps = float(hf.get("rms_norm_eps", 1e-5))
    qk_norm = NormConfig("rms", eps) if hf.get("use_qk_norm", False) else None
    bias = bool(hf.get("attention_bias", False))
    # transformers 5 keeps the factor in rope_parameters and defaults it to one half here.
    rope = hf.get("rope_parameters") or {}
    partial = hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5
    return llama_like(
        {**hf, "partial_rotary_factor": partial},
        attention={"qkv_bias": bias, "o_bias": False, "qk_norm": qk_norm},
        moe=deepseek_moe(hf),
        first_moe_layer=first,
    )


def glm4_moe_lite_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    num_layers = int(hf["num_hidden_layers"])
    kinds = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
    if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ValueError(
            f"mlp_layer_types must name 'dense' or 'sparse' for each of {num_layers} layers, "
            f"got {kinds}"
        )
    rope = hf.get("rope_parameters") or {}
    partial = float(hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        raise ValueError(f"glm4_moe_lite with partial_rotary_factor {partial} is not supported")
    first = first_moe_layer([kind == "sparse" for kind in kinds])
    base = llama_like(
        {**hf, "head_dim": hf.get("v_head_dim")}, moe=deepseek_moe(hf), first_moe_layer=first
    )
    return dataclasses.replace(base, attention=mla_config_from_hf(hf))


GLM4_MOE_WEIGHT_RULES = (*WEIGHT_RULES, *DEEPSEEK_MOE_RULES)
GLM4_MOE_LITE_WEIGHT_RULES = DEEPSEEK_WEIGHT_RULES


def without_nextn_layers(
    cfg: DecoderConfig, tensors: Iterable[tuple[str, Any]], num_nextn: int
) -> Iterator[tuple[str, Any]]:
    """``tensors`` less the ``num_nextn`` multi-token-prediction layers stored after the last
    decoder layer; a layer index past those is an error naming its key."""
    for name, value in tensors:
        match = _LAYER_INDEX.match(name)
        index = int(match.group(1)) if match else -1
        if index >= cfg.num_layers + num_nextn:
            raise WeightLoadError(
                f"checkpoint key {name!r} names layer {index}, past the {cfg.num_layers} decoder "
                f"layers and {num_nextn} next-token-prediction layers of this config"
            )
        if index < cfg.num_layers:
            yield name, value


def load(
    cfg: DecoderConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype: jnp.dtype,
    num_tensors: int | None = None,
    *,
    rules: Sequence[WeightRule],
) -> ModelWeights:
    """``checkpoint.load`` with ``rules``, skipping the next-token-prediction layers (at most as
    many as a released GLM config names)."""
    kept = without_nextn_layers(cfg, tensors, MAX_NEXTN_LAYERS)
    return checkpoint.load(cfg, kept, dtype, num_tensors, rules=rules)
