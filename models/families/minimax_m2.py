"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): grouped-query attention whose q and k are each RMS-normed
over all their heads at once (one weight of ``num_heads * head_dim``), rope on the first
``rotary_dim`` features of each head (rotating halves), and mixture-of-experts in every layer:
sigmoid scores, a correction bias that steers only the choice, the chosen scores renormalised,
no shared expert. Checkpoints name the experts as Mixtral does (``block_sparse_moe``).
"""

from __future__ import annotations

from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import LAYER
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.families.moe_models import MIXTRAL_WEIGHT_RULES
from jax_llm_runtime.models.layers.moe import MoEConfig
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.weights import WeightRule

# Settings of released configs that transformers' MiniMax-M2 model never reads; a config that
# asks for another value would get a different model, so it is refused.
_FIXED = {"scoring_func": "sigmoid", "use_routing_bias": True, "qk_norm_type": "per_layer"}


def minimax_m2_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    for key, value in _FIXED.items():
        if key in hf and hf[key] != value:
            raise ValueError(f"MiniMax-M2 with {key}={hf[key]!r} is not supported (only {value!r})")
    num_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads)
    rope = hf.get("rope_parameters") or {}
    # Released checkpoints give the rotated width as ``rotary_dim``; transformers 5 converts it
    # to a partial rotary factor.
    rotary_dim = hf.get("rotary_dim")
    partial = rotary_dim / head_dim if rotary_dim else rope.get("partial_rotary_factor", 1.0)
    moe = MoEConfig(
        num_experts=int(hf["num_local_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf["intermediate_size"]),
        scoring="sigmoid",
        norm_topk_prob=True,
        has_router_bias=True,
        activation=hf.get("hidden_act", "silu"),
    )
    qk_norm = NormConfig("rms", float(hf.get("rms_norm_eps", 1e-6)))
    return llama_like(
        {"rope_theta": 5e6, **hf, "head_dim": head_dim, "partial_rotary_factor": partial},
        attention={
            "qkv_bias": False,
            "o_bias": False,
            "qk_norm": qk_norm,
            "qk_norm_all_heads": True,
        },
        moe=moe,
    )


MINIMAX_M2_WEIGHT_RULES = (
    *MIXTRAL_WEIGHT_RULES,
    WeightRule(LAYER + r"block_sparse_moe\.e_score_correction_bias", "router_bias", per_layer=True),
)
