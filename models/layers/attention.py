"""Self-attention over the paged KV cache (project, rotate, write K/V, attend, project out),
and without it (plain causal attention over the given tokens, for embeddings and scoring).

``Attention`` declares a layer's weights, and the functions call its modules: the projections
``wq``, ``wk``, ``wv``, ``wo`` always, with biases ``bq``, ``bk``, ``bv`` when ``qkv_bias``
(Qwen2, Phi-2, StableLM, GLM-4) and ``bo`` when ``o_bias`` (Phi-2); the norms ``q_norm``,
``k_norm`` (and ``q_norm_b``, ``k_norm_b`` for LayerNorm) when ``qk_norm`` is set (Qwen3,
Gemma-3, Phi-2, StableLM 2): over each head, or over all heads of q and of k at once with
``qk_norm_all_heads`` (MiniMax-M2); ``sinks`` (one logit per query head that joins the softmax
denominator) when ``sinks`` is set (gpt-oss).

Layers whose heads are narrower than others (Gemma 4: ``AttentionConfig.head_dims``) hold
them zero-padded to the widest head: the padding features are zero in q, k and v, so they add
nothing to a score and come out as zeros that the output projection's zero rows drop, and every
layer shares one cache shape. Only the norms over a head need its real width.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import struct

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.layers.linear import project, projection
from jax_llm_runtime.models.layers.norms import Norm, NormConfig, apply_norm
from jax_llm_runtime.models.layers.params import (
    EMBED,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    NORM,
    Block,
    declare,
    layer_axes,
)
from jax_llm_runtime.models.layers.rotary import RopeConfig, apply_rope
from jax_llm_runtime.pallas_kernels.paged_attention import (
    KVCache,
    attention,
    paged_attention,
    ragged_attention,
    ragged_paged_attention,
    write_cache_ragged,
)
from jax_llm_runtime.pallas_kernels.paged_attention.ops import ragged_implementation
from jax_llm_runtime.pallas_kernels.paged_attention.reference import softmax_with_sinks


@dataclass(frozen=True)
class AttentionConfig:
    """Static attention settings shared by every layer of a model.

    ``sliding_window`` is the window of the layers that slide (which ones is per layer, see
    ``LayerMeta``). ``local_rope``, when set, is the rope of sliding layers (Gemma-3 keeps a
    short base there). ``softmax_scale`` overrides head_dim ** -0.5 (Gemma's
    query_pre_attn_scalar). ``position_query_scale`` = (beta, length) multiplies queries by
    1 + beta * log(1 + floor(position / length)) (Mistral 3's long-context temperature).
    ``sinks``: each query head has a learned logit that joins its softmax denominator and
    attends to nothing (gpt-oss); only the jnp reference kernels take them.
    ``head_dims`` = (sliding, full) are the layers' real head widths when they differ (Gemma 4);
    ``head_dim`` is then the wider, and the narrower layers' heads are zero-padded to it.
    ``v_norm`` norms each head of v (an RMS norm without weight, Gemma 4).
    ``attention_chunk`` is the chunk of the layers that attend within fixed chunks of positions
    (which ones is per layer, see ``LayerMeta``; Llama 4). ``qk_l2_norm`` norms each head of q
    and k after rope (an RMS norm without weight) on the layers that rotate, and
    ``query_temperature`` = (beta, length) multiplies queries by
    1 + beta * log(1 + floor((position + 1) / length)) on the layers that do not (Llama 4).
    ``full_values_from_keys``: full-attention layers have no value projection and take their
    keys' before the norm and rope (Gemma 4's attention_k_eq_v); their checkpoint ``wk`` fills
    ``wv`` too (``models.families.gemma4``), so the computation is the usual one.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    sliding_window: int | None = None
    soft_cap: float | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: NormConfig | None = None  # norm over each head of q and k before rope when set
    qk_norm_per_head: bool = False  # a separate norm weight per head (StableLM 2)
    # One norm over all heads' features of q, and one of k, before splitting heads (MiniMax-M2).
    qk_norm_all_heads: bool = False
    local_rope: RopeConfig | None = None
    softmax_scale: float | None = None
    position_query_scale: tuple[float, int] | None = None
    sinks: bool = False
    head_dims: tuple[int, int] | None = None
    v_norm: NormConfig | None = None
    full_values_from_keys: bool = False
    attention_chunk: int | None = None
    qk_l2_norm: NormConfig | None = None
    query_temperature: tuple[float, int] | None = None
    # Each head's output times sigmoid of a gate the query projection also yields: wq's output
    # holds per head its query, then its gate (Qwen3-Next, Qwen3.5).
    output_gate: bool = False
    # The cache-free path (``causal_self_attention``) rounds K and V to this dtype, as a paged run
    # stores them, so that its numerics show what a 16-bit KV cache costs (tools/perplexity.py).
    round_kv_to: str | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.attention_chunk is not None and self.attention_chunk < 1:
            raise ValueError(f"attention_chunk must be >= 1, got {self.attention_chunk}")
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"attention soft-cap must be > 0, got {self.soft_cap}")
        if self.qk_norm_all_heads and (self.qk_norm is None or self.qk_norm_per_head):
            raise ValueError("qk_norm_all_heads needs qk_norm, with no weight per head")
        if self.head_dims is not None and max(self.head_dims) != self.head_dim:
            raise ValueError(f"head_dim {self.head_dim} is not the wider of {self.head_dims}")
        if self.rope.rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary dim {self.rope.rotary_dim} is larger than head_dim {self.head_dim}"
            )

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim**-0.5


