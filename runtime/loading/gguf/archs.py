"""One table per GGUF ``general.architecture``: its metadata keys and tensor names in HF terms.

Each ``ArchSpec`` says which ``<arch>.*`` keys become which HF ``config.json`` keys, which GGUF
tensor becomes which HF parameter (HF on-disk names, as ``save_pretrained`` writes them), and
which of llama.cpp's converter transforms to undo. Settings the converter does not write, or that
llama.cpp derives from the tensors, are put back by the arch's ``finish`` step in ``gguf_config``.
Adding an architecture means adding a table here (and a ``finish`` step if llama.cpp hard-codes
something).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jax_llm_runtime.runtime.loading.gguf.config import (
    GGUFModel,
    finish_deepseek2,
    finish_gemma2,
    finish_gemma3,
    finish_glm4,
    finish_glm4_moe,
    finish_llama,
    finish_minimax_m2,
    finish_nothing,
    finish_phi3,
    finish_qwen3,
    finish_stablelm,
)


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture maps onto an HF architecture.

    Tensor tables are keyed by GGUF name without the ``.weight``/``.bias`` suffix (the suffix
    carries over to the HF name) or, where HF spells the suffix differently, by the full name.
    Layer tensor names are relative to ``blk.N.`` on the GGUF side and ``model.layers.N.`` on the
    HF side. ``stacked_tensors`` are 2D/3D GGUF tensors whose rows along axis 0 are separate HF
    tensors (``{i}`` in the HF name), with the config key that counts them.
    """

    hf_architecture: str
    model_type: str
    metadata: Mapping[str, str]  # key after "<arch>." -> HF config key
    required: tuple[str, ...]  # keys after "<arch>." that must be present
    defaults: Mapping[str, Any]
    layer_tensors: Mapping[str, str]
    global_tensors: Mapping[str, str]
    stacked_tensors: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # llama.cpp's converter reorders q/k rows of "llama" files so that its rope can rotate adjacent
    # pairs; HF rotates the two halves of each head, so those rows are put back.
    permute_qk: bool = False
    # Gemma's converter stores every HF ``*norm.weight`` as ``w + 1`` (llama.cpp multiplies by the
    # stored value, HF by ``1 + w``).
    norm_shift: float = 0.0
    # DeepSeek files split HF's kv_b_proj into attn_k_b (transposed per head) and attn_v_b.
    merge_kv_b: bool = False
    finish: Callable[[dict[str, Any], GGUFModel], None] = finish_nothing

    def __post_init__(self) -> None:
        for stem, (template, _) in self.stacked_tensors.items():
            if "{i}" not in template:
                raise ValueError(
                    f"stacked tensor {stem!r} needs '{{i}}' in its HF name {template!r}"
                )


