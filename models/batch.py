"""The batch a model step consumes: a flat run of new tokens plus the paged-attention metadata,
as one pytree.

A step's tokens are ragged: sequence ``s`` owns rows ``q_starts[s]:q_starts[s + 1]`` of the run
(one row for a decoding sequence, a whole prefill chunk for another), in order, and the rows
from ``q_starts[num_seqs]`` on are padding. Padding sequences own no rows and have
``kv_lens == 0``; padding rows (``valid`` False) are ignored by the KV write and their outputs
are never read. Both counts are padded to compiled buckets, so one compiled step serves every
mix of decode rows and prefill chunks that fits them.

``decode_rows`` (static) marks a decode step's layout: row ``s`` is sequence ``s``'s one new
token or padding, so attention can run the padded ``[num_seqs, 1]`` contract on it.

A step that prefills image tokens of a vision-language model carries two or three more
arrays, None in every other step (so text steps compile as before): ``embeds`` replace the
token embeddings of the rows flagged in ``embed_rows`` (the image encoder's soft tokens), and,
for a model whose image tokens attend both ways (Gemma 3; Mistral 3's attend causally and have
none), ``horizons`` give each row the last position it may attend to: its own position
(causal), or for an image token the last position of its image, so that the tokens of one image
see each other both ways. The scheduler keeps such an image's tokens in one chunk, so those
keys are written in the step that reads them.

A multimodal-RoPE model (Qwen3-VL: ``RopeConfig.mrope_section``) gets ``rope_positions`` in
every step: each row's (temporal, height, width) rotary positions, which differ from
``positions`` (still the KV slot and what causality counts) inside an image and after one. A
model whose image encoder also feeds early layers (Qwen3-VL's deepstack) gets wider ``embeds``:
the soft token, then one vector per such layer, added to the row's hidden state after it.

``state_slots`` names each sequence's state slot in a model with linear-attention layers
(``models.layers.linear_attention``); None means sequence ``s`` uses slot ``s``. In a mixed
step of such a model, ``single_chunk`` (static) says that at most one sequence has more than
one new token (the scheduler gives those models one prompt chunk per step).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import struct


@struct.dataclass
class StepBatch:
    """``num_tokens`` new tokens of ``num_seqs`` sequences (see the module docstring)."""

    tokens: jax.Array  # [num_tokens] int32
    positions: jax.Array  # [num_tokens] int32, each token's position in its sequence
    seq_ids: jax.Array  # [num_tokens] int32, the sequence each row belongs to (padding: any)
    valid: jax.Array  # [num_tokens] bool, real tokens (not padding)
    q_starts: jax.Array  # [num_seqs + 1] int32, nondecreasing, q_starts[0] == 0
    kv_lens: jax.Array  # [num_seqs] int32, KV length after this step's tokens are written
    page_indices: jax.Array  # [num_seqs, pages_per_seq] int32
    last_rows: jax.Array  # [num_seqs] int32, each sequence's last new row (its logits' row)
    decode_rows: bool = struct.field(pytree_node=False, default=False)
    embeds: jax.Array | None = None  # [num_tokens, hidden] float, rows replacing embeddings
    embed_rows: jax.Array | None = None  # [num_tokens] bool, rows that take ``embeds``
    horizons: jax.Array | None = None  # [num_tokens] int32, last visible key position per row
    state_slots: jax.Array | None = None  # [num_seqs] int32, each sequence's state slot
    rope_positions: jax.Array | None = None  # [num_tokens, 3] int32, multimodal RoPE's (t, h, w)
    single_chunk: bool = struct.field(pytree_node=False, default=False)

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def q_lens(self) -> jax.Array:  # [num_seqs] int32
        """New tokens per sequence (0 for padding sequences)."""
        return self.q_starts[1:] - self.q_starts[:-1]

    @classmethod
    def padded(
        cls,
        tokens: np.ndarray,  # [num_seqs, q_len]
        positions: np.ndarray,  # [num_seqs, q_len]
        q_lens: np.ndarray,  # [num_seqs], valid tokens at the start of each row
        kv_lens: np.ndarray,  # [num_seqs]
        page_indices: np.ndarray,  # [num_seqs, pages_per_seq]
    ) -> StepBatch:
        """The batch of a padded ``[num_seqs, q_len]`` one (host arrays): with ``q_len`` 1 a
        decode layout (row ``s`` is sequence ``s``), else each row's first ``q_lens`` tokens in
        order, then padding up to ``num_seqs * q_len`` rows."""
        tokens, positions = np.asarray(tokens, np.int32), np.asarray(positions, np.int32)
        q_lens = np.asarray(q_lens, np.int32)
        num_seqs, q_len = tokens.shape
        q_starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        tail = dict(kv_lens=np.asarray(kv_lens, np.int32), page_indices=np.asarray(page_indices))
        if q_len == 1:
            rows = np.arange(num_seqs, dtype=np.int32)
            return cls(
                tokens[:, 0], positions[:, 0], rows, q_lens > 0, q_starts, **tail,
                last_rows=rows, decode_rows=True,
            )  # fmt: skip
        keep = np.arange(q_len)[None, :] < q_lens[:, None]
        n = int(keep.sum())
        flat = np.zeros((3, num_seqs * q_len), np.int32)
        seq_ids = np.broadcast_to(np.arange(num_seqs)[:, None], tokens.shape)
        for row, values in enumerate((tokens, positions, seq_ids)):
            flat[row, :n] = values[keep]
        valid = np.arange(num_seqs * q_len) < n
        last_rows = np.maximum(q_starts[1:] - 1, 0).astype(np.int32)
        return cls(flat[0], flat[1], flat[2], valid, q_starts, **tail, last_rows=last_rows)
