"""One table per GGUF ``general.architecture``: its metadata keys and tensor names in HF terms.

Each ``ArchSpec`` says which ``<arch>.*`` keys become which HF ``config.json`` keys, which GGUF
tensor becomes which HF parameter (HF on-disk names, as ``save_pretrained`` writes them), and
which of llama.cpp's converter transforms to undo. Settings the converter does not write, or that
llama.cpp derives from the tensors, are put back by the arch's ``finish`` step in ``config``.
Adding an architecture means adding a table here or in ``archs_recent`` (and a ``finish`` step
if llama.cpp hard-codes something); ``spec`` holds the vocabulary the tables share.
"""

from __future__ import annotations

from jax_llm_runtime.runtime.loading.gguf.archs_recent import RECENT_ARCHS
from jax_llm_runtime.runtime.loading.gguf.config import (
    finish_deepseek2,
    finish_gemma2,
    finish_gemma3,
    finish_glm4,
    finish_glm4_moe,
    finish_llama,
    finish_minimax_m2,
    finish_phi3,
    finish_qwen3,
    finish_stablelm,
)
from jax_llm_runtime.runtime.loading.gguf.spec import (
    ATTENTION,
    COMMON_METADATA,
    EXPERTS,
    GEMMA_LAYER,
    GEMMA_METADATA,
    LLAMA_LAYER,
    MOE_METADATA,
    QK_NORM,
    REQUIRED,
    RMS_REQUIRED,
    ROPE_DEFAULTS,
    SIGMOID_ROUTER,
    ArchSpec,
    make_spec,
)

__all__ = ["ARCHS", "ArchSpec"]

