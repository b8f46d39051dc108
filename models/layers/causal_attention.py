"""Plain causal self-attention over the given tokens only, without the paged KV cache.

Used where a forward must leave the cache untouched (embeddings, prompt scoring): every sequence
attends to its own first ``lengths`` tokens, causally.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jax_llm_runtime.models.layers.attention import (
    AttentionConfig,
    LayerMeta,
    layer_window,
    output_projection,
    project_qkv,
)


def causal_self_attention(
    cfg: AttentionConfig,
    x: jax.Array,  # [num_seqs, seq_len, hidden]
    lw: Mapping[str, jax.Array],  # one layer's attention weights (see models.layers.attention)
    positions: jax.Array,  # [num_seqs, seq_len] int32
    lengths: jax.Array,  # [num_seqs] int32, valid tokens per sequence
    meta: LayerMeta,
) -> jax.Array:  # [num_seqs, seq_len, hidden]
    """Project, rotate, attend causally within each sequence's valid tokens, project out.

    Padding queries (index >= length) still see key 0, so they stay finite; their outputs are
    never read.
    """
    num_seqs, seq_len, _ = x.shape
    group = cfg.num_heads // cfg.num_kv_heads
    q, k, v = project_qkv(cfg, x, lw, positions, meta)
    if cfg.round_kv_to is not None:
        k = k.astype(cfg.round_kv_to).astype(k.dtype)
        v = v.astype(cfg.round_kv_to).astype(v.dtype)
    q = q.reshape(num_seqs, seq_len, cfg.num_kv_heads, group, cfg.head_dim)
    scores = jnp.einsum(
        "bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32
    )  # [num_seqs, num_kv_heads, group, seq_len, seq_len]
    scores = scores * cfg.scale
    if cfg.soft_cap is not None:
        scores = cfg.soft_cap * jnp.tanh(scores / cfg.soft_cap)
    idx = jnp.arange(seq_len)
    mask = idx[None, :] <= idx[:, None]  # [q, s] causal
    window = layer_window(cfg, meta)
    if window is not None:
        mask &= idx[:, None] - idx[None, :] < window
    mask = mask[None] & (idx < lengths[:, None])[:, None, :]  # [num_seqs, q, s]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v)
    return output_projection(cfg, out.reshape(num_seqs, seq_len, cfg.num_heads, cfg.head_dim), lw)
