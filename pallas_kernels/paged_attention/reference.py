"""Pure-jnp paged attention: the numerical reference, and the path wherever no kernel runs.

Each sequence gathers only its own pages (``page_indices``) and every key position at or past its
``kv_lens`` is masked, so stale or NaN-filled pages never leak into the result. A float8 cache is
read with its row scales (see ``layout.py``): each gathered row is dequantised before masking.
A cache in integer storage (``layout.storage_dtype``) is gathered as it is and only the gathered
rows are bitcast to their float dtype.

Two layouts of a step's queries: ``paged_attention`` takes them padded, ``[num_seqs, q_len]``
rows (one prefill chunk, or one decode token per sequence); ``ragged_paged_attention`` takes a
flat run of ``num_tokens`` rows in which sequence ``s`` owns rows ``q_starts[s]:q_starts[s+1]``,
so decode tokens and prefill chunks of several sequences share one call.

``sinks`` (gpt-oss) are one learned logit per query head that joins each row's softmax
denominator and attends to nothing: a row's probabilities then sum to less than one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_llm_runtime.pallas_kernels.paged_attention.layout import from_stored

_MASKED = -1e30  # finite, so a fully masked (padding) row stays finite instead of NaN


def _validate_cache(num_heads: int, head_dim: int, k_cache: jax.Array) -> None:
    if k_cache.ndim != 5:
        raise ValueError(
            "k_cache must be [num_layers, num_pages, page_size, num_kv_heads, head_dim], "
            f"got shape {k_cache.shape}"
        )
    num_kv_heads = k_cache.shape[3]
    if k_cache.shape[4] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, cache has {k_cache.shape[4]}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )


def _validate(
    q: jax.Array, k_cache: jax.Array, page_indices: jax.Array, kv_lens: jax.Array
) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [num_seqs, q_len, num_heads, head_dim], got shape {q.shape}")
    num_seqs, _, num_heads, head_dim = q.shape
    _validate_cache(num_heads, head_dim, k_cache)
    if page_indices.shape[0] != num_seqs or kv_lens.shape != (num_seqs,):
        raise ValueError(
            f"page_indices {page_indices.shape} and kv_lens {kv_lens.shape} must lead with "
            f"num_seqs={num_seqs}"
        )


def _validate_ragged(
    q: jax.Array,
    k_cache: jax.Array,
    positions: jax.Array,
    q_starts: jax.Array,
    page_indices: jax.Array,
    kv_lens: jax.Array,
) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {q.shape}")
    num_tokens, num_heads, head_dim = q.shape
    _validate_cache(num_heads, head_dim, k_cache)
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [num_tokens={num_tokens}], got {positions.shape}")
    num_seqs = page_indices.shape[0] if page_indices.ndim == 2 else -1
    if num_seqs < 1 or kv_lens.shape != (num_seqs,) or q_starts.shape != (num_seqs + 1,):
        raise ValueError(
            "page_indices must be [num_seqs, pages_per_seq] with num_seqs >= 1, kv_lens "
            f"[num_seqs] and q_starts [num_seqs + 1]; got page_indices {page_indices.shape}, "
            f"kv_lens {kv_lens.shape}, q_starts {q_starts.shape}"
        )


def _validate_scales(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_scales: jax.Array | None,
    v_scales: jax.Array | None,
) -> None:
    if (k_scales is None) != (v_scales is None):
        raise ValueError("pass both k_scales and v_scales (a float8 cache) or neither")
    if k_scales is None:
        return
    for name, scales, cache in (("k_scales", k_scales, k_cache), ("v_scales", v_scales, v_cache)):
        if scales.shape != cache.shape[:4]:
            raise ValueError(
                f"{name} must be [num_layers, num_pages, page_size, num_kv_heads] = "
                f"{list(cache.shape[:4])}, got {scales.shape}"
            )


def _gather_rows(
    cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    scales: jax.Array | None,  # [num_layers, num_pages, page_size, num_kv_heads]
    layer: jax.Array,  # [] int32
    page_indices: jax.Array,  # [num_seqs, pages_per_seq] int32
) -> jax.Array:  # [num_seqs, pages_per_seq * page_size, num_kv_heads, head_dim]
    """A sequence's rows in order, in the cache's float dtype; with scales, dequantised to
    float32."""
    num_seqs = page_indices.shape[0]
    rows = from_stored(cache[layer, page_indices].reshape(num_seqs, -1, *cache.shape[3:]))
    if scales is None:
        return rows
    row_scales = scales[layer, page_indices].reshape(num_seqs, -1, cache.shape[3])
    return rows.astype(jnp.float32) * row_scales.astype(jnp.float32)[..., None]


def paged_attention(
    q: jax.Array,  # [num_seqs, q_len, num_heads, head_dim]
    k_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer: jax.Array,  # [] int32
    positions: jax.Array,  # [num_seqs, q_len] int32, absolute position of each query token
    page_indices: jax.Array,  # [num_seqs, pages_per_seq] int32
    kv_lens: jax.Array,  # [num_seqs] int32, valid KV positions (including this step's tokens)
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    v_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    sinks: jax.Array | None = None,  # [num_heads] float, each head's sink logit
    attention_chunk: int | jax.Array | None = None,
    horizons: jax.Array | None = None,  # [num_seqs, q_len] int32, last key position each sees
) -> jax.Array:  # [num_seqs, q_len, num_heads, head_dim]
    """Causal attention of each query token over its own sequence's paged K/V.

    Key position ``t`` is visible to query position ``p`` iff ``t < kv_lens[s]``, ``t <= p``,
    with a sliding window ``w``, ``t > p - w``, and with an attention chunk ``c`` (Llama 4),
    ``t // c == p // c``: positions attend within their fixed chunk only. With ``horizons``,
    ``t <= horizons[s, i]`` replaces ``t <= p`` (a query may see keys after it: the image
    tokens of Gemma 3 see their whole image; the window still counts back from ``p``).
    Computation is in float32. With ``k_scales`` and
    ``v_scales`` (a float8 cache, see ``KVCache``) row ``r`` of K is ``k_cache[r] * k_scales[r]``,
    and likewise for V; scales of masked rows are never used, so they may be NaN. With ``sinks``
    each head's softmax denominator also counts ``exp(sinks[h])`` (see the module docstring).
    """
    _validate(q, k_cache, page_indices, kv_lens)
    _validate_scales(k_cache, v_cache, k_scales, v_scales)
    num_seqs, q_len, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    kv_len_max = page_indices.shape[1] * page_size

    k = _gather_rows(k_cache, k_scales, layer, page_indices)  # [s, kv_len_max, kv_heads, d]
    v = _gather_rows(v_cache, v_scales, layer, page_indices)
    key_pos = jnp.arange(kv_len_max)  # [kv_len_max]
    in_range = key_pos[None, :] < kv_lens[:, None]  # [num_seqs, kv_len_max]
    # Zero unused positions: masked scores alone do not stop 0 * NaN from reaching the output.
    # This also drops whatever a stale row's scale made of it.
    k = jnp.where(in_range[:, :, None, None], k, 0).astype(jnp.float32)
    v = jnp.where(in_range[:, :, None, None], v, 0).astype(jnp.float32)

    qg = q.astype(jnp.float32).reshape(num_seqs, q_len, num_kv_heads, group, head_dim)
    scores = jnp.einsum("sqkgd,stkd->skgqt", qg, k) * scale  # [s, kv_heads, group, q_len, kv]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    last = positions if horizons is None else horizons  # [num_seqs, q_len]
    visible = in_range[:, None, :] & (key_pos[None, None, :] <= last[:, :, None])
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > positions[:, :, None] - sliding_window
    if attention_chunk is not None:
        visible &= key_pos[None, None, :] >= chunk_start(positions, attention_chunk)[:, :, None]
    scores = jnp.where(visible[:, None, None, :, :], scores, _MASKED)
    probs = softmax_with_sinks(scores, sinks)
    out = jnp.einsum("skgqt,stkd->sqkgd", probs, v)
    return out.reshape(num_seqs, q_len, num_heads, head_dim).astype(q.dtype)


def softmax_with_sinks(
    scores: jax.Array,  # [..., num_kv_heads, group, q_len, kv_len] float32
    sinks: jax.Array | None,  # [num_kv_heads * group] float
) -> jax.Array:  # scores' shape: softmax over the last axis, whose denominator counts the sink
    """The softmax of attention scores over keys; a head's sink logit joins the denominator."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    num_kv_heads, group = scores.shape[-4], scores.shape[-3]
    sink = sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1, 1)
    top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
    weights = jnp.exp(scores - top)
    return weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink - top))


