"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid models whose layers are Gated DeltaNet linear
attention (``models.layers.linear_attention``) except every ``full_attention_interval``-th,
which is full attention with an output gate, partial rotary and q/k norms. Their RMS norms
scale by ``1 + weight`` (Gemma's), except the linear attention's gated norm.

Qwen3-Next fuses the linear attention's input projections per key head (``in_proj_qkvz``,
``in_proj_ba``); Qwen3.5 keeps them apart. Qwen3-Next's and Qwen3.5-MoE's feed-forward blocks
are Qwen2-MoE's (routed experts and a shared expert scaled by a sigmoid gate); Qwen3.5's dense
model has a plain MLP. A multimodal Qwen3.5 checkpoint (``Qwen3_5ForConditionalGeneration``)
serves images too: its vision tower is Qwen3-VL's without deepstack levels
(``models.families.qwen3_vl_vision``), and its full-attention layers turn with multimodal rope
(``qwen3_5_vl_config_from_hf``). The multi-token-prediction head (``mtp.*``) is not used.
"""

from __future__ import annotations

from typing import Any

from jax_llm_runtime.models.decoder import DecoderConfig
from jax_llm_runtime.models.families.llama import (
    ATTENTION_RULES,
    GATED_MLP_RULES,
    GLOBAL_RULES,
    LAYER,
)
from jax_llm_runtime.models.families.llama import config_from_hf as llama_like
from jax_llm_runtime.models.families.moe_models import QWEN_MOE_WEIGHT_RULES
from jax_llm_runtime.models.families.qwen3 import with_mrope
from jax_llm_runtime.models.layers.linear_attention import LinearAttentionConfig
from jax_llm_runtime.models.layers.moe import MoEConfig
from jax_llm_runtime.models.layers.norms import NormConfig
from jax_llm_runtime.models.weights import WeightRule, nested_rules

LAYER_TYPES = ("linear_attention", "full_attention")


def linear_layers(hf: dict[str, Any]) -> tuple[bool, ...]:
    """Which layers are linear attention: ``layer_types``, else every layer but each
    ``full_attention_interval``-th (transformers' default, 4)."""
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval", 4))
        types = [LAYER_TYPES[(i + 1) % interval == 0] for i in range(n)]
    if len(types) != n or set(types) - set(LAYER_TYPES):
        raise ValueError(
            f"layer_types must name 'linear_attention' or 'full_attention' for each of {n} "
            f"layers, got {types}"
        )
    return tuple(t == "linear_attention" for t in types)


def _linear_attention(hf: dict[str, Any], fused: bool) -> LinearAttentionConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    return LinearAttentionConfig(
        num_k_heads=int(hf["linear_num_key_heads"]),
        num_v_heads=int(hf["linear_num_value_heads"]),
        k_head_dim=int(hf["linear_key_head_dim"]),
        v_head_dim=int(hf["linear_value_head_dim"]),
        conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        fused_projections=fused,
    )


def _moe(hf: dict[str, Any]) -> tuple[MoEConfig | None, tuple[bool, ...]]:
    """Qwen2-MoE's experts with a gated shared expert, on the layers that have them
    (``mlp_only_layers`` and ``decoder_sparse_step`` may interleave dense layers)."""
    n, experts = int(hf["num_hidden_layers"]), int(hf.get("num_experts") or 0)
    if not experts:
        return None, ()
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    flags = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    moe = MoEConfig(
        num_experts=experts,
        top_k=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        shared_intermediate_size=shared,
        shared_gate=bool(shared),
        activation=hf.get("hidden_act", "silu"),
    )
    return (moe, flags) if any(flags) else (None, ())


def _hybrid(hf: dict[str, Any], fused: bool) -> DecoderConfig:
    eps = float(hf.get("rms_norm_eps", 1e-6))
    moe, moe_layers = _moe(hf)
    return llama_like(
        hf,
        attention={"qk_norm": NormConfig("rms_one", eps), "output_gate": True},
        norm=NormConfig("rms_one", eps),
        linear_attention=_linear_attention(hf, fused),
        linear_layers=linear_layers(hf),
        moe=moe,
        moe_layers=moe_layers,
    )


def qwen3_next_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    return _hybrid(hf, fused=True)


def qwen3_5_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """Qwen3.5 dense or MoE, a text checkpoint or the ``text_config`` of a multimodal one (its
    multimodal rope reduces to the plain one on text, where all its position axes agree)."""
    text = hf.get("text_config") or hf
    if text is not hf and "tie_word_embeddings" not in text:
        text = {**text, "tie_word_embeddings": hf.get("tie_word_embeddings", False)}
    rope = text.get("rope_parameters") or {}
    plain = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    return _hybrid({**text, "rope_parameters": plain or None}, fused=False)


def qwen3_5_vl_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """A multimodal Qwen3.5 checkpoint's text model with its multimodal rope: each rotary
    frequency of the full-attention layers turns with one of a token's three positions,
    interleaved as Qwen3-VL's (``mrope_section``, [11, 11, 10] when the config has none)."""
    return with_mrope(qwen3_5_config_from_hf(hf), hf.get("text_config") or hf, (11, 11, 10))


_LINEAR = LAYER + r"linear_attn\."
# The convolution's channels (q, then k, then v) and Qwen3.5's in_proj_qkv are cut into q, k
# and v fields, which split over a tensor-parallel mesh by heads (models.layers.linear_attention).
_QKV = ("q", "k", "v")
_LINEAR_COMMON = (
    WeightRule(_LINEAR + r"conv1d\.weight", tuple(f"la_conv_{n}" for n in _QKV), per_layer=True),
    WeightRule(_LINEAR + r"dt_bias", "la_dt_bias", per_layer=True),
    WeightRule(_LINEAR + r"A_log", "la_a_log", per_layer=True),
    WeightRule(_LINEAR + r"norm\.weight", "la_norm", per_layer=True),
    WeightRule(_LINEAR + r"out_proj\.weight", "la_out", transpose=True, per_layer=True),
    WeightRule(r"mtp\..*", None),
)
_FUSED_LINEAR = (
    WeightRule(_LINEAR + r"in_proj_qkvz\.weight", "la_qkvz", transpose=True, per_layer=True),
    WeightRule(_LINEAR + r"in_proj_ba\.weight", "la_ba", transpose=True, per_layer=True),
)
_SPLIT_LINEAR = (
    WeightRule(
        _LINEAR + r"in_proj_qkv\.weight",
        tuple(f"la_{n}" for n in _QKV),
        transpose=True,
        per_layer=True,
    ),
    *(
        WeightRule(_LINEAR + rf"in_proj_{n}\.weight", f"la_{n}", transpose=True, per_layer=True)
        for n in ("z", "b", "a")
    ),
)
QWEN3_NEXT_WEIGHT_RULES = (*QWEN_MOE_WEIGHT_RULES, *_LINEAR_COMMON, *_FUSED_LINEAR)
QWEN3_5_MOE_WEIGHT_RULES = (*QWEN_MOE_WEIGHT_RULES, *_LINEAR_COMMON, *_SPLIT_LINEAR)
QWEN3_5_WEIGHT_RULES = (
    *GLOBAL_RULES,
    *ATTENTION_RULES,
    WeightRule(LAYER + r"post_attention_layernorm\.weight", "mlp_norm", per_layer=True),
    *GATED_MLP_RULES,
    *_LINEAR_COMMON,
    *_SPLIT_LINEAR,
)
_VISION = r"model\.visual\..*"
QWEN3_5_MULTIMODAL_WEIGHT_RULES = nested_rules(QWEN3_5_WEIGHT_RULES, "language_model", _VISION)
QWEN3_5_MOE_MULTIMODAL_WEIGHT_RULES = nested_rules(
    QWEN3_5_MOE_WEIGHT_RULES, "language_model", _VISION
)