_COMMON_METADATA = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
_REQUIRED = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
)
_RMS_REQUIRED = (*_REQUIRED, "attention.layer_norm_rms_epsilon")
# llama.cpp's default when a file has no rope.freq_base.
_ROPE_DEFAULTS = {"rope_theta": 10000.0}
_MOE_METADATA = {
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MLP = {
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_LAYER = {**_ATTENTION, **_MLP}
# Expert tensors are stacked [num_experts, out, in] in GGUF and one tensor per expert in HF.
_EXPERTS = {
    "ffn_gate_exps": ("mlp.experts.{i}.gate_proj", "num_experts"),
    "ffn_up_exps": ("mlp.experts.{i}.up_proj", "num_experts"),
    "ffn_down_exps": ("mlp.experts.{i}.down_proj", "num_experts"),
}
# DeepSeek V3's router, correction bias and shared experts (GLM-4.5 names them the same).
_SIGMOID_ROUTER = {
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_GEMMA_LAYER = {
    **_ATTENTION,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_METADATA = {
    **_COMMON_METADATA,
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}


def _spec(
    hf_architecture: str, model_type: str, layer_tensors: Mapping[str, str], **kwargs: Any
) -> ArchSpec:
    kwargs.setdefault("metadata", _COMMON_METADATA)
    kwargs.setdefault("required", _RMS_REQUIRED)
    kwargs.setdefault("defaults", {"hidden_act": "silu", **_ROPE_DEFAULTS})
    kwargs.setdefault("global_tensors", _GLOBAL)
    return ArchSpec(hf_architecture, model_type, layer_tensors=layer_tensors, **kwargs)


ARCHS: dict[str, ArchSpec] = {
    # Mixtral files are "llama" files with experts; finish_llama switches the HF architecture.
    "llama": _spec(
        "LlamaForCausalLM",
        "llama",
        {**_LLAMA_LAYER, "ffn_gate_inp": "block_sparse_moe.gate"},
        metadata={
            **_COMMON_METADATA,
            **_MOE_METADATA,
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
    "qwen2": _spec("Qwen2ForCausalLM", "qwen2", _LLAMA_LAYER),
    "qwen3": _spec("Qwen3ForCausalLM", "qwen3", {**_LLAMA_LAYER, **_QK_NORM}, finish=finish_qwen3),
    "qwen2moe": _spec(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        {
            **_LLAMA_LAYER,
            "ffn_gate_inp": "mlp.gate",
            "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
            "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
            "ffn_up_shexp": "mlp.shared_expert.up_proj",
            "ffn_down_shexp": "mlp.shared_expert.down_proj",
        },
        metadata={
            **_COMMON_METADATA,
            **_MOE_METADATA,
            "expert_count": "num_experts",
            "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
        },
        # llama.cpp routes Qwen2-MoE without renormalizing the top-k weights, every layer sparse.
        defaults={
            "hidden_act": "silu",
            **_ROPE_DEFAULTS,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        stacked_tensors=_EXPERTS,
    ),
    "qwen3moe": _spec(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        {**_LLAMA_LAYER, **_QK_NORM, "ffn_gate_inp": "mlp.gate"},
        metadata={**_COMMON_METADATA, **_MOE_METADATA, "expert_count": "num_experts"},
        # llama.cpp always renormalizes Qwen3-MoE's top-k weights; the converter writes no key.
        defaults={
            "hidden_act": "silu",
            **_ROPE_DEFAULTS,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        stacked_tensors=_EXPERTS,
        finish=finish_qwen3,
    ),
    # Phi-3 keeps HF's fused qkv_proj and gate_up_proj (GGUF attn_qkv and ffn_up).
    "phi3": _spec(
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
            **_COMMON_METADATA,
            "rope.scaling.original_context_length": "original_max_position_embeddings",
            "attention.sliding_window": "sliding_window",
        },
        finish=finish_phi3,
    ),
    "gemma2": _spec(
        "Gemma2ForCausalLM",
        "gemma2",
        _GEMMA_LAYER,
        metadata=_GEMMA_METADATA,
        # llama.cpp's defaults for the keys the converter may leave out.
        defaults={
            "hidden_activation": "gelu_pytorch_tanh",
            **_ROPE_DEFAULTS,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "attention_bias": False,
        },
        norm_shift=1.0,
        finish=finish_gemma2,
    ),
    "gemma3": _spec(
        "Gemma3ForCausalLM",
        "gemma3_text",
        {**_GEMMA_LAYER, **_QK_NORM},
        metadata={**_GEMMA_METADATA, "rope.freq_base_swa": "rope_local_base_freq"},
        defaults={
            "hidden_activation": "gelu_pytorch_tanh",
            **_ROPE_DEFAULTS,
            "rope_local_base_freq": 10000.0,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "attention_bias": False,
        },
        norm_shift=1.0,
        finish=finish_gemma3,
    ),
    # StableLM uses LayerNorm with biases; stablelm-2-12b has one q/k LayerNorm per head.
    "stablelm": _spec(
        "StableLmForCausalLM",
        "stablelm",
        _LLAMA_LAYER,
        metadata={**_COMMON_METADATA, "attention.layer_norm_epsilon": "layer_norm_eps"},
        required=(*_REQUIRED, "attention.layer_norm_epsilon"),
        stacked_tensors={
            "attn_q_norm": ("self_attn.q_layernorm.norms.{i}", "num_attention_heads"),
            "attn_k_norm": ("self_attn.k_layernorm.norms.{i}", "num_key_value_heads"),
        },
        finish=finish_stablelm,
    ),
    "glm4": _spec(
        "Glm4ForCausalLM",
        "glm4",
        {
            **_ATTENTION,
            "post_attention_norm": "post_self_attn_layernorm",
            "ffn_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_mlp_layernorm",
            "ffn_up": "mlp.gate_up_proj",
            "ffn_down": "mlp.down_proj",
        },
        finish=finish_glm4,
    ),
    "deepseek2": _spec(
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        {
            **_LLAMA_LAYER,
            "attn_q_a": "self_attn.q_a_proj",
            "attn_q_a_norm": "self_attn.q_a_layernorm",
            "attn_q_b": "self_attn.q_b_proj",
            "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
            "attn_kv_a_norm": "self_attn.kv_a_layernorm",
            "attn_kv_b": "self_attn.kv_b_proj",
            **_SIGMOID_ROUTER,
        },
        metadata={
            **_COMMON_METADATA,
            **_MOE_METADATA,
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
        required=(*_RMS_REQUIRED, "attention.kv_lora_rank", "rope.dimension_count"),
        # llama.cpp's defaults: no renormalization or scaling of routing weights, no grouping.
        defaults={
            "hidden_act": "silu",
            **_ROPE_DEFAULTS,
            "q_lora_rank": None,
            "first_k_dense_replace": 0,
            "n_shared_experts": 0,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": False,
        },
        stacked_tensors={key: (hf, "n_routed_experts") for key, (hf, _) in _EXPERTS.items()},
        merge_kv_b=True,
        finish=finish_deepseek2,
    ),
    # The converter counts GLM-4.5's next-token-prediction layers in block_count; finish takes
    # them back out. It writes no expert groups (released models use one).
    "glm4moe": _spec(
        "Glm4MoeForCausalLM",
        "glm4_moe",
        {
            **_ATTENTION,
            **_QK_NORM,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
            **_SIGMOID_ROUTER,
        },
        metadata={
            **_COMMON_METADATA,
            **_MOE_METADATA,
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
            **_ROPE_DEFAULTS,
            "first_k_dense_replace": 0,
            "n_shared_experts": 0,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": False,
            "n_group": 1,
            "topk_group": 1,
            "num_nextn_predict_layers": 0,
        },
        stacked_tensors={key: (hf, "n_routed_experts") for key, (hf, _) in _EXPERTS.items()},
        finish=finish_glm4_moe,
    ),
    # MiniMax-M2 keeps Mixtral's expert names; its q/k norms span all heads.
    "minimax-m2": _spec(
        "MiniMaxM2ForCausalLM",
        "minimax_m2",
        {
            **_ATTENTION,
            **_QK_NORM,
            "ffn_norm": "post_attention_layernorm",
            "ffn_gate_inp": "block_sparse_moe.gate",
            "exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias",
        },
        metadata={
            **_COMMON_METADATA,
            "expert_count": "num_local_experts",
            "expert_used_count": "num_experts_per_tok",
            # HF's intermediate_size is the experts' (every layer is MoE).
            "expert_feed_forward_length": "intermediate_size",
        },
        required=(*_RMS_REQUIRED, "expert_count", "expert_used_count"),
        stacked_tensors={
            "ffn_gate_exps": ("block_sparse_moe.experts.{i}.w1", "num_local_experts"),
            "ffn_down_exps": ("block_sparse_moe.experts.{i}.w2", "num_local_experts"),
            "ffn_up_exps": ("block_sparse_moe.experts.{i}.w3", "num_local_experts"),
        },
        finish=finish_minimax_m2,
    ),
}