@struct.dataclass
class LayerMeta:
    """Per-layer facts a layer scan carries next to the weights (one row per layer)."""

    index: jax.Array  # [] int32, the layer's slot in the KV cache
    window: jax.Array  # [] int32, sliding window of this layer (huge for full attention)
    local: jax.Array  # [] bool, whether this layer uses ``local_rope``
    # [] int32, this layer's attention chunk (huge for layers that see everything); None when
    # no layer of the model is chunked
    chunk: jax.Array | None = None
    rotates: jax.Array | None = None  # [] bool, whether this layer has rope; None: all have
    # [] int32, where a model's layers reuse others' K/V (``DecoderConfig.kv_sources``): the
    # row of the cache-free path's buffer of shared K/V that this layer fills (a source) or
    # reads (a layer that reuses), -1 for neither; None when no layer reuses.
    shared_row: jax.Array | None = None
    # [..., width], this layer's per-layer input (``models.layers.embed.PerLayerInputs``)
    per_layer_input: jax.Array | None = None


FULL_WINDOW = 2**30  # a "window" no sequence reaches: the layer attends to everything


def layer_window(cfg: AttentionConfig, meta: LayerMeta) -> jax.Array | None:
    """The traced window of this layer, or None when no layer of the model slides."""
    return None if cfg.sliding_window is None else meta.window


def layer_chunk(cfg: AttentionConfig, meta: LayerMeta) -> jax.Array | None:
    """The traced attention chunk of this layer, or None when no layer of the model is chunked."""
    return None if cfg.attention_chunk is None else meta.chunk


def output_gate(
    layer: Attention,
    x: jax.Array,  # [..., hidden]
) -> tuple[jax.Array, jax.Array | None]:  # [..., num_heads * head_dim] each
    """The query projection, and the output gate when the layer has one (None otherwise)."""
    cfg, lead = layer.cfg, x.shape[:-1]
    q = layer.wq(x)
    if not cfg.output_gate:
        return q, None
    q = q.reshape(*lead, cfg.num_heads, 2 * cfg.head_dim)
    width, d = cfg.num_heads * cfg.head_dim, cfg.head_dim
    return q[..., :d].reshape(*lead, width), q[..., d:].reshape(*lead, width)


