"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5, over per-sequence state slots.

A layer projects the hidden state to q, k, v (one run of ``conv_dim`` channels), an output gate
z, and per value head ``b`` (beta = sigmoid(b)) and ``a`` (the decay
g = -exp(A_log) * softplus(a + dt_bias)); runs q, k, v through a short depthwise causal
convolution with SiLU; runs the gated delta rule (``models.layers.gated_delta_rule``); norms
each head's output (RMS, times ``norm``) gated by silu(z); and projects out. Qwen3-Next's
checkpoint fuses the projections per key head (``in_proj_qkvz``, ``in_proj_ba``:
``fused_projections``); Qwen3.5's keeps four.

The convolution's channels are in *head-major* order: per key head its q, its k, then its
group's v channels (``head_major``). Qwen3-Next's fused projections give that order per key head
already; Qwen3.5's ``in_proj_qkv`` and both checkpoints' ``conv1d`` (q, then k, then v) are cut
into q, k and v fields at load. So every weight of the layer (but the gated norm's, which all
heads share) and its states split over a tensor-parallel mesh in contiguous blocks of whole key
heads with their value heads (``LINEAR_HEADS``, as vLLM splits Qwen3-Next: the projections
column-parallel, the convolution and the state slots along their heads, the output projection
row-parallel), and the layer runs on each device's heads with one all-reduce, after the output
projection. The key heads must divide by the tensor-parallel size
(``runtime.parallel.sharding``).

Instead of K/V pages such a layer keeps a fixed-size state per sequence: the last
``conv_kernel - 1`` convolution inputs and the ``[v_heads, k_head_dim, v_head_dim]`` recurrent
state. ``HybridCache`` holds them for every linear-attention layer in *state slots* beside the
paged KV cache of the full-attention layers; the scheduler gives each running sequence a slot
(``StepBatch.state_slots``). A step gathers its sequences' slots, continues from them (a
sequence whose first new token is at position 0 starts from zeros, whatever the slot held, so a
new or recomputed sequence needs no reset), and writes them back; rows of padding sequences
write nothing.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import struct

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.layers import gated_delta_rule as gdr
from jax_llm_runtime.models.layers.linear import Linear, projection
from jax_llm_runtime.models.layers.norms import row_mean
from jax_llm_runtime.models.layers.params import (
    EMBED,
    LAYERS,
    LINEAR_HEADS,
    Block,
    declare,
    layer_axes,
)
from jax_llm_runtime.pallas_kernels.paged_attention import KVCache

# The projections ``--isq`` (or a quantized checkpoint) may pack; b and a, one column per value
# head, stay in the model dtype.
LINEAR_ATTENTION_QUANTIZED = ("la_qkvz", "la_q", "la_k", "la_v", "la_z", "la_out")
# Logical axes of ``HybridCache.conv`` and ``.recurrent``: each device keeps its heads' states.
CONV_STATE_AXES = (LAYERS, "state_slots", "conv_kernel", LINEAR_HEADS)
RECURRENT_STATE_AXES = (LAYERS, "state_slots", LINEAR_HEADS, "k_head_dim", "v_head_dim")


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet's shapes: ``num_v_heads`` value heads, each group of
    ``num_v_heads // num_k_heads`` sharing a key head."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    norm_eps: float = 1e-6
    fused_projections: bool = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba
    chunk_size: int = gdr.CHUNK_SIZE

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"linear attention {name} must be >= 1, got {getattr(self, name)}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v (in head-major order: ``head_major``)."""
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self, num_layers: int, num_slots: int) -> tuple[tuple[int, ...], ...]:
        """Shapes of ``HybridCache.conv`` and ``HybridCache.recurrent``."""
        conv = (num_layers, num_slots, self.conv_kernel - 1, self.conv_dim)
        return conv, (num_layers, num_slots, self.num_v_heads, self.k_head_dim, self.v_head_dim)

    def slot_bytes(self, num_layers: int, dtype: jnp.dtype) -> int:
        """Bytes of one state slot (conv state in ``dtype``, recurrent state in float32)."""
        conv, rec = self.state_shapes(num_layers, 1)
        return math.prod(conv) * jnp.dtype(dtype).itemsize + math.prod(rec) * 4


