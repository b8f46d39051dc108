"""Llama (and the many checkpoints that share its layout: SmolLM, Yi, DeepSeek-R1-Distill-Llama)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.batch import StepBatch
from models.layers.attention import AttentionConfig, paged_self_attention
from models.layers.causal_attention import causal_self_attention
from models.layers.mlp import gated_mlp
from models.layers.norms import rms_norm
from models.layers.rotary import rope_from_hf
from models.weights import WeightRule, load_weights
from pallas_kernels.paged_attention import KVCache


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention: AttentionConfig

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_kv_heads(self) -> int:
        return self.attention.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **attention: Any) -> LlamaConfig:
        """The one place HF ``config.json`` names shared by Llama-like models are read.

        ``attention`` sets the AttentionConfig fields an architecture adds (``qkv_bias``,
        ``qk_norm_eps``); their files read their own HF names.
        """
        num_heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention=AttentionConfig(
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rope=rope_from_hf(hf, head_dim),
                **attention,
            ),
        )


_LAYER = r"model\.layers\.(\d+)\."
WEIGHT_RULES = (
    WeightRule(r"model\.embed_tokens\.weight", "embed"),
    WeightRule(r"model\.norm\.weight", "final_norm"),
    WeightRule(r"lm_head\.weight", "lm_head", transpose=True),
    WeightRule(_LAYER + r"input_layernorm\.weight", "attn_norm", per_layer=True),
    WeightRule(_LAYER + r"self_attn\.q_proj\.weight", "wq", transpose=True, per_layer=True),
    WeightRule(_LAYER + r"self_attn\.k_proj\.weight", "wk", transpose=True, per_layer=True),
    WeightRule(_LAYER + r"self_attn\.v_proj\.weight", "wv", transpose=True, per_layer=True),
    WeightRule(_LAYER + r"self_attn\.o_proj\.weight", "wo", transpose=True, per_layer=True),
    WeightRule(_LAYER + r"self_attn\.q_proj\.bias", "bq", per_layer=True),
    WeightRule(_LAYER + r"self_attn\.k_proj\.bias", "bk", per_layer=True),
    WeightRule(_LAYER + r"self_attn\.v_proj\.bias", "bv", per_layer=True),
    WeightRule(_LAYER + r"self_attn\.q_norm\.weight", "q_norm", per_layer=True),
    WeightRule(_LAYER + r"self_attn\.k_norm\.weight", "k_norm", per_layer=True),
    WeightRule(_LAYER + r"post_attention_layernorm\.weight", "mlp_norm", per_layer=True),
    WeightRule(_LAYER + r"mlp\.gate_proj\.weight", "w_gate", transpose=True, per_layer=True),
    WeightRule(_LAYER + r"mlp\.up_proj\.weight", "w_up", transpose=True, per_layer=True),
    WeightRule(_LAYER + r"mlp\.down_proj\.weight", "w_down", transpose=True, per_layer=True),
    WeightRule(_LAYER + r"self_attn\.rotary_emb\.inv_freq", None),
)
_LAYER_FIELDS = (
    *("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"),
    *("bq", "bk", "bv", "q_norm", "k_norm"),  # only where the attention config asks for them
)


def weight_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every weight field and its shape; per-layer fields are stacked on a leading layer axis."""
    a, n = cfg.attention, cfg.num_layers
    shapes = {
        "embed": (cfg.vocab_size, cfg.hidden_size),
        "final_norm": (cfg.hidden_size,),
        "attn_norm": (n, cfg.hidden_size),
        "wq": (n, cfg.hidden_size, a.num_heads * a.head_dim),
        "wk": (n, cfg.hidden_size, a.num_kv_heads * a.head_dim),
        "wv": (n, cfg.hidden_size, a.num_kv_heads * a.head_dim),
        "wo": (n, a.num_heads * a.head_dim, cfg.hidden_size),
        "mlp_norm": (n, cfg.hidden_size),
        "w_gate": (n, cfg.hidden_size, cfg.intermediate_size),
        "w_up": (n, cfg.hidden_size, cfg.intermediate_size),
        "w_down": (n, cfg.intermediate_size, cfg.hidden_size),
    }
    if a.qkv_bias:
        shapes["bq"] = (n, a.num_heads * a.head_dim)
        shapes["bk"] = shapes["bv"] = (n, a.num_kv_heads * a.head_dim)
    if a.qk_norm_eps is not None:
        shapes["q_norm"] = shapes["k_norm"] = (n, a.head_dim)
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


