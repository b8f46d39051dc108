"""Self-attention over the paged KV cache: project, rotate, write K/V, attend, project out.

A layer's attention weights are a dict: ``wq``, ``wk``, ``wv``, ``wo`` always; ``bq``, ``bk``,
``bv`` when ``qkv_bias`` (Qwen2); ``q_norm``, ``k_norm`` when ``qk_norm_eps`` is set (Qwen3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax

from models.batch import StepBatch
from models.layers.linear import linear
from models.layers.norms import rms_norm
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
    qkv_bias: bool = False
    qk_norm_eps: float | None = None  # per-head RMSNorm on q and k before rope when set

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


def project_qkv(
    cfg: AttentionConfig,
    x: jax.Array,  # [num_seqs, q_len, hidden]
    lw: Mapping[str, jax.Array],  # one layer's attention weights (see the module docstring)
    positions: jax.Array,  # [num_seqs, q_len] int32
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [num_seqs, q_len, num_heads, head_dim] and k, v [num_seqs, q_len, num_kv_heads, head_dim],
    with q and k normed (when configured) and rotated."""
    num_seqs, q_len, _ = x.shape
    bq, bk, bv = (lw["bq"], lw["bk"], lw["bv"]) if cfg.qkv_bias else (None, None, None)
    q = linear(x, lw["wq"], bq).reshape(num_seqs, q_len, cfg.num_heads, cfg.head_dim)
    k = linear(x, lw["wk"], bk).reshape(num_seqs, q_len, cfg.num_kv_heads, cfg.head_dim)
    v = linear(x, lw["wv"], bv).reshape(num_seqs, q_len, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm_eps is not None:
        q = rms_norm(q, lw["q_norm"], cfg.qk_norm_eps)
        k = rms_norm(k, lw["k_norm"], cfg.qk_norm_eps)
    return apply_rope(q, positions, cfg.rope), apply_rope(k, positions, cfg.rope), v


def paged_self_attention(
    cfg: AttentionConfig,
    x: jax.Array,  # [num_seqs, q_len, hidden]
    lw: Mapping[str, jax.Array],  # one layer's attention weights (see the module docstring)
    cache: KVCache,
    layer: jax.Array,  # [] int32
    batch: StepBatch,
) -> tuple[jax.Array, KVCache]:  # [num_seqs, q_len, hidden]
    """Attention for one layer; this step's K/V are written to their pages before attending."""
    num_seqs, q_len, _ = x.shape
    q, k, v = project_qkv(cfg, x, lw, batch.positions)
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
    out = linear(out.reshape(num_seqs, q_len, cfg.num_heads * cfg.head_dim), lw["wo"])
    return out, KVCache(k=k_cache, v=v_cache)
