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
