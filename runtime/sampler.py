"""On-device sampling with per-sequence temperature, top-k and top-p.

Every sequence draws from its own key, ``fold_in(PRNGKey(seed), output_index)``, so a request's
samples do not depend on what else is in the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SamplingMetadata:
    """Per-sequence sampling settings for one step, padded to the batch bucket."""

    temperature: jax.Array  # [num_seqs] float32; 0 means greedy
    top_k: jax.Array  # [num_seqs] int32; 0 disables
    top_p: jax.Array  # [num_seqs] float32; 1.0 disables
    seeds: jax.Array  # [num_seqs] uint32
    output_index: jax.Array  # [num_seqs] int32, index of the token being sampled


def sample(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:  # [num_seqs] int32
    """Pick one token per row of ``logits`` ([num_seqs, vocab], float32)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    all_greedy = jnp.all(meta.temperature == 0.0)
    # The sort over the vocabulary is skipped entirely when every sequence is greedy.
    sampled = jax.lax.cond(all_greedy, lambda: greedy, lambda: _sample_filtered(logits, meta))
    return jnp.where(meta.temperature == 0.0, greedy, sampled)


def _sample_filtered(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    vocab = logits.shape[-1]
    temperature = jnp.where(meta.temperature > 0.0, meta.temperature, 1.0)
    scaled = logits / temperature[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # [num_seqs, vocab] token ids, most likely first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    top_k = jnp.where(meta.top_k > 0, meta.top_k, vocab)
    keep = rank < top_k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < meta.top_p[:, None]
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(
        meta.seeds, meta.output_index
    )
    choice = jax.vmap(jax.random.categorical)(keys, filtered)  # index into the sorted order
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