def project_qkv(
    layer: Attention,  # one layer's attention (inside the layer scan)
    x: jax.Array,  # [..., hidden]: [num_tokens] of a step, [num_seqs, seq_len] without a cache
    positions: jax.Array,  # [...] int32
    meta: LayerMeta,
    q: jax.Array | None = None,  # [..., num_heads * head_dim], the query projection when known
    rope_positions: jax.Array | None = None,  # [..., 3] int32, multimodal RoPE's (t, h, w)
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [..., num_heads, head_dim] and k, v [..., num_kv_heads, head_dim], with q and k normed
    (when configured), rotated (by ``rope_positions`` when given, else ``positions``), and q
    position-scaled (when configured); k and v are None for a layer that reuses another's K/V."""
    cfg, lead = layer.cfg, x.shape[:-1]
    turns = positions if rope_positions is None else rope_positions
    if layer.wk is None:  # a layer that reuses another's K/V: its queries alone, as usual
        q = layer.wq(x) if q is None else q  # [..., num_heads * head_dim]
        q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = layer.q_norm(q, head_width(cfg, meta))
        q = _rotated(cfg, q, turns, meta)
        if cfg.qk_l2_norm is not None:
            q = _l2_normed(cfg.qk_l2_norm, q, meta)
        return _position_scaled(cfg, q, positions, meta), None, None
    # One kernel call for the projections that share x, where packed weights allow it.
    if q is None:
        q, k, v = project(x, layer.wq, layer.wk, layer.wv)  # [..., heads * head_dim]
    else:
        k, v = project(x, layer.wk, layer.wv)
    normed = layer.q_norm is not None and layer.k_norm is not None
    if normed and cfg.qk_norm_all_heads:
        q, k = layer.q_norm(q), layer.k_norm(k)
    q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    width = head_width(cfg, meta)
    if normed and not cfg.qk_norm_all_heads:
        q, k = layer.q_norm(q, width), layer.k_norm(k, width)
    if cfg.v_norm is not None:
        v = apply_norm(cfg.v_norm, v, jnp.ones((), jnp.float32), dim=width)
    q, k = _rotated(cfg, q, turns, meta), _rotated(cfg, k, turns, meta)
    if cfg.qk_l2_norm is not None:
        q, k = _l2_normed(cfg.qk_l2_norm, q, meta), _l2_normed(cfg.qk_l2_norm, k, meta)
    return _position_scaled(cfg, q, positions, meta), k, v


def _position_scaled(
    cfg: AttentionConfig,
    q: jax.Array,  # [..., num_heads, head_dim]
    positions: jax.Array,  # [...] int32
    meta: LayerMeta,
) -> jax.Array:  # like q: times the position-dependent factors where configured
    if cfg.query_temperature is not None:
        beta, length = cfg.query_temperature
        factor = 1 + beta * jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1) / length))
        if meta.rotates is not None:
            factor = jnp.where(meta.rotates, 1.0, factor)
        q = (q * factor[..., None, None]).astype(q.dtype)
    if cfg.position_query_scale is not None:
        beta, length = cfg.position_query_scale
        factor = 1 + beta * jnp.log1p(jnp.floor(positions.astype(jnp.float32) / length))
        q = (q * factor[..., None, None]).astype(q.dtype)
    return q


def head_width(cfg: AttentionConfig, meta: LayerMeta) -> jax.Array | None:
    """This layer's real head width (traced) where layers' widths differ, else None."""
    if cfg.head_dims is None:
        return None
    return jnp.where(meta.local, *cfg.head_dims).astype(jnp.int32)


def _l2_normed(
    cfg: NormConfig,
    x: jax.Array,  # [..., heads, head_dim]
    meta: LayerMeta,
) -> jax.Array:  # like x: normed on the layers that rotate
    normed = apply_norm(cfg, x, jnp.ones((), jnp.float32))
    return normed if meta.rotates is None else jnp.where(meta.rotates, normed, x)


def _rotated(
    cfg: AttentionConfig,
    x: jax.Array,  # [..., heads, head_dim]: q or k
    positions: jax.Array,  # [...] int32, or [..., 3] under multimodal RoPE
    meta: LayerMeta,
) -> jax.Array:  # like x: with this layer's rope (none on a layer without)
    rotated = apply_rope(x, positions, cfg.rope)
    if meta.rotates is not None:
        rotated = jnp.where(meta.rotates, rotated, x)
    if cfg.local_rope is None:
        return rotated
    return jnp.where(meta.local, apply_rope(x, positions, cfg.local_rope), rotated)


