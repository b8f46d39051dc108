"""The vocabulary of the GGUF architecture tables: ``ArchSpec`` and the metadata keys and tensor
names that many architectures share (``archs`` and ``archs_recent`` compose their tables from
these).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jax_llm_runtime.runtime.loading.gguf.config import GGUFModel, finish_nothing


@dataclass(frozen=True)
class Join:
    """One HF tensor made of two GGUF tensors: ``second`` (a full name after ``blk.N.``) after
    the first, or, with ``interleave``, alternating with it one slice at a time along ``axis``
    (-2: rows of output channels; -1: the values of a bias). ``second`` None: the first tensor
    holds both halves, one after the other along ``axis`` (``--fuse-gate-up-exps`` files)."""

    second: str | None
    hf: str  # the HF name after ``model.layers.N.``
    axis: int = -2
    interleave: bool = False


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
    # HF norm names (endings) the shift leaves alone (Qwen3-Next's gated norm is stored as is).
    unshifted_norms: tuple[str, ...] = ()
    # DeepSeek files split HF's kv_b_proj into attn_k_b (transposed per head) and attn_v_b.
    merge_kv_b: bool = False
    finish: Callable[[dict[str, Any], GGUFModel], None] = finish_nothing
    # HF tensors made of two GGUF tensors (gpt-oss's interleaved gate_up_proj), keyed by the
    # first one's full name; the second may come first in the file.
    joined_tensors: Mapping[str, Join] = field(default_factory=dict)
    # HF names (after ``model.layers.N.``) of tensors stored ``[..., in, out]``, not torch's
    # ``[..., out, in]`` (gpt-oss's expert stacks): float values are transposed after conversion.
    in_out: frozenset[str] = frozenset()
    # Gated DeltaNet layers (Qwen3-Next, Qwen3.5): the converter stores A_log as -exp(A_log)
    # and the conv kernel without its middle axis.
    gated_delta_net: bool = False
    # Qwen3-Next's converter splits in_proj_qkvz (per key head: q, k, v, z) into attn_qkv (all
    # q, all k, all v) and attn_gate (z).
    joined_qkvz: bool = False
    # Qwen3.5's converter reorders the value heads from grouped by key head to tiled (one of
    # each group, then the next), in every tensor that has them.
    tiled_v_heads: bool = False

    def __post_init__(self) -> None:
        for first, join in self.joined_tensors.items():
            if join.hf in self.in_out and join.axis != -2:
                raise ValueError(f"joined tensor {first!r} stored [in, out] must join rows")
        for stem, (template, _) in self.stacked_tensors.items():
            if "{i}" not in template:
                raise ValueError(
                    f"stacked tensor {stem!r} needs '{{i}}' in its HF name {template!r}"
                )


COMMON_METADATA = {
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
REQUIRED = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
)
RMS_REQUIRED = (*REQUIRED, "attention.layer_norm_rms_epsilon")
# llama.cpp's default when a file has no rope.freq_base.
ROPE_DEFAULTS = {"rope_theta": 10000.0}
MOE_METADATA = {
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}

GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
MLP = {
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_LAYER = {**ATTENTION, **MLP}
# Expert tensors are stacked [num_experts, out, in] in GGUF and one tensor per expert in HF.
EXPERTS = {
    "ffn_gate_exps": ("mlp.experts.{i}.gate_proj", "num_experts"),
    "ffn_up_exps": ("mlp.experts.{i}.up_proj", "num_experts"),
    "ffn_down_exps": ("mlp.experts.{i}.down_proj", "num_experts"),
}
# DeepSeek V3's router, correction bias and shared experts (GLM-4.5 names them the same).
SIGMOID_ROUTER = {
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
GEMMA_LAYER = {
    **ATTENTION,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GEMMA_METADATA = {
    **COMMON_METADATA,
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}


def make_spec(
    hf_architecture: str, model_type: str, layer_tensors: Mapping[str, str], **kwargs: Any
) -> ArchSpec:
    """An ``ArchSpec`` with what most architectures share unless ``kwargs`` say otherwise: the
    common metadata keys, RMS norms, silu, llama.cpp's rope base and the global tensors."""
    kwargs.setdefault("metadata", COMMON_METADATA)
    kwargs.setdefault("required", RMS_REQUIRED)
    kwargs.setdefault("defaults", {"hidden_act": "silu", **ROPE_DEFAULTS})
    kwargs.setdefault("global_tensors", GLOBAL)
    return ArchSpec(hf_architecture, model_type, layer_tensors=layer_tensors, **kwargs)