ARCHS: dict[str, ArchSpec] = {
    # Mixtral files are "llama" files with experts; finish_llama switches the HF architecture.
    "llama": make_spec(
        "LlamaForCausalLM",
        "llama",
        {**LLAMA_LAYER, "ffn_gate_inp": "block_sparse_moe.gate"},
        metadata={
            **COMMON_METADATA,
            **MOE_METADATA,
            "expert_count": "num_local_experts",
        },
        stacked_tensors={
            "ffn_gate_exps": ("block_sparse_moe.experts.{i}.w1", "num_local_experts"),
            "ffn_down_exps": ("block_sparse_moe.experts.{i}.w2", "num_local_experts"),
            "ffn_up_exps": ("block_sparse_moe.experts.{i}.w3", "num_local_experts"),
        },
        permute_qk=True,
        finish=finish_llama,
    ),
    "qwen2": make_spec("Qwen2ForCausalLM", "qwen2", LLAMA_LAYER),
    "qwen3": make_spec(
        "Qwen3ForCausalLM", "qwen3", {**LLAMA_LAYER, **QK_NORM}, finish=finish_qwen3
    ),
    "qwen2moe": make_spec(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        {
            **LLAMA_LAYER,
            "ffn_gate_inp": "mlp.gate",
            "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
            "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
            "ffn_up_shexp": "mlp.shared_expert.up_proj",
            "ffn_down_shexp": "mlp.shared_expert.down_proj",
        },
        metadata={
            **COMMON_METADATA,
            **MOE_METADATA,
            "expert_count": "num_experts",
            "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
        },
        # llama.cpp routes Qwen2-MoE without renormalizing the top-k weights, every layer sparse.
        defaults={
            "hidden_act": "silu",
            **ROPE_DEFAULTS,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        stacked_tensors=EXPERTS,
    ),
    "qwen3moe": make_spec(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        {**LLAMA_LAYER, **QK_NORM, "ffn_gate_inp": "mlp.gate"},
        metadata={**COMMON_METADATA, **MOE_METADATA, "expert_count": "num_experts"},
        # llama.cpp always renormalizes Qwen3-MoE's top-k weights; the converter writes no key.
        defaults={
            "hidden_act": "silu",
            **ROPE_DEFAULTS,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        stacked_tensors=EXPERTS,
        finish=finish_qwen3,
    ),
    # Phi-3 keeps HF's fused qkv_proj and gate_up_proj (GGUF attn_qkv and ffn_up).
    "phi3": make_spec(
        "Phi3ForCausalLM",
        "phi3",
        {
            "attn_norm": "input_layernorm",
            "attn_qkv": "self_attn.qkv_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_norm": "post_attention_layernorm",
            "ffn_up": "mlp.gate_up_proj",
            "ffn_down": "mlp.down_proj",
        },
        metadata={
            **COMMON_METADATA,
            "rope.scaling.original_context_length": "original_max_position_embeddings",
            "attention.sliding_window": "sliding_window",
        },
        finish=finish_phi3,
    ),
    "gemma2": make_spec(
        "Gemma2ForCausalLM",
        "gemma2",
        GEMMA_LAYER,
        metadata=GEMMA_METADATA,
        # llama.cpp's defaults for the keys the converter may leave out.
        defaults={
            "hidden_activation": "gelu_pytorch_tanh",
            **ROPE_DEFAULTS,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "attention_bias": False,
        },
        norm_shift=1.0,
        finish=finish_gemma2,
    ),
    "gemma3": make_spec(
        "Gemma3ForCausalLM",
        "gemma3_text",
        {**GEMMA_LAYER, **QK_NORM},
        metadata={**GEMMA_METADATA, "rope.freq_base_swa": "rope_local_base_freq"},
        defaults={
            "hidden_activation": "gelu_pytorch_tanh",
            **ROPE_DEFAULTS,
            "rope_local_base_freq": 10000.0,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "attention_bias": False,
        },
        norm_shift=1.0,
        finish=finish_gemma3,
    ),
    # StableLM uses LayerNorm with biases; stablelm-2-12b has one q/k LayerNorm per head.
    "stablelm": make_spec(
        "StableLmForCausalLM",
        "stablelm",
        LLAMA_LAYER,
        metadata={**COMMON_METADATA, "attention.layer_norm_epsilon": "layer_norm_eps"},
        required=(*REQUIRED, "attention.layer_norm_epsilon"),
        stacked_tensors={
            "attn_q_norm": ("self_attn.q_layernorm.norms.{i}", "num_attention_heads"),
            "attn_k_norm": ("self_attn.k_layernorm.norms.{i}", "num_key_value_heads"),
        },
        finish=finish_stablelm,
    ),
    "glm4": make_spec(
        "Glm4ForCausalLM",
        "glm4",
        {
            **ATTENTION,
            "post_attention_norm": "post_self_attn_layernorm",
            "ffn_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_mlp_layernorm",
            "ffn_up": "mlp.gate_up_proj",
            "ffn_down": "mlp.down_proj",
        },
        finish=finish_glm4,
    ),
    "deepseek2": make_spec(
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        {
            **LLAMA_LAYER,
            "attn_q_a": "self_attn.q_a_proj",
            "attn_q_a_norm": "self_attn.q_a_layernorm",
            "attn_q_b": "self_attn.q_b_proj",
            "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
            "attn_kv_a_norm": "self_attn.kv_a_layernorm",
            "attn_kv_b": "self_attn.kv_b_proj",
            **SIGMOID_ROUTER,
        },
        metadata={
            **COMMON_METADATA,
            **MOE_METADATA,
            "expert_count": "n_routed_experts",
            "expert_shared_count": "n_shared_experts",
            "expert_weights_scale": "routed_scaling_factor",
            "expert_weights_norm": "norm_topk_prob",
            "expert_group_count": "n_group",
            "expert_group_used_count": "topk_group",
            "leading_dense_block_count": "first_k_dense_replace",
            "attention.q_lora_rank": "q_lora_rank",
            "attention.kv_lora_rank": "kv_lora_rank",
        },
        required=(*RMS_REQUIRED, "attention.kv_lora_rank", "rope.dimension_count"),
        # llama.cpp's defaults: no renormalization or scaling of routing weights, no grouping.
        defaults={
            "hidden_act": "silu",
            **ROPE_DEFAULTS,
            "q_lora_rank": None,
            "first_k_dense_replace": 0,
            "n_shared_experts": 0,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": False,
        },
        stacked_tensors={key: (hf, "n_routed_experts") for key, (hf, _) in EXPERTS.items()},
        merge_kv_b=True,
        finish=finish_deepseek2,
    ),
    # The converter counts GLM-4.5's next-token-prediction layers in block_count; finish takes
    # them back out. It writes no expert groups (released models use one).
    "glm4moe": make_spec(
        "Glm4MoeForCausalLM",
        "glm4_moe",
        {
            **ATTENTION,
            **QK_NORM,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
            **SIGMOID_ROUTER,
        },
        metadata={
            **COMMON_METADATA,
            **MOE_METADATA,
            "expert_count": "n_routed_experts",
            "expert_shared_count": "n_shared_experts",
            "expert_weights_scale": "routed_scaling_factor",
            "expert_weights_norm": "norm_topk_prob",
            "expert_group_count": "n_group",
            "expert_group_used_count": "topk_group",
            "leading_dense_block_count": "first_k_dense_replace",
            "nextn_predict_layers": "num_nextn_predict_layers",
        },
        defaults={
            "hidden_act": "silu",
            **ROPE_DEFAULTS,
            "first_k_dense_replace": 0,
            "n_shared_experts": 0,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": False,
            "n_group": 1,
            "topk_group": 1,
            "num_nextn_predict_layers": 0,
        },
        stacked_tensors={key: (hf, "n_routed_experts") for key, (hf, _) in EXPERTS.items()},
        finish=finish_glm4_moe,
    ),
    # MiniMax-M2 keeps Mixtral's expert names; its q/k norms span all heads.
    "minimax-m2": make_spec(
        "MiniMaxM2ForCausalLM",
        "minimax_m2",
        {
            **ATTENTION,
            **QK_NORM,
            "ffn_norm": "post_attention_layernorm",
            "ffn_gate_inp": "block_sparse_moe.gate",
            "exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias",
        },
        metadata={
            **COMMON_METADATA,
            "expert_count": "num_local_experts",
            "expert_used_count": "num_experts_per_tok",
            # HF's intermediate_size is the experts' (every layer is MoE).
            "expert_feed_forward_length": "intermediate_size",
        },
        required=(*RMS_REQUIRED, "expert_count", "expert_used_count"),
        stacked_tensors={
            "ffn_gate_exps": ("block_sparse_moe.experts.{i}.w1", "num_local_experts"),
            "ffn_down_exps": ("block_sparse_moe.experts.{i}.w2", "num_local_experts"),
            "ffn_up_exps": ("block_sparse_moe.experts.{i}.w3", "num_local_experts"),
        },
        finish=finish_minimax_m2,
    ),
    **RECENT_ARCHS,
}