@struct.dataclass
class HybridCache:
    """The paged K/V of the full-attention layers and the state slots of the linear-attention
    layers; donated to every step and returned updated, like a ``KVCache``."""

    kv: KVCache
    conv: jax.Array  # [linear_layers, num_slots, conv_kernel - 1, conv_dim] head-major
    recurrent: jax.Array  # [linear_layers, num_slots, v_heads, k_head_dim, v_head_dim] float32

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @classmethod
    def zeros(
        cls,
        kv: KVCache,
        cfg: LinearAttentionConfig,
        num_layers: int,
        num_slots: int,
        dtype: jnp.dtype,
    ) -> HybridCache:
        conv, rec = cfg.state_shapes(num_layers, num_slots)
        return cls(kv, jnp.zeros(conv, dtype), jnp.zeros(rec, jnp.float32))


@struct.dataclass
class SlotState:
    """The states of a batch of sequences in one layer."""

    conv: jax.Array  # [num_seqs, conv_kernel - 1, conv_dim] head-major
    recurrent: jax.Array  # [num_seqs, v_heads, k_head_dim, v_head_dim] float32


@struct.dataclass
class Projected:
    """A layer's input projections, q/k/v channels before the convolution."""

    qkv: jax.Array  # [..., conv_dim] head-major
    z: jax.Array  # [..., v_heads, v_head_dim]
    b: jax.Array  # [..., v_heads]
    a: jax.Array  # [..., v_heads]


class GatedDeltaNet(Block):
    """A layer's (or a stack of ``lead`` layers') Gated DeltaNet weights."""

    def __init__(
        self,
        cfg: LinearAttentionConfig,
        lead: Sequence[int],
        hidden: int,
        dtype: jnp.dtype,
        quantized: Collection[str] = (),
    ) -> None:
        self.cfg = cfg
        stack = layer_axes(lead)

        def proj(width: int, field: str) -> Linear:
            features = (hidden, width), (EMBED, LINEAR_HEADS)
            return projection(lead, *features, dtype, field, None, quantized)

        heads, r = cfg.num_v_heads, cfg.num_v_heads // cfg.num_k_heads
        if cfg.fused_projections:  # per key head: its q, k, v group, z group (then b's, a's)
            per_key = 2 * cfg.k_head_dim + 2 * r * cfg.v_head_dim
            self.in_qkvz = proj(cfg.num_k_heads * per_key, "la_qkvz")
            self.in_ba = proj(2 * heads, "la_ba")
        else:  # in_proj_qkv cut into its q, k and v at load (the module docstring)
            self.in_q, self.in_k = proj(cfg.key_dim, "la_q"), proj(cfg.key_dim, "la_k")
            self.in_v, self.in_z = proj(cfg.value_dim, "la_v"), proj(cfg.value_dim, "la_z")
            self.in_b, self.in_a = proj(heads, "la_b"), proj(heads, "la_a")
        # The checkpoint's depthwise Conv1d weight, [channels, 1, kernel], cut into the q, k
        # and v channels.
        conv_axes = (*stack, LINEAR_HEADS, None, None)
        widths = (("q", cfg.key_dim), ("k", cfg.key_dim), ("v", cfg.value_dim))
        self.conv_q, self.conv_k, self.conv_v = (
            declare((*lead, n, 1, cfg.conv_kernel), dtype, conv_axes, f"la_conv_{name}")
            for name, n in widths
        )
        self.dt_bias = declare((*lead, heads), dtype, (*stack, LINEAR_HEADS), "la_dt_bias")
        self.a_log = declare((*lead, heads), dtype, (*stack, LINEAR_HEADS), "la_a_log")
        self.norm = declare((*lead, cfg.v_head_dim), dtype, (*stack, None), "la_norm")
        out = (cfg.value_dim, hidden), (LINEAR_HEADS, EMBED)
        self.out = projection(lead, *out, dtype, "la_out", None, quantized)

    def __call__(
        self,
        x: jax.Array,  # [num_tokens, hidden]
        cache: HybridCache,
        index: jax.Array,  # [] int32, this layer's slot in the state arrays
        batch: StepBatch,
    ) -> tuple[jax.Array, HybridCache]:  # [num_tokens, hidden]
        """``paged_linear_attention`` with this layer's weights."""
        return paged_linear_attention(self, x, cache, index, batch)

    def causal(
        self,
        x: jax.Array,  # [num_seqs, seq_len, hidden]
        lengths: jax.Array,  # [num_seqs] int32
    ) -> jax.Array:  # [num_seqs, seq_len, hidden]
        """Each sequence from a zero state, leaving every cache untouched (embeddings)."""
        cfg, (num_seqs, seq_len, _) = self.cfg, x.shape
        valid = jnp.arange(seq_len)[None, :] < lengths[:, None]
        conv, rec = cfg.state_shapes(1, num_seqs)
        state = SlotState(jnp.zeros(conv[1:], x.dtype), jnp.zeros(rec[1:], jnp.float32))
        return mix(self, x, valid, lengths, state)[0]


