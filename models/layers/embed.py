"""Token embeddings: the ``[vocab, hidden]`` table, split over the mesh by vocabulary rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_llm_runtime.models.layers.params import EMBED, VOCAB, Block, declare


class Embed(Block):
    """The embedding table (``embed``); ``scale`` multiplies looked-up rows (Gemma's
    sqrt(hidden_size)). A tied LM head reads the same table (``attend``)."""

    def __init__(
        self, vocab_size: int, hidden: int, dtype: jnp.dtype, scale: float | None = None
    ) -> None:
        self.scale = scale
        self.embedding = declare((vocab_size, hidden), dtype, (VOCAB, EMBED), "embed")

    def __call__(self, tokens: jax.Array) -> jax.Array:  # [...] int32 -> [..., hidden]
        x = self.embedding.get_value()[tokens]
        if self.scale is not None:
            # HF rounds the scale to the activation dtype before multiplying.
            x = x * jnp.asarray(self.scale, x.dtype)
        return x

    def attend(self, h: jax.Array) -> jax.Array:  # [..., hidden] -> [..., vocab] float32
        """Logits against the table (a tied LM head)."""
        return jnp.einsum(
            "...h,vh->...v", h, self.embedding.get_value(), preferred_element_type=jnp.float32
        )