ROW_BLOCK = 8  # query rows of a ragged call whose sequences' pages are gathered at once


def sequence_ids(
    q_starts: jax.Array,  # [num_seqs + 1] int32
    num_tokens: int,
) -> tuple[jax.Array, jax.Array]:  # [num_tokens] int32 in [0, num_seqs), [num_tokens] bool
    """Each query row's sequence (``q_starts[s] <= row < q_starts[s + 1]``) and whether it has
    one: rows before ``q_starts[0]`` or from ``q_starts[num_seqs]`` on are padding (their id is
    clipped into range so it can index)."""
    num_seqs = q_starts.shape[0] - 1
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(q_starts.astype(jnp.int32), rows, side="right").astype(jnp.int32) - 1
    valid = (seq >= 0) & (seq < num_seqs)
    return jnp.clip(seq, 0, num_seqs - 1), valid


def chunk_start(
    positions: jax.Array,  # [...] int32
    attention_chunk: int | jax.Array,  # [] int32
) -> jax.Array:  # [...] int32
    """The first position of each position's attention chunk."""
    return positions - positions % attention_chunk


def sees_a_key(
    positions: jax.Array,  # [num_tokens] int32
    kv_lens: jax.Array,  # [num_tokens] int32, the row's sequence's (0 for padding)
    sliding_window: int | jax.Array | None,
    attention_chunk: int | jax.Array | None = None,
) -> jax.Array:  # [num_tokens] bool
    """Whether a row's visible key range ``[max(0, p - w + 1, chunk start), min(kv_len, p + 1))``
    is not empty."""
    hi = jnp.minimum(kv_lens, positions + 1)
    lo = 0 if sliding_window is None else jnp.maximum(0, positions - sliding_window + 1)
    if attention_chunk is not None:
        lo = jnp.maximum(lo, chunk_start(positions, attention_chunk))
    return hi > lo


