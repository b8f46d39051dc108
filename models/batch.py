"""The batch a model step consumes: token ids plus the paged-attention metadata, as one pytree."""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class StepBatch:
    """A padded, bucketed batch: ``num_seqs`` sequences with up to ``q_len`` new tokens each.

    Padding sequences have ``q_lens == 0`` and ``kv_lens == 0``; padding tokens are ignored by
    the KV write and their outputs are never read.
    """

    tokens: jax.Array  # [num_seqs, q_len] int32
    positions: jax.Array  # [num_seqs, q_len] int32
    q_lens: jax.Array  # [num_seqs] int32, valid new tokens per sequence
    kv_lens: jax.Array  # [num_seqs] int32, KV length after this step's tokens are written
    page_indices: jax.Array  # [num_seqs, pages_per_seq] int32
