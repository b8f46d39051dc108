"""Metadata half of the test-side GGUF writer: the keys llama.cpp's converter writes per arch.

Each ``*_metadata(writer, hp)`` takes the HF ``config.json`` dict and calls ``GGUFWriter.add_*``
as the converter's ``set_gguf_parameters`` of that architecture does.
"""

from __future__ import annotations

import math
from typing import Any

import gguf


def rope_parameters(hp: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global rope parameters, sliding-layer ones), from transformers 5 or older configs."""
    params = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    full = dict(params.get("full_attention", params))
    full.setdefault("rope_theta", hp.get("rope_theta"))
    full.setdefault("rope_type", full.get("type"))
    return full, params.get("sliding_attention", {})


def text_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """The converter's TextModel.set_gguf_parameters."""
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    if (kv := hp.get("num_key_value_heads")) is not None:
        w.add_head_count_kv(kv)
    full, sliding = rope_parameters(hp)
    _rope_scaling_metadata(w, full)
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(full["rope_theta"])
    if sliding.get("rope_theta") is not None:
        w.add_rope_freq_base_swa(sliding["rope_theta"])
    if (eps := hp.get("rms_norm_eps")) is not None:
        w.add_layer_norm_rms_eps(eps)
    experts = hp.get("num_local_experts") or hp.get("num_experts") or hp.get("n_routed_experts")
    if experts is not None:
        w.add_expert_count(experts)
    if (used := hp.get("num_experts_per_tok")) is not None:
        w.add_expert_used_count(used)
    if hp.get("n_group") is not None:
        w.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    if (func := hp.get("scoring_func")) is not None:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType[func.upper()])
    if (head_dim := hp.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)


def _rope_scaling_metadata(w: gguf.GGUFWriter, full: dict[str, Any]) -> None:
    kind = full.get("rope_type")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if full.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        if full.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])


def head_dim_of(hp: dict[str, Any]) -> int:
    """Per-head width: the explicit head_dim, else hidden_size / heads."""
    return hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]


def llama_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    text_metadata(w, hp)
    w.add_vocab_size(hp["vocab_size"])
    w.add_rope_dimension_count(head_dim_of(hp))


def moe_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    text_metadata(w, hp)
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if (shared := hp.get("shared_expert_intermediate_size")) is not None:
        w.add_expert_shared_feed_forward_length(shared)


def _rotary_dims(hp: dict[str, Any]) -> int:
    full, _ = rope_parameters(hp)
    fraction = full.get("partial_rotary_factor", hp.get("partial_rotary_factor", 1.0))
    return int(fraction * head_dim_of(hp))


