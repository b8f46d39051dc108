"""Attention over a packed run of image patches, as the towers of images of any size use it
(``models.vision.pixtral``, ``models.vision.qwen3_vl``): each patch sees the patches its
``visible`` row allows (those of its own image), one head at a time."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def packed_attention(
    q: jax.Array,  # [heads, p, head_dim], rotated
    k: jax.Array,  # [heads, p, head_dim], rotated
    v: jax.Array,  # [heads, p, head_dim]
    visible: jax.Array,  # [p, p] bool: query row sees key column
) -> jax.Array:  # [p, heads * head_dim]
    """Softmax attention with scores in float32, scaled by ``head_dim ** -0.5``."""
    heads, p, head_dim = q.shape

    def one_head(qkv: tuple[jax.Array, ...]) -> jax.Array:  # [p, head_dim]
        q, k, v = qkv
        scores = jnp.einsum("qd,kd->qk", q, k, preferred_element_type=jnp.float32)
        # A finite floor, not -inf: a padding patch sees nothing and must not make NaN.
        scores = jnp.where(visible, scores * head_dim**-0.5, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return probs @ v

    # A head at a time: the scores of thousands of patches are large per head.
    return jax.lax.map(one_head, (q, k, v)).transpose(1, 0, 2).reshape(p, heads * head_dim)