def _row_blocks(x: jax.Array, block: int) -> jax.Array:  # [num_blocks, block, ...]
    """``x`` [num_tokens, ...] padded with zeros to whole blocks of ``block`` rows."""
    pad = [(0, -x.shape[0] % block)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad).reshape(-1, block, *x.shape[1:])


def ragged_paged_attention(
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    k_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer: jax.Array,  # [] int32
    positions: jax.Array,  # [num_tokens] int32, absolute position of each query token
    q_starts: jax.Array,  # [num_seqs + 1] int32, sequence s owns rows q_starts[s]:q_starts[s+1]
    page_indices: jax.Array,  # [num_seqs, pages_per_seq] int32
    kv_lens: jax.Array,  # [num_seqs] int32, valid KV positions (including this step's tokens)
    *,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    v_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    sinks: jax.Array | None = None,  # [num_heads] float, each head's sink logit
    attention_chunk: int | jax.Array | None = None,
    horizons: jax.Array | None = None,  # [num_tokens] int32, last key position each row sees
) -> jax.Array:  # [num_tokens, num_heads, head_dim]
    """``paged_attention`` over a flat run of query rows mixing several sequences.

    ``q_starts`` is non-decreasing with ``q_starts[0] == 0`` in the usual case: sequence ``s``
    owns rows ``q_starts[s]:q_starts[s + 1]`` (a decode row, a prefill chunk, or none), and rows
    outside ``[q_starts[0], q_starts[num_seqs])`` are padding. Each row sees the keys
    ``paged_attention`` gives its position in its own sequence (``t < kv_lens[s]``, ``t <= p``,
    ``t > p - w`` with a window, ``t // c == p // c`` with an attention chunk), so a chunk is causal within itself and sees its cached pages.
    Padding rows and rows that see no key return zeros (as the native and Pallas kernels do).

    Each row runs as its own one-token sequence of ``paged_attention``, ``ROW_BLOCK`` rows per
    step of a ``lax.map``: a step gathers its rows' whole page tables, so it holds
    ``2 * ROW_BLOCK * pages_per_seq * page_size * num_kv_heads * head_dim`` float32 K/V values
    (plus ``ROW_BLOCK * num_heads * pages_per_seq * page_size`` scores), and the call reads
    ``num_tokens * pages_per_seq * page_size`` rows of each cache in all. Shapes are static:
    one compiled call serves every ``q_starts``.
    """
    _validate_ragged(q, k_cache, positions, q_starts, page_indices, kv_lens)
    _validate_scales(k_cache, v_cache, k_scales, v_scales)
    num_tokens = q.shape[0]
    kv_lens, page_indices = jnp.asarray(kv_lens), jnp.asarray(page_indices)  # host arrays too
    seq, valid = sequence_ids(q_starts, num_tokens)
    lens = jnp.where(valid, kv_lens[seq], 0)  # padding rows see no key
    positions = positions.astype(jnp.int32)

    last = positions if horizons is None else horizons.astype(jnp.int32)

    def attend(xs: tuple[jax.Array, ...]) -> jax.Array:  # [ROW_BLOCK, num_heads, head_dim]
        q_b, pos_b, pages_b, lens_b, last_b = xs
        out = paged_attention(
            q_b[:, None], k_cache, v_cache, layer, pos_b[:, None], pages_b, lens_b,
            scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
            k_scales=k_scales, v_scales=v_scales, sinks=sinks,
            attention_chunk=attention_chunk, horizons=last_b[:, None],
        )  # fmt: skip
        return out[:, 0]

    rows = (q, positions, page_indices[seq], lens, last)
    blocks = [_row_blocks(x, ROW_BLOCK) for x in rows]
    out = jax.lax.map(attend, tuple(blocks)).reshape(-1, *q.shape[1:])[:num_tokens]
    seen = sees_a_key(positions, lens, sliding_window, attention_chunk)
    return jnp.where(seen[:, None, None], out, 0).astype(q.dtype)