def phi3_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    full, _ = rope_parameters(hp)
    original = full.get("original_max_position_embeddings", hp["original_max_position_embeddings"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_rope_dimension_count(_rotary_dims(hp))
    w.add_rope_freq_base(full["rope_theta"])
    w.add_sliding_window(hp.get("sliding_window") or 0)
    if full.get("long_factor"):
        scale = hp["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))


def gemma2_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
    w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])


def gemma3_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    text_metadata(w, hp)
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    pattern = hp.get("sliding_window_pattern", hp.get("_sliding_window_pattern"))
    if pattern != 1:
        w.add_sliding_window(hp["sliding_window"])


def stablelm_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_rope_dimension_count(_rotary_dims(hp))
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_parallel_residual(hp.get("use_parallel_residual", True))
    w.add_layer_norm_eps(hp["layer_norm_eps"])


def glm4_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    text_metadata(w, hp)
    w.add_rope_dimension_count(_rotary_dims(hp))


def deepseek_metadata(w: gguf.GGUFWriter, hp: dict[str, Any], split_kv_b: bool = True) -> None:
    rank, rope, nope = hp["kv_lora_rank"], hp["qk_rope_head_dim"], hp["qk_nope_head_dim"]
    if split_kv_b:
        # MLA is written as MQA: one KV head of width kv_lora_rank (+ the rope part for keys).
        text_metadata(w, {**hp, "num_key_value_heads": 1, "head_dim": None})
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(hp["v_head_dim"])
    else:  # files from before the k_b/v_b split describe the decompressed heads
        text_metadata(w, {**hp, "head_dim": None})
        w.add_key_length(nope + rope)
        w.add_value_length(hp["v_head_dim"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp.get("n_shared_experts", 0))
    if hp.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    full, _ = rope_parameters(hp)
    if full.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * full["mscale_all_dim"])


def glm4_moe_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """GLM-4.5 MoE: block_count counts the next-token-prediction layers too; sigmoid gating."""
    nextn = hp.get("num_nextn_predict_layers") or 0
    text_metadata(w, {**hp, "num_hidden_layers": hp["num_hidden_layers"] + nextn})
    full, _ = rope_parameters(hp)
    fraction = full.get("partial_rotary_factor", hp.get("partial_rotary_factor", 0.5))
    w.add_rope_dimension_count(int(head_dim_of(hp) * fraction))
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    if hp.get("scoring_func") is None:  # text_metadata wrote it otherwise
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(hp["norm_topk_prob"])
    w.add_nextn_predict_layers(nextn)


def minimax_m2_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    text_metadata(w, hp)
    w.add_expert_feed_forward_length(hp["intermediate_size"])
    w.add_rope_dimension_count(hp.get("rotary_dim") or _rotary_dims(hp))


def gpt_oss_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    text_metadata(w, hp)
    w.add_sliding_window(hp["sliding_window"])
    w.add_expert_feed_forward_length(hp["intermediate_size"])


def gemma4_full_layers(hp: dict[str, Any]) -> tuple[int, int]:
    """(head_dim, KV heads) of Gemma 4's full layers: transformers keeps them in
    ``per_layer_config`` (keyed by layer: an int, or a string zero-padded to one width as
    saved), released configs as ``global_head_dim`` and ``num_global_key_value_heads``."""
    full = hp["layer_types"].index("full_attention")
    overrides = {int(k): v for k, v in (hp.get("per_layer_config") or {}).items()}
    layer = overrides.get(full) or {}
    global_kv = hp.get("num_global_key_value_heads") if hp.get("attention_k_eq_v") else None
    return (
        layer.get("head_dim", hp.get("global_head_dim", hp["head_dim"])),
        layer.get("num_key_value_heads", global_kv or hp["num_key_value_heads"]),
    )


def gemma4_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """The converter's Gemma 4 step over Gemma 3's: per-layer sliding flags and KV-head counts,
    the full layers' head width as key_length (the sliding ones' as key_length_swa); with
    ``use_double_wide_mlp``, feed_forward_length rewritten as one width per layer, twice the
    MLP's on the last ``num_kv_shared_layers``."""
    sliding = [kind == "sliding_attention" for kind in hp["layer_types"]]
    full_dim, full_kv = gemma4_full_layers(hp)
    full, local = rope_parameters(hp)
    text_metadata(w, {**hp, "rope_parameters": full, "head_dim": None, "num_key_value_heads": None})
    kv = hp["num_key_value_heads"]
    w.add_head_count_kv([kv if flag else full_kv for flag in sliding] if full_kv != kv else kv)
    w.add_rope_freq_base_swa(local["rope_theta"])
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])
    w.add_sliding_window_pattern(sliding)
    shared = hp.get("num_kv_shared_layers") or 0
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(hp.get("hidden_size_per_layer_input") or 0)
    if hp.get("use_double_wide_mlp"):
        layers, width = hp["num_hidden_layers"], hp["intermediate_size"]
        # Written over text_metadata's single value, as the converter does.
        w.add_feed_forward_length(
            [width * (2 if i >= layers - shared else 1) for i in range(layers)]
        )
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(hp["head_dim"])
    w.add_value_length_swa(hp["head_dim"])
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(int(hp["head_dim"] * local.get("partial_rotary_factor", 1.0)))
    if hp.get("enable_moe_block"):
        w.add_expert_used_count(hp["top_k_experts"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])


def llama4_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """Llama's, with HF's two feed-forward sizes swapped (the dense one is feed_forward_length)
    and a sliding window of 0 for a model whose layers all attend to everything."""
    llama_metadata(w, {**hp, "intermediate_size": hp["intermediate_size_mlp"]})
    w.add_interleave_moe_layer_step(hp["interleave_moe_layer_step"])
    w.add_expert_feed_forward_length(hp["intermediate_size"])
    kinds = hp.get("layer_types")
    if kinds and all(kind == "full_attention" for kind in kinds):
        w.add_sliding_window(0)


def qwen3next_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """Qwen2-MoE's keys and the Gated DeltaNet sizes as llama.cpp's ssm.* keys."""
    moe_metadata(w, hp)
    _gated_delta_net_metadata(w, hp)


def qwen35_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """Qwen3-Next's keys (Qwen2-MoE's only with experts) and the multimodal rope's sections,
    transformers' default ones where the config names none."""
    if hp.get("num_experts"):
        moe_metadata(w, hp)
    else:
        text_metadata(w, hp)
    _gated_delta_net_metadata(w, hp)
    full, _ = rope_parameters(hp)
    w.add_rope_dimension_sections([*full.get("mrope_section", [11, 11, 10]), 0])


def _gated_delta_net_metadata(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    # transformers keeps the interval only as the layer_types it makes of it.
    interval = hp.get("full_attention_interval") or hp["layer_types"].index("full_attention") + 1
    w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(_rotary_dims(hp))
