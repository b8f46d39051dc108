"""Self-attention over the paged KV cache: project, rotate, write K/V, attend, project out."""

from __future__ import annotations

from dataclasses import dataclass

import jax

from models.batch import StepBatch
from models.layers.linear import linear
from models.layers.rotary import RopeConfig, apply_rope
from pallas_kernels.paged_attention import KVCache, paged_attention, write_kv


@dataclass(frozen=True)
class AttentionConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    sliding_window: int | None = None
    soft_cap: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


def paged_self_attention(
    cfg: AttentionConfig,
    x: jax.Array,  # [num_seqs, q_len, hidden]
    wq: jax.Array,  # [hidden, num_heads * head_dim]
    wk: jax.Array,  # [hidden, num_kv_heads * head_dim]
    wv: jax.Array,  # [hidden, num_kv_heads * head_dim]
    wo: jax.Array,  # [num_heads * head_dim, hidden]
    cache: KVCache,
    layer: jax.Array,  # [] int32
    batch: StepBatch,
) -> tuple[jax.Array, KVCache]:  # [num_seqs, q_len, hidden]
    """Attention for one layer; this step's K/V are written to their pages before attending."""
    num_seqs, q_len, _ = x.shape
    q = linear(x, wq).reshape(num_seqs, q_len, cfg.num_heads, cfg.head_dim)
    k = linear(x, wk).reshape(num_seqs, q_len, cfg.num_kv_heads, cfg.head_dim)
    v = linear(x, wv).reshape(num_seqs, q_len, cfg.num_kv_heads, cfg.head_dim)
    q = apply_rope(q, batch.positions, cfg.rope)
    k = apply_rope(k, batch.positions, cfg.rope)
    k_cache, v_cache = write_kv(
        cache.k, cache.v, layer, k, v, batch.positions, batch.q_lens, batch.page_indices
    )
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        layer,
        batch.positions,
        batch.page_indices,
        batch.kv_lens,
        scale=cfg.scale,
        sliding_window=cfg.sliding_window,
        soft_cap=cfg.soft_cap,
    )
    out = linear(out.reshape(num_seqs, q_len, cfg.num_heads * cfg.head_dim), wo)
    return out, KVCache(k=k_cache, v=v_cache)