def head_major(
    q: jax.Array,  # [..., num_k_heads * k_head_dim]
    k: jax.Array,  # [..., num_k_heads * k_head_dim]
    v: jax.Array,  # [..., num_k_heads * group * v_head_dim]
    num_k_heads: int,
) -> jax.Array:  # [..., conv_dim]
    """q, k and v channels in head-major order: per key head its q, its k, then its group's v
    (a block of whole heads is then a contiguous run of channels)."""
    lead = q.shape[:-1]
    per_head = [t.reshape(*lead, num_k_heads, -1) for t in (q, k, v)]
    return jnp.concatenate(per_head, axis=-1).reshape(*lead, -1)


def conv_weight(layer: GatedDeltaNet) -> jax.Array:  # [conv_dim, kernel] head-major
    """The convolution's weight over the head-major channels."""
    parts = (layer.conv_q, layer.conv_k, layer.conv_v)
    q, k, v = (jnp.swapaxes(w.get_value()[..., 0, :], -1, -2) for w in parts)  # [kernel, ch]
    return jnp.swapaxes(head_major(q, k, v, layer.cfg.num_k_heads), -1, -2)


def project(layer: GatedDeltaNet, x: jax.Array) -> Projected:  # x [..., hidden]
    """The input projections in one layout whichever checkpoint layout the layer has."""
    cfg, lead = layer.cfg, x.shape[:-1]
    nv, dk, dv = cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim
    if not cfg.fused_projections:
        qkv = head_major(layer.in_q(x), layer.in_k(x), layer.in_v(x), cfg.num_k_heads)
        z = layer.in_z(x).reshape(*lead, nv, dv)
        return Projected(qkv, z, layer.in_b(x), layer.in_a(x))
    # Per key head: q, k, then its group's v heads and z heads (and b's, then a's).
    r = nv // cfg.num_k_heads
    qkvz = layer.in_qkvz(x).reshape(*lead, cfg.num_k_heads, -1)
    qkv, z = qkvz[..., : 2 * dk + r * dv], qkvz[..., 2 * dk + r * dv :]
    ba = layer.in_ba(x).reshape(*lead, cfg.num_k_heads, 2 * r)
    b, a = ba[..., :r].reshape(*lead, nv), ba[..., r:].reshape(*lead, nv)
    return Projected(qkv.reshape(*lead, -1), z.reshape(*lead, nv, dv), b, a)


def mix(
    layer: GatedDeltaNet,
    x: jax.Array,  # [num_seqs, seq_len, hidden], each row's real tokens first
    valid: jax.Array,  # [num_seqs, seq_len] bool
    lengths: jax.Array,  # [num_seqs] int32, real tokens per row
    state: SlotState,
) -> tuple[jax.Array, SlotState]:  # [num_seqs, seq_len, hidden], the states after them
    """The layer over padded rows continuing from ``state``: padding tokens change no state,
    and their outputs are garbage that nothing reads."""
    cfg = layer.cfg
    p = project(layer, x)
    qkv = jnp.where(valid[..., None], p.qkv, 0)
    mixed, conv_state = gdr.causal_conv(qkv, state.conv, conv_weight(layer), lengths)
    dk, lead = cfg.k_head_dim, mixed.shape[:-1]
    per_head = mixed.reshape(*lead, cfg.num_k_heads, -1)
    q, k = per_head[..., :dk], per_head[..., dk : 2 * dk]
    v = per_head[..., 2 * dk :].reshape(*lead, cfg.num_v_heads, cfg.v_head_dim)
    q, k = gdr.normed_queries_keys(q, k, cfg.num_v_heads)
    keep = valid[..., None].astype(jnp.float32)
    beta = jax.nn.sigmoid(p.b.astype(jnp.float32)) * keep
    dt = p.a.astype(jnp.float32) + layer.dt_bias.get_value().astype(jnp.float32)
    g = -jnp.exp(layer.a_log.get_value().astype(jnp.float32)) * jax.nn.softplus(dt) * keep
    rule = gdr.recurrent if x.shape[1] == 1 else gdr.chunked
    out, recurrent = rule(q, k, v.astype(jnp.float32), g, beta, state.recurrent)
    out = gated_rms_norm(out.astype(x.dtype), p.z, layer.norm.get_value(), cfg.norm_eps)
    out = layer.out(out.reshape(*lead, cfg.value_dim))
    return out, SlotState(conv_state, recurrent)


