"""Token embeddings: the ``[vocab, hidden]`` table, split over the mesh by vocabulary rows, and
the per-layer inputs some models add (Gemma 4's per-layer embeddings)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_llm_runtime.models.layers.linear import projection
from jax_llm_runtime.models.layers.norms import Norm, NormConfig
from jax_llm_runtime.models.layers.params import EMBED, NORM, PER_LAYER, VOCAB, Block, declare


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


class PerLayerInputs(Block):
    """Gemma 4's per-layer embeddings: for each token, one ``width``-wide input per layer, the
    mean (times sqrt 2) of a lookup in a ``[vocab, layers * width]`` table (``ple_embed``, rows
    scaled by sqrt(width)) and a projection of the token's embedding (``ple_proj``, scaled by
    hidden ** -0.5, each layer's part RMS-normed by ``ple_norm``). Each layer gates its output
    with its input (``models.layers.decoder_layer``). The table may be held in a narrower dtype
    than the run's (``table_dtype``); its looked-up rows are widened."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        layers: int,
        width: int,
        norm: NormConfig,
        dtype: jnp.dtype,
        table_dtype: jnp.dtype,
    ) -> None:
        self.hidden, self.layers, self.width = hidden, layers, width
        features = layers * width
        self.table = declare((vocab, features), table_dtype, (VOCAB, PER_LAYER), "ple_embed")
        self.proj = projection((), (hidden, features), (EMBED, PER_LAYER), dtype, "ple_proj")
        self.norm = Norm(norm, (width,), (NORM,), dtype, "ple_norm")

    def __call__(
        self,
        tokens: jax.Array,  # [...] int32
        x: jax.Array,  # [..., hidden], the tokens' (scaled) embeddings
    ) -> jax.Array:  # [layers, ..., width]: each layer's inputs, leading for the layer scan
        lead, dtype = tokens.shape, x.dtype
        looked = self.table.get_value()[tokens].astype(dtype) * jnp.asarray(self.width**0.5, dtype)
        looked = looked.reshape(*lead, self.layers, self.width)
        projected = self.proj(x) * jnp.asarray(self.hidden**-0.5, dtype)
        projected = self.norm(projected.reshape(*lead, self.layers, self.width))
        inputs = (projected + looked) * jnp.asarray(2**-0.5, dtype)
        return jnp.moveaxis(inputs, -2, 0)