def output_projection(
    layer: Attention,
    out: jax.Array,  # [..., num_heads, head_dim]
    gate: jax.Array | None = None,  # [..., num_heads * head_dim] (``output_gate``)
) -> jax.Array:  # [..., hidden]
    out = out.reshape(*out.shape[:-2], layer.cfg.num_heads * layer.cfg.head_dim)
    if gate is not None:
        out = (out * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(out.dtype)
    return layer.wo(out)


def paged_self_attention(
    layer: Attention,  # one layer's attention (inside the layer scan)
    x: jax.Array,  # [num_tokens, hidden]
    cache: KVCache,
    meta: LayerMeta,
    batch: StepBatch,
    native: bool = False,
) -> tuple[jax.Array, KVCache]:  # [num_tokens, hidden]
    """Attention for one layer; this step's K/V are written to their pages before attending.

    ``native`` (``DecoderConfig.native_kernels``): native CPU kernels may run where this step runs;
    the op picks the implementation (``pallas_kernels.paged_attention.ops.implementation``).
    """
    cfg = layer.cfg
    q, gate = output_gate(layer, x)
    q, k, v = project_qkv(layer, x, batch.positions, meta, q, batch.rope_positions)
    if k is not None:  # a layer that reuses another's K/V reads its slot (written before)
        cache = write_step_kv(cache, meta.index, k, v, batch)
    out = step_attention(
        q,
        (cache.k, cache.v, cache.k_scales, cache.v_scales),
        meta.index,
        batch,
        scale=cfg.scale,
        sliding_window=layer_window(cfg, meta),
        soft_cap=cfg.soft_cap,
        native=native,
        sinks=None if layer.sinks is None else layer.sinks.get_value(),
        attention_chunk=layer_chunk(cfg, meta),
    )
    return output_projection(layer, out, gate), cache


def write_step_kv(
    cache: KVCache,
    layer: jax.Array,  # [] int32
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, v_head_dim]
    batch: StepBatch,
) -> KVCache:
    """Write a step's new K/V rows to their pages (padding rows write nothing)."""
    return write_cache_ragged(
        cache, layer, k, v, batch.positions, batch.seq_ids, batch.valid, batch.page_indices
    )


def step_attention(
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    caches: tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None],  # K, V, row scales
    layer: jax.Array,  # [] int32
    batch: StepBatch,
    *,
    scale: float,
    sliding_window: jax.Array | None = None,
    soft_cap: float | None = None,
    native: bool = False,
    reference: bool = False,
    sinks: jax.Array | None = None,  # [num_heads] float, each head's sink logit
    attention_chunk: jax.Array | None = None,
) -> jax.Array:  # [num_tokens, num_heads, head_dim]
    """Paged attention of a step's query rows, in the layout its shape says (static):

    - one sequence (a lone prefill chunk) or one row per sequence (a decode step): the padded
      contract, ``[1, num_tokens]`` or ``[num_seqs, 1]`` queries, on the op's chosen kernel;
    - otherwise a mixed step (decode rows and prefill chunks of several sequences): the ragged
      contract (``ragged_paged_attention``, ``q_starts``).

    ``reference`` runs the jnp reference whatever the backend (MLA's absorbed queries); so
    does a step whose rows carry ``horizons`` (image tokens that attend within their image both
    ways, ``models.batch``), a mask no kernel has.
    """
    num_seqs = batch.num_seqs
    k_cache, v_cache, k_scales, v_scales = caches
    kw = dict(
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scales=k_scales,
        v_scales=v_scales, sinks=sinks,
    )  # fmt: skip
    if attention_chunk is not None:
        kw["attention_chunk"] = attention_chunk
    if batch.horizons is not None:  # image tokens attend both ways: only the references can
        reference, kw["horizons"] = True, batch.horizons
    extra = {} if reference else {"native": native}
    # The TPU kernel takes the ragged layout only, and every step's rows fit it.
    ragged_only = not reference and (
        ragged_implementation("auto", q, k_cache, v_cache, num_seqs, native, sinks is not None)
        == "pallas"
    )
    if (num_seqs == 1 or batch.decode_rows) and not ragged_only:
        rows = (None, slice(None)) if num_seqs == 1 else (slice(None), None)
        padded = paged_attention if reference else attention
        if "horizons" in kw:
            kw["horizons"] = kw["horizons"][rows]
        out = padded(
            q[rows], k_cache, v_cache, layer, batch.positions[rows], batch.page_indices,
            batch.kv_lens, **kw, **extra,
        )  # fmt: skip
        return out[0] if num_seqs == 1 else out[:, 0]
    ragged = ragged_paged_attention if reference else ragged_attention
    return ragged(
        q, k_cache, v_cache, layer, batch.positions, batch.q_starts, batch.page_indices,
        batch.kv_lens, **kw, **extra,
    )  # fmt: skip


