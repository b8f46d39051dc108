"""GLM-4.5 / GLM-4.6 MoE (``Glm4MoeForCausalLM``): grouped-query attention with biased q/k/v,
an optional RMS norm over each head of q and k, rope on the first half of each head (rotating
halves, not adjacent pairs), dense first layers, then DeepSeek V3's experts (sigmoid scores, a
correction bias that steers only the choice, grouped top-k, routed scaling, a shared expert).

Released checkpoints also store ``num_nextn_predict_layers`` multi-token-prediction layers after
the last decoder layer (``model.layers.<num_hidden_layers + i>``); they serve speculative
decoding, which this runtime does not run, so the loader skips them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.models import checkpoint
from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import WEIGHT_RULES
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.families.moe_models import DEEPSEEK_MOE_RULES, deepseek_moe
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.state import ModelWeights
from jax_llm_runtime.models.weights import WeightLoadError

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
# The next-token-prediction layers a released GLM-4.5 / 4.6 checkpoint keeps (its config's
# ``num_nextn_predict_layers``), at most.
MAX_NEXTN_LAYERS = 1


def glm4_moe_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    num_layers = int(hf["num_hidden_layers"])
    first = min(int(hf.get("first_k_dense_replace", 1)), num_layers)
    eps = float(hf.get("rms_norm_eps", 1e-5))
    qk_norm = NormConfig("rms", eps) if hf.get("use_qk_norm", False) else None
    bias = bool(hf.get("attention_bias", False))
    return llama_like(
        # transformers defaults GLM-4.5's partial rotary factor to one half.
        {"partial_rotary_factor": 0.5, **hf},
        attention={"qkv_bias": bias, "o_bias": False, "qk_norm": qk_norm},
        moe=deepseek_moe(hf),
        first_moe_layer=first,
    )


GLM4_MOE_WEIGHT_RULES = (*WEIGHT_RULES, *DEEPSEEK_MOE_RULES)


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
) -> ModelWeights:
    """``checkpoint.load`` with GLM-4.5's rules, skipping its next-token-prediction layers (at
    most as many as a released config names: GLM-4.5 and 4.6 keep one)."""
    kept = without_nextn_layers(cfg, tensors, MAX_NEXTN_LAYERS)
    return checkpoint.load(cfg, kept, dtype, num_tensors, rules=GLM4_MOE_WEIGHT_RULES)
