"""Mixture-of-experts architectures: Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek V2/V3.

Each is the shared decoder with ``DecoderConfig.moe`` set; DeepSeek also swaps attention for
multi-head latent attention. The layers that keep a dense MLP must come first (DeepSeek's
``first_k_dense_replace``); other interleavings are refused with a clear error.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import LAYER, WEIGHT_RULES
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.families.qwen2 import qwen_sliding_layers
from jax_llm_runtime.models.layers.mla import MLA_WEIGHT_RULES, mla_config_from_hf
from jax_llm_runtime.models.layers.moe import MoEConfig
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.weights import WeightRule


def first_moe_layer(flags: list[bool]) -> int:
    """The layer the experts start at, given which layers are MoE (a dense prefix is fine)."""
    first = flags.index(True) if True in flags else len(flags)
    if not all(flags[first:]):
        raise ValueError(
            "MoE layers interleaved with dense ones are not supported (only dense layers first, "
            f"then MoE); this config makes layers {[i for i, f in enumerate(flags) if f]} MoE"
        )
    return first


def mixtral_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    moe = MoEConfig(
        num_experts=int(hf["num_local_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf["intermediate_size"]),
        norm_topk_prob=True,
        activation=hf.get("hidden_act", "silu"),
    )
    window = hf.get("sliding_window")
    num_layers = int(hf["num_hidden_layers"])
    return llama_like(
        hf,
        attention={"sliding_window": int(window) if window else None},
        sliding_layers=(True,) * num_layers if window else (),
        moe=moe,
    )


def _qwen_moe(hf: dict[str, Any], shared: bool) -> tuple[MoEConfig, int]:
    num_layers = int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step", 1))
    dense_only = set(hf.get("mlp_only_layers") or ())
    flags = [i not in dense_only and (i + 1) % step == 0 for i in range(num_layers)]
    moe = MoEConfig(
        # transformers 5 saves num_local_experts; released checkpoints say num_experts.
        num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0)) if shared else 0,
        shared_gate=shared,
        activation=hf.get("hidden_act", "silu"),
    )
    return moe, first_moe_layer(flags)


def qwen2_moe_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    moe, first = _qwen_moe(hf, shared=True)
    slides, window = qwen_sliding_layers(hf)
    return llama_like(
        hf,
        attention={"qkv_bias": bool(hf.get("qkv_bias", True)), "sliding_window": window},
        sliding_layers=slides,
        moe=moe,
        first_moe_layer=first,
    )


def qwen3_moe_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    moe, first = _qwen_moe(hf, shared=False)
    slides, window = qwen_sliding_layers(hf)
    qk_norm = NormConfig("rms", float(hf.get("rms_norm_eps", 1e-6)))
    return llama_like(
        hf,
        attention={"qk_norm": qk_norm, "sliding_window": window},
        sliding_layers=slides,
        moe=moe,
        first_moe_layer=first,
    )


def deepseek_moe(hf: dict[str, Any], v2: bool = False) -> MoEConfig:
    """The routed and shared experts of DeepSeek V2 (softmax routing, optional group-limited
    greedy) or V3/R1 (sigmoid routing with a correction bias, groups ranked by their best two
    experts); GLM-4.5's MoE layers use V3's."""
    grouped = not v2 or hf.get("topk_method") == "group_limited_greedy"
    # One group keeps every expert: the grouped choice would be the plain one.
    grouped = grouped and int(hf.get("n_group") or 1) > 1
    inter = int(hf["moe_intermediate_size"])
    return MoEConfig(
        num_experts=int(hf["n_routed_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=inter,
        scoring="softmax" if v2 else "sigmoid",
        # transformers' V2 router never renormalises; V3 follows its config.
        norm_topk_prob=False if v2 else bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        num_groups=int(hf["n_group"]) if grouped else None,
        topk_groups=int(hf["topk_group"]) if grouped else None,
        group_score_topn=1 if v2 else 2,
        has_router_bias=not v2,
        shared_intermediate_size=inter * int(hf.get("n_shared_experts") or 0),
        activation=hf.get("hidden_act", "silu"),
    )


def deepseek_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """DeepSeek V2 and V3/R1: multi-head latent attention, dense first layers, then
    ``deepseek_moe``'s experts."""
    num_layers = int(hf["num_hidden_layers"])
    first = int(hf.get("first_k_dense_replace", 0))
    freq = int(hf.get("moe_layer_freq", 1))
    first_moe_layer([i >= first and i % freq == 0 for i in range(num_layers)])
    moe = deepseek_moe(hf, v2=hf.get("model_type") == "deepseek_v2")
    base = llama_like({**hf, "head_dim": hf.get("v_head_dim")}, moe=moe, first_moe_layer=first)
    return dataclasses.replace(base, attention=mla_config_from_hf(hf))


