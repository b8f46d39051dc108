"""KV cache layout: one array for K and one for V, all layers stacked.

``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``: a page holds ``page_size`` token
positions of one layer; writing one token touches one contiguous ``[num_kv_heads, head_dim]`` row.
Layers are stacked so a ``lax.scan`` over layers can carry the whole cache and update it in place
(slicing a layer out as a scan input would copy it every step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


def kv_cache_shape(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """Shape of the K (and of the V) cache array."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return (num_layers, num_pages, page_size, num_kv_heads, head_dim)


def write_kv(
    k_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer: jax.Array,  # [] int32
    k: jax.Array,  # [num_seqs, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [num_seqs, q_len, num_kv_heads, head_dim]
    positions: jax.Array,  # [num_seqs, q_len] int32
    q_lens: jax.Array,  # [num_seqs] int32, valid query tokens per sequence
    page_indices: jax.Array,  # [num_seqs, pages_per_seq] int32
) -> tuple[jax.Array, jax.Array]:
    """Scatter the new tokens' K and V into their pages; padding tokens write nothing.

    Token j of sequence s goes to page ``page_indices[s, positions[s, j] // page_size]`` at offset
    ``positions[s, j] % page_size``. Tokens with ``j >= q_lens[s]`` are dropped (their page index is
    pointed past the end of the cache and the scatter runs with ``mode="drop"``).
    """
    num_pages, page_size = k_cache.shape[1], k_cache.shape[2]
    q_len = positions.shape[1]
    logical_page = positions // page_size  # [num_seqs, q_len]
    page = jnp.take_along_axis(
        page_indices, jnp.clip(logical_page, 0, page_indices.shape[1] - 1), 1
    )
    valid = jnp.arange(q_len)[None, :] < q_lens[:, None]  # [num_seqs, q_len]
    page = jnp.where(valid, page, num_pages)
    offset = positions % page_size
    k_cache = k_cache.at[layer, page, offset].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[layer, page, offset].set(v.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


@struct.dataclass
class KVCache:
    """The paged K and V arrays of all layers; donated to every step and returned updated."""

    k: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]

    @classmethod
    def zeros(
        cls, shape: tuple[int, ...], dtype: jnp.dtype, v_shape: tuple[int, ...] | None = None
    ) -> KVCache:
        """A zeroed cache; V has K's shape unless ``v_shape`` says otherwise (MLA's empty V)."""
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(v_shape or shape, dtype))
