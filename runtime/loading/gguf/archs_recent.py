"""The tables of the architectures that joined llama.cpp after the ones in ``archs``: gpt-oss,
Gemma 4, Llama 4, Qwen3-Next and Qwen3.5 (see ``archs`` for what a table says; their ``finish`` steps
are in ``config_recent``). gpt-oss's and Llama 4's expert stacks are ``[experts, in, out]``
with gate and up in one tensor, which ggml keeps as two stacks of rows (``joined_tensors``,
``in_out``); the converters of Qwen3-Next and Qwen3.5 rewrite their linear attention's
tensors (``gated_delta_net``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax_llm_runtime.runtime.loading.gguf.config_recent import (
    finish_gemma4,
    finish_gpt_oss,
    finish_llama4,
    finish_qwen3next,
    finish_qwen35,
)
from jax_llm_runtime.runtime.loading.gguf.spec import (
    ATTENTION,
    COMMON_METADATA,
    EXPERTS,
    GEMMA_LAYER,
    GLOBAL,
    MOE_METADATA,
    QK_NORM,
    RMS_REQUIRED,
    ROPE_DEFAULTS,
    ArchSpec,
    Join,
    make_spec,
)

_GPT_OSS_EXPERTS = "mlp.experts."
_LLAMA4_FFN = "feed_forward."
# Gemma 4 keeps its head widths and per-layer KV-head counts apart by layer kind (finish_gemma4);
# head_count_kv and feed_forward_length (the MLP widths of E2B and E4B) may be one per layer, so
# they are read there, with the per-layer embeddings' width and the KV-sharing layers.
_GEMMA4_METADATA = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.key_length": "global_head_dim",
    "attention.key_length_swa": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "final_logit_softcapping": "final_logit_softcapping",
    "rope.freq_base": "rope_theta",
    "expert_count": "num_experts",
    "expert_used_count": "top_k_experts",
    "expert_feed_forward_length": "moe_intermediate_size",
}

_QWEN_SHARED_EXPERT = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Gated DeltaNet layers (ssm_*) between full-attention ones with an output gate; every norm is
# stored as 1 + w except the linear attention's gated norm.
_GATED_DELTA_NET = {
    **ATTENTION,
    **QK_NORM,
    "post_attention_norm": "post_attention_layernorm",
    "ssm_a": "linear_attn.A_log",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Qwen3.5 keeps the linear attention's input projections apart.
_QWEN35_LAYER = {
    **_GATED_DELTA_NET,
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
}
_QWEN35_METADATA = {
    **COMMON_METADATA,
    "full_attention_interval": "full_attention_interval",
    "ssm.conv_kernel": "linear_conv_kernel_dim",
    "ssm.state_size": "linear_key_head_dim",
    "ssm.group_count": "linear_num_key_heads",
    "ssm.time_step_rank": "linear_num_value_heads",
    "nextn_predict_layers": "num_nextn_predict_layers",
}
_QWEN_MOE_METADATA = {
    **MOE_METADATA,
    "expert_count": "num_experts",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
_QWEN35_REQUIRED = (
    *RMS_REQUIRED,
    "ssm.conv_kernel",
    "ssm.state_size",
    "ssm.group_count",
    "ssm.time_step_rank",
    "ssm.inner_size",
)
# The released MoE configs renormalize the top-k routing weights; the converter writes no key.
_QWEN35_DEFAULTS = {
    "hidden_act": "silu",
    **ROPE_DEFAULTS,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "full_attention_interval": 4,
}


def _qwen35(
    hf_architecture: str, model_type: str, layer_tensors: Mapping[str, str], **kwargs: Any
) -> ArchSpec:
    """A Qwen3.5 table: separate linear-attention projections, value heads tiled."""
    kwargs.setdefault("metadata", _QWEN35_METADATA)
    kwargs.setdefault("required", _QWEN35_REQUIRED)
    return make_spec(
        hf_architecture,
        model_type,
        layer_tensors,
        defaults=_QWEN35_DEFAULTS,
        norm_shift=1.0,
        unshifted_norms=("linear_attn.norm.weight",),
        gated_delta_net=True,
        tiled_v_heads=True,
        finish=finish_qwen35,
        **kwargs,
    )


RECENT_ARCHS: dict[str, ArchSpec] = {
    # gpt-oss keeps each layer's experts in three stacks, ``[experts, in, out]``, gate and up
    # interleaved in one (the converter splits them and transposes all three to ggml's rows).
    "gpt-oss": make_spec(
        "GptOssForCausalLM",
        "gpt_oss",
        {
            **ATTENTION,
            "attn_sinks.weight": "self_attn.sinks",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_gate_inp": "mlp.router",
            "ffn_down_exps.weight": _GPT_OSS_EXPERTS + "down_proj",
            "ffn_down_exps.bias": _GPT_OSS_EXPERTS + "down_proj_bias",
        },
        metadata={
            **COMMON_METADATA,
            "expert_count": "num_local_experts",
            "expert_used_count": "num_experts_per_tok",
            # HF's intermediate_size is the experts' (every layer is MoE).
            "expert_feed_forward_length": "intermediate_size",
            "attention.sliding_window": "sliding_window",
        },
        required=(*RMS_REQUIRED, "expert_count", "expert_used_count"),
        # llama.cpp hard-codes the clamped SwiGLU's limit (and its alpha, HF's constant 1.702).
        defaults={"hidden_act": "silu", **ROPE_DEFAULTS, "swiglu_limit": 7.0},
        joined_tensors={
            "ffn_gate_exps.weight": Join(
                "ffn_up_exps.weight", _GPT_OSS_EXPERTS + "gate_up_proj", interleave=True
            ),
            "ffn_gate_exps.bias": Join(
                "ffn_up_exps.bias", _GPT_OSS_EXPERTS + "gate_up_proj_bias", -1, interleave=True
            ),
            "ffn_gate_up_exps.weight": Join(
                None, _GPT_OSS_EXPERTS + "gate_up_proj", interleave=True
            ),
            "ffn_gate_up_exps.bias": Join(
                None, _GPT_OSS_EXPERTS + "gate_up_proj_bias", -1, interleave=True
            ),
        },
        in_out=frozenset({_GPT_OSS_EXPERTS + "gate_up_proj", _GPT_OSS_EXPERTS + "down_proj"}),
        finish=finish_gpt_oss,
    ),
    # Gemma 4's norms are plain RMSNorm weights (no ``+ 1``); its MoE block sits beside the
    # MLP, with the router and experts on the layer itself. The per-layer embeddings (E2B, E4B)
    # are stored as HF has them: the table unscaled, the projections in torch's orientation.
    "gemma4": make_spec(
        "Gemma4ForCausalLM",
        "gemma4_text",
        {
            **GEMMA_LAYER,
            **QK_NORM,
            "layer_output_scale.weight": "layer_scalar",
            "inp_gate": "per_layer_input_gate",
            "proj": "per_layer_projection",
            "post_norm": "post_per_layer_input_norm",
            "ffn_gate_inp": "router.proj",
            "ffn_gate_inp.scale": "router.scale",
            "ffn_down_exps.scale": "router.per_expert_scale",
            "ffn_gate_up_exps.weight": "experts.gate_up_proj",
            "ffn_down_exps.weight": "experts.down_proj",
            "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
            "post_ffw_norm_1": "post_feedforward_layernorm_1",
            "post_ffw_norm_2": "post_feedforward_layernorm_2",
        },
        metadata=_GEMMA4_METADATA,
        required=(*RMS_REQUIRED, "attention.key_length"),
        defaults={
            "hidden_activation": "gelu_pytorch_tanh",
            **ROPE_DEFAULTS,
            "final_logit_softcapping": None,
            "attention_bias": False,
        },
        global_tensors={
            **GLOBAL,
            "per_layer_token_embd": "model.embed_tokens_per_layer",
            "per_layer_model_proj": "model.per_layer_model_projection",
            "per_layer_proj_norm": "model.per_layer_projection_norm",
        },
        finish=finish_gemma4,
    ),
    # Llama 4 keeps each MoE layer's expert stacks ``[experts, in, out]``, gate and up side by
    # side in one; the converter swaps HF's two feed-forward sizes (dense: feed_forward_length).
    "llama4": make_spec(
        "Llama4ForCausalLM",
        "llama4_text",
        {
            **ATTENTION,
            "ffn_norm": "post_attention_layernorm",
            "ffn_gate": _LLAMA4_FFN + "gate_proj",
            "ffn_up": _LLAMA4_FFN + "up_proj",
            "ffn_down": _LLAMA4_FFN + "down_proj",
            "ffn_gate_inp": _LLAMA4_FFN + "router",
            "ffn_down_exps.weight": _LLAMA4_FFN + "experts.down_proj",
            # --fuse-gate-up-exps files: gate rows, then up rows, as HF has them.
            "ffn_gate_up_exps.weight": _LLAMA4_FFN + "experts.gate_up_proj",
            "ffn_gate_shexp": _LLAMA4_FFN + "shared_expert.gate_proj",
            "ffn_up_shexp": _LLAMA4_FFN + "shared_expert.up_proj",
            "ffn_down_shexp": _LLAMA4_FFN + "shared_expert.down_proj",
        },
        metadata={
            **COMMON_METADATA,
            "feed_forward_length": "intermediate_size_mlp",
            "expert_feed_forward_length": "intermediate_size",
            "expert_count": "num_local_experts",
            "expert_used_count": "num_experts_per_tok",
            "interleave_moe_layer_step": "interleave_moe_layer_step",
        },
        required=(*RMS_REQUIRED, "expert_count", "expert_feed_forward_length"),
        defaults={
            "hidden_act": "silu",
            **ROPE_DEFAULTS,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
        },
        joined_tensors={
            "ffn_gate_exps.weight": Join("ffn_up_exps.weight", _LLAMA4_FFN + "experts.gate_up_proj")
        },
        in_out=frozenset({_LLAMA4_FFN + "experts.gate_up_proj", _LLAMA4_FFN + "experts.down_proj"}),
        finish=finish_llama4,
    ),
    # Qwen3-Next: Qwen2-MoE experts in every layer; the linear attention's input projections
    # fused per key head (in_proj_qkvz, in_proj_ba).
    "qwen3next": make_spec(
        "Qwen3NextForCausalLM",
        "qwen3_next",
        {**_GATED_DELTA_NET, **_QWEN_SHARED_EXPERT, "ssm_ba": "linear_attn.in_proj_ba"},
        metadata={**_QWEN35_METADATA, **_QWEN_MOE_METADATA},
        required=(*_QWEN35_REQUIRED, "expert_count"),
        defaults=_QWEN35_DEFAULTS,
        stacked_tensors=EXPERTS,
        norm_shift=1.0,
        unshifted_norms=("linear_attn.norm.weight",),
        gated_delta_net=True,
        joined_qkvz=True,
        finish=finish_qwen3next,
    ),
    "qwen35": _qwen35("Qwen3_5ForCausalLM", "qwen3_5_text", {**_QWEN35_LAYER, **_DENSE_MLP}),
    "qwen35moe": _qwen35(
        "Qwen3_5MoeForCausalLM",
        "qwen3_5_moe_text",
        # --fuse-gate-up-exps files: one stack, gate rows then up rows, as the released
        # checkpoints hold it (models.families.moe_models reads it).
        {
            **_QWEN35_LAYER,
            **_QWEN_SHARED_EXPERT,
            "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
        },
        metadata={**_QWEN35_METADATA, **_QWEN_MOE_METADATA},
        required=(*_QWEN35_REQUIRED, "expert_count"),
        stacked_tensors=EXPERTS,
    ),
}
