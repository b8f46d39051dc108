"""gpt-oss: a mixture-of-experts decoder whose every layer routes to experts, with

- attention sinks (a learned logit per query head in each softmax denominator), biased
  projections, and sliding-window layers alternating with full ones (``layer_types``);
- yarn rope (the released checkpoints extend 4096 positions 32 times, without truncating the
  ramp);
- a router with a bias on its logits and softmax weights over the chosen experts; experts with
  biases and a clamped SwiGLU, ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
  ``g = min(gate, limit)``, whose checkpoint interleaves the gate and up columns.
"""

from __future__ import annotations

from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import (
    ATTENTION_RULES,
    GLOBAL_RULES,
    LAYER,
    sliding_flags,
)
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.layers.moe import MoEConfig
from jax_llm_runtime.models.weights import WeightRule

# transformers' defaults for a config that names no rope (those of the released checkpoints).
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
DEFAULT_THETA = 150000.0


def _with_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` with gpt-oss's own rope defaults where it names none (or no base)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})} or DEFAULT_ROPE
    theta = params.get("rope_theta", hf.get("rope_theta", DEFAULT_THETA))
    return {**hf, "rope_scaling": None, "rope_parameters": {**params, "rope_theta": theta}}


def gpt_oss_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    flags = sliding_flags(layer_types, num_layers)
    window = hf.get("sliding_window")
    sliding = bool(window) and any(flags)
    moe = MoEConfig(
        num_experts=int(hf["num_local_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf["intermediate_size"]),
        # Softmax over the chosen logits is the softmax over all, renormalised over the chosen.
        norm_topk_prob=True,
        router_logit_bias=True,
        expert_bias=True,
        swiglu_clamp=(float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))),
    )
    return llama_like(
        _with_rope(hf),
        attention={"sinks": True, "sliding_window": int(window) if sliding else None},
        sliding_layers=flags if sliding else (),
        moe=moe,
        first_moe_layer=0,
    )


_EXPERTS = LAYER + r"mlp\.experts\."
GPT_OSS_WEIGHT_RULES = (
    *GLOBAL_RULES,
    *ATTENTION_RULES,
    WeightRule(LAYER + r"self_attn\.sinks", "sinks", per_layer=True),
    WeightRule(LAYER + r"post_attention_layernorm\.weight", "mlp_norm", per_layer=True),
    WeightRule(LAYER + r"mlp\.router\.weight", "router", transpose=True, per_layer=True),
    WeightRule(LAYER + r"mlp\.router\.bias", "router_b", per_layer=True),
    # Expert stacks are stored [experts, in, out] already, gate and up columns alternating.
    WeightRule(_EXPERTS + r"gate_up_proj", ("e_gate", "e_up"), per_layer=True, interleaved=True),
    WeightRule(
        _EXPERTS + r"gate_up_proj_bias", ("e_gate_b", "e_up_b"), per_layer=True, interleaved=True
    ),
    WeightRule(_EXPERTS + r"down_proj", "e_down", per_layer=True),
    WeightRule(_EXPERTS + r"down_proj_bias", "e_down_b", per_layer=True),
)