def load(
    cfg: LlamaConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype: jnp.dtype,
    num_tensors: int | None = None,
) -> dict[str, Any]:
    """Checkpoint tensors (HF names) -> the weight pytree ``forward`` takes."""
    flat = load_weights(weight_shapes(cfg), WEIGHT_RULES, tensors, dtype, num_tensors)
    weights: dict[str, Any] = {k: v for k, v in flat.items() if k not in _LAYER_FIELDS}
    weights["layers"] = {k: flat[k] for k in _LAYER_FIELDS if k in flat}
    return weights


def forward(
    cfg: LlamaConfig, weights: dict[str, Any], cache: KVCache, batch: StepBatch
) -> tuple[jax.Array, KVCache]:  # logits [num_seqs, vocab] float32
    """Run the new tokens through all layers; return logits at each sequence's last new token."""
    x = weights["embed"][batch.tokens]  # [num_seqs, q_len, hidden]

    def layer_step(carry: tuple[jax.Array, KVCache], xs: tuple[dict, jax.Array]):
        x, cache = carry
        lw, layer = xs
        h = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps)
        attn, cache = paged_self_attention(cfg.attention, h, lw, cache, layer, batch)
        x = x + attn
        h = rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps)
        x = x + gated_mlp(h, lw["w_gate"], lw["w_up"], lw["w_down"])
        return (x, cache), None

    layers = (weights["layers"], jnp.arange(cfg.num_layers, dtype=jnp.int32))
    (x, cache), _ = jax.lax.scan(layer_step, (x, cache), layers)
    last = jnp.maximum(batch.q_lens - 1, 0)
    h = x[jnp.arange(x.shape[0]), last]  # [num_seqs, hidden]
    h = rms_norm(h, weights["final_norm"], cfg.rms_norm_eps)
    return lm_head(cfg, weights, h), cache


def lm_head(
    cfg: LlamaConfig,
    weights: dict[str, Any],
    h: jax.Array,  # [..., hidden], final-normed
) -> jax.Array:  # [..., vocab] float32
    """Logits from final-normed hidden states (the tied embedding when there is no LM head)."""
    if cfg.tie_word_embeddings:
        return jnp.einsum("...h,vh->...v", h, weights["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("...h,hv->...v", h, weights["lm_head"], preferred_element_type=jnp.float32)


def hidden_states(
    cfg: LlamaConfig,
    weights: dict[str, Any],
    tokens: jax.Array,  # [num_seqs, seq_len] int32
    positions: jax.Array,  # [num_seqs, seq_len] int32
    lengths: jax.Array,  # [num_seqs] int32, valid tokens per sequence
) -> jax.Array:  # [num_seqs, seq_len, hidden] float32
    """The final-normed hidden state of every position, without the KV cache (embeddings).

    Attention is plain causal attention within each sequence's first ``lengths`` tokens; rows
    past a sequence's length are padding and hold garbage.
    """
    x = weights["embed"][tokens]  # [num_seqs, seq_len, hidden]

    def layer_step(x: jax.Array, lw: dict) -> tuple[jax.Array, None]:
        h = rms_norm(x, lw["attn_norm"], cfg.rms_norm_eps)
        x = x + causal_self_attention(cfg.attention, h, lw, positions, lengths)
        h = rms_norm(x, lw["mlp_norm"], cfg.rms_norm_eps)
        return x + gated_mlp(h, lw["w_gate"], lw["w_up"], lw["w_down"]), None

    x, _ = jax.lax.scan(layer_step, x, weights["layers"])
    return rms_norm(x, weights["final_norm"], cfg.rms_norm_eps).astype(jnp.float32)