def gated_rms_norm(
    x: jax.Array,  # [..., v_head_dim]
    gate: jax.Array,  # [..., v_head_dim]
    weight: jax.Array,  # [v_head_dim]
    eps: float,
) -> jax.Array:  # like x
    """RMS norm of each head, times ``weight``, times silu(gate) (transformers'
    ``Qwen3NextRMSNormGated``: the normed value is rounded to x's dtype before the weight)."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(row_mean(xf * xf) + eps)).astype(x.dtype)
    out = weight.astype(x.dtype) * normed
    return (out.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def paged_linear_attention(
    layer: GatedDeltaNet,
    x: jax.Array,  # [num_tokens, hidden]
    cache: HybridCache,
    index: jax.Array,  # [] int32
    batch: StepBatch,
) -> tuple[jax.Array, HybridCache]:  # [num_tokens, hidden]
    """One layer over a step's ragged run: each sequence's rows are gathered into a padded row
    (one token per sequence in a decode step), run from its slot's state, scattered back, and
    its slot updated.

    Padding every sequence of a mixed step to the whole run would multiply the work by the
    sequence count, so a ``single_chunk`` step (every sequence one token but at most one: the
    scheduler's guarantee) runs its one-token sequences as one recurrent step each and the
    chunk as one padded row."""
    num_tokens, num_seqs = x.shape[0], batch.num_seqs
    q_lens = batch.q_lens
    slots = batch.state_slots if batch.state_slots is not None else jnp.arange(num_seqs)
    if batch.decode_rows:  # row s is sequence s's token (q_starts need not say so: StepBatch)
        return _rows(layer, x, cache, index, batch, (jnp.arange(num_seqs), q_lens, slots), 1)
    starts = batch.q_starts[:-1]
    if not batch.single_chunk or num_seqs == 1:
        return _rows(layer, x, cache, index, batch, (starts, q_lens, slots), num_tokens)
    ones = jnp.where(q_lens == 1, 1, 0)
    out, cache = _rows(layer, x, cache, index, batch, (starts, ones, slots), 1)
    c = jnp.argmax(q_lens)  # the chunk, if the step has one
    chunk = (starts[c][None], jnp.where(q_lens[c] > 1, q_lens[c], 0)[None], slots[c][None])
    chunk_out, cache = _rows(layer, x, cache, index, batch, chunk, num_tokens)
    return out + chunk_out, cache


def _rows(
    layer: GatedDeltaNet,
    x: jax.Array,  # [num_tokens, hidden]
    cache: HybridCache,
    index: jax.Array,  # [] int32
    batch: StepBatch,
    group: tuple[jax.Array, jax.Array, jax.Array],  # [n] int32 each: first rows, lengths, slots
    width: int,
) -> tuple[jax.Array, HybridCache]:  # [num_tokens, hidden], zero outside the group's rows
    """The layer over ``n`` row runs of the step (run ``i``: ``lengths[i]`` rows from
    ``starts[i]``, padded to ``width``; length 0: nothing), each continuing from its slot."""
    starts, lengths, slots = group
    num_tokens = x.shape[0]
    rows = starts[:, None] + jnp.arange(width)[None, :]  # [n, width]
    valid = jnp.arange(width)[None, :] < lengths[:, None]
    rows = jnp.where(valid, rows, num_tokens)  # out of range: padding
    xs = jnp.take(x, rows, axis=0, mode="fill", fill_value=0)
    slots = jnp.where(lengths > 0, slots, cache.num_slots)  # no rows: no slot
    # A sequence whose first new token is at position 0 is new (or recomputed): zero state.
    fresh = (jnp.take(batch.positions, starts, mode="clip") == 0)[:, None, None]
    # One gather of the step's slots (a slice of the layer first would copy all its slots).
    conv = cache.conv.at[index, slots].get(mode="fill", fill_value=0)
    rec = cache.recurrent.at[index, slots].get(mode="fill", fill_value=0)
    state = SlotState(jnp.where(fresh, 0, conv), jnp.where(fresh[..., None], 0, rec))
    out, state = mix(layer, xs, valid, lengths, state)
    out = out.reshape(-1, x.shape[-1]).astype(x.dtype)
    flat = jnp.zeros_like(x).at[rows.reshape(-1)].set(out, mode="drop")
    cache = cache.replace(
        conv=cache.conv.at[index, slots].set(state.conv.astype(cache.conv.dtype), mode="drop"),
        recurrent=cache.recurrent.at[index, slots].set(state.recurrent, mode="drop"),
    )
    return flat, cache