_DENSE_RULES = tuple(r for r in WEIGHT_RULES if "self_attn" not in r.pattern)
_EXPERT = LAYER + r"mlp\.experts\.(\d+)\."
_SHARED_AND_ROUTER = (
    WeightRule(LAYER + r"mlp\.gate\.weight", "router", transpose=True, per_layer=True),
    WeightRule(_EXPERT + r"gate_proj\.weight", "e_gate", transpose=True, per_layer=True),
    WeightRule(_EXPERT + r"up_proj\.weight", "e_up", transpose=True, per_layer=True),
    WeightRule(_EXPERT + r"down_proj\.weight", "e_down", transpose=True, per_layer=True),
)
MIXTRAL_WEIGHT_RULES = (
    *WEIGHT_RULES,
    WeightRule(LAYER + r"block_sparse_moe\.gate\.weight", "router", transpose=True, per_layer=True),
    WeightRule(
        LAYER + r"block_sparse_moe\.experts\.(\d+)\.w1\.weight",
        "e_gate",
        transpose=True,
        per_layer=True,
    ),
    WeightRule(
        LAYER + r"block_sparse_moe\.experts\.(\d+)\.w3\.weight",
        "e_up",
        transpose=True,
        per_layer=True,
    ),
    WeightRule(
        LAYER + r"block_sparse_moe\.experts\.(\d+)\.w2\.weight",
        "e_down",
        transpose=True,
        per_layer=True,
    ),
)
QWEN_MOE_WEIGHT_RULES = (
    *WEIGHT_RULES,
    *_SHARED_AND_ROUTER,
    WeightRule(LAYER + r"mlp\.shared_expert\.gate_proj\.weight", "s_gate", True, True),
    WeightRule(LAYER + r"mlp\.shared_expert\.up_proj\.weight", "s_up", True, True),
    WeightRule(LAYER + r"mlp\.shared_expert\.down_proj\.weight", "s_down", True, True),
    WeightRule(LAYER + r"mlp\.shared_expert_gate\.weight", "s_router", True, True),
    # All of a layer's experts in one tensor (Qwen3.5-MoE's released checkpoints, transformers
    # 5's own layout; GGUF files written with --fuse-gate-up-exps): gate_up_proj is
    # [experts, 2 * inter, hidden], gate rows first, and down_proj [experts, hidden, inter].
    WeightRule(LAYER + r"mlp\.experts\.gate_up_proj", ("e_gate", "e_up"), True, True),
    WeightRule(LAYER + r"mlp\.experts\.down_proj", "e_down", True, True),
)
# DeepSeek V3's MoE layer names (router, its correction bias, routed and shared experts), which
# GLM-4.5 shares.
DEEPSEEK_MOE_RULES = (
    *_SHARED_AND_ROUTER,
    WeightRule(LAYER + r"mlp\.gate\.e_score_correction_bias", "router_bias", per_layer=True),
    WeightRule(LAYER + r"mlp\.shared_experts\.gate_proj\.weight", "s_gate", True, True),
    WeightRule(LAYER + r"mlp\.shared_experts\.up_proj\.weight", "s_up", True, True),
    WeightRule(LAYER + r"mlp\.shared_experts\.down_proj\.weight", "s_down", True, True),
)
DEEPSEEK_WEIGHT_RULES = (*_DENSE_RULES, *MLA_WEIGHT_RULES, *DEEPSEEK_MOE_RULES)