def causal_self_attention(
    layer: Attention,  # one layer's attention (inside the layer scan)
    x: jax.Array,  # [num_seqs, seq_len, hidden]
    positions: jax.Array,  # [num_seqs, seq_len] int32
    lengths: jax.Array,  # [num_seqs] int32, valid tokens per sequence
    meta: LayerMeta,
    shared: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:  # [num_seqs, seq_len, hidden]
    """Project, rotate, attend causally within each sequence's valid tokens, project out,
    leaving the paged KV cache untouched (embeddings, prompt scoring).

    Where layers reuse others' K/V, ``shared`` = (K, V) ``[rows, num_seqs, seq_len,
    num_kv_heads, head_dim]`` holds the sources' (``LayerMeta.shared_row``): a source fills its
    row, a layer that reuses reads it; returned updated.

    Padding queries (index >= length) still see key 0, so they stay finite; their outputs are
    never read.
    """
    cfg, (num_seqs, seq_len, _) = layer.cfg, x.shape
    group = cfg.num_heads // cfg.num_kv_heads
    q, gate = output_gate(layer, x)
    q, k, v = project_qkv(layer, x, positions, meta, q)
    if k is None:
        row = jnp.maximum(meta.shared_row, 0)
        k, v = shared[0][row], shared[1][row]
    else:
        if cfg.round_kv_to is not None:
            k = k.astype(cfg.round_kv_to).astype(k.dtype)
            v = v.astype(cfg.round_kv_to).astype(v.dtype)
        if shared is not None:
            shared = _shared_stored(shared, meta.shared_row, k, v)
    q = q.reshape(num_seqs, seq_len, cfg.num_kv_heads, group, cfg.head_dim)
    scores = jnp.einsum(
        "bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32
    )  # [num_seqs, num_kv_heads, group, seq_len, seq_len]
    scores = scores * cfg.scale
    if cfg.soft_cap is not None:
        scores = cfg.soft_cap * jnp.tanh(scores / cfg.soft_cap)
    idx = jnp.arange(seq_len)
    mask = idx[None, :] <= idx[:, None]  # [q, s] causal
    window = layer_window(cfg, meta)
    if window is not None:
        mask &= idx[:, None] - idx[None, :] < window
    chunk = layer_chunk(cfg, meta)
    if chunk is not None:
        mask &= idx[None, :] >= (idx - idx % chunk)[:, None]
    mask = mask[None] & (idx < lengths[:, None])[:, None, :]  # [num_seqs, q, s]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    sinks = None if layer.sinks is None else layer.sinks.get_value()
    probs = softmax_with_sinks(scores, sinks)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v)
    out = out.reshape(num_seqs, seq_len, cfg.num_heads, cfg.head_dim)
    return output_projection(layer, out, gate), shared


def _shared_stored(
    shared: tuple[jax.Array, jax.Array],  # [rows, num_seqs, seq_len, num_kv_heads, head_dim]
    row: jax.Array,  # [] int32, -1: not a source
    k: jax.Array,  # [num_seqs, seq_len, num_kv_heads, head_dim]
    v: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``shared`` with a source layer's K and V in its row (unchanged when ``row`` is -1)."""
    at = jnp.maximum(row, 0)
    return tuple(
        jnp.where(row >= 0, buf.at[at].set(new.astype(buf.dtype)), buf)
        for buf, new in zip(shared, (k, v), strict=True)
    )


class Attention(Block):
    """A layer's (or a stack of ``lead`` layers') attention weights: the query projection split
    by heads, the key and value projections by KV heads, the output projection by heads along
    its input (so its partial sums are all-reduced)."""

    def __init__(
        self,
        cfg: AttentionConfig,
        lead: Sequence[int],
        hidden: int,
        dtype: jnp.dtype,
        quantized: Collection[str] = (),
        reuses_kv: bool = False,
    ) -> None:
        """With ``reuses_kv`` the layer attends to an earlier layer's K/V and declares no K/V
        projections or norm (``DecoderConfig.kv_sources``)."""
        self.cfg = cfg
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        wq_width = 2 * q_width if cfg.output_gate else q_width

        def proj(features: tuple[int, int], axes: tuple[str, str], field: str, bias: str | None):
            return projection(lead, features, axes, dtype, field, bias, quantized)

        qkv = cfg.qkv_bias
        self.wq = proj((hidden, wq_width), (EMBED, HEADS), "wq", "bq" if qkv else None)
        kv = (hidden, kv_width), (EMBED, KV_HEADS)
        self.wk = None if reuses_kv else proj(*kv, "wk", "bk" if qkv else None)
        self.wv = None if reuses_kv else proj(*kv, "wv", "bv" if qkv else None)
        self.wo = proj((q_width, hidden), (HEADS, EMBED), "wo", "bo" if cfg.o_bias else None)
        normed = cfg.qk_norm is not None
        self.q_norm = self._qk_norm(lead, cfg.num_heads, HEADS, dtype, "q_norm") if normed else None
        self.k_norm = (
            self._qk_norm(lead, cfg.num_kv_heads, KV_HEADS, dtype, "k_norm")
            if normed and not reuses_kv
            else None
        )
        sink_shape, sink_axes = (*lead, cfg.num_heads), (*layer_axes(lead), HEADS)
        self.sinks = declare(sink_shape, dtype, sink_axes, "sinks") if cfg.sinks else None

    def _qk_norm(
        self, lead: Sequence[int], heads: int, axis: str, dtype: jnp.dtype, field: str
    ) -> Norm:
        cfg, stack = self.cfg, layer_axes(lead)
        if cfg.qk_norm_all_heads:  # split with the projection's heads; its mean is all-reduced
            shape, axes = (*lead, heads * cfg.head_dim), (*stack, axis)
            return Norm(cfg.qk_norm, shape, axes, dtype, field)
        if cfg.qk_norm_per_head:  # one weight per head (StableLM 2), no bias
            shape, axes = (*lead, heads, cfg.head_dim), (*stack, axis, HEAD_DIM)
            return Norm(cfg.qk_norm, shape, axes, dtype, field, bias=False)
        return Norm(cfg.qk_norm, (*lead, cfg.head_dim), (*stack, NORM), dtype, field)

    def __call__(
        self,
        x: jax.Array,  # [num_tokens, hidden]
        cache: KVCache,
        meta: LayerMeta,
        batch: StepBatch,
        native: bool = False,
    ) -> tuple[jax.Array, KVCache]:  # [num_tokens, hidden]
        """``paged_self_attention`` with this layer's weights."""
        return paged_self_attention(self, x, cache, meta, batch, native)

    def causal(
        self,
        x: jax.Array,  # [num_seqs, seq_len, hidden]
        positions: jax.Array,  # [num_seqs, seq_len] int32
        lengths: jax.Array,  # [num_seqs] int32
        meta: LayerMeta,
        shared: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:  # [num_seqs, seq_len, hidden]
        """``causal_self_attention`` with this layer's weights."""
        return causal_self_attention(self, x, positions, lengths, meta, shared)
