"""Multi-head latent attention (DeepSeek V2/V3) over a paged cache of compressed latents.

Keys and values of every head are linear in one per-token latent, so the cache stores only that
latent: the normed ``c_kv`` (``kv_lora_rank`` features) followed by the rotated key part
``k_pe`` that all heads share (``qk_rope_head_dim`` features). ``paged_mla`` never expands it per
head. It folds the key half of ``kv_b_proj`` (W_UK) into each query and the value half (W_UV)
into the attention output, so the attention itself is multi-query attention with a single KV
"head" whose keys and values are both the latent row:

    score(t)  = (q_nope W_UK) . c_kv[t] + q_pe . k_pe[t]
    output    = (sum_t p(t) c_kv[t]) W_UV

Cache layout (see ``mla_cache_shapes``): ``KVCache.k`` is ``[num_layers, num_pages, page_size,
1, kv_lora_rank + qk_rope_head_dim]``; ``KVCache.v`` has a last dimension of 0, is never read
and is returned unchanged. A float8 cache stores each latent row in e4m3 with one scale
(``KVCache.k_scales``), which serves as both the key's and the value's scale.

``MLA`` declares a layer's weights; the functions take them by field name, linears stored
``[in, out]``:

- ``wq`` ``[hidden, num_heads * qk_head_dim]`` when ``q_lora_rank`` is None; otherwise ``wq_a``
  ``[hidden, q_lora_rank]``, ``q_a_norm`` ``[q_lora_rank]`` and ``wq_b``
  ``[q_lora_rank, num_heads * qk_head_dim]``. Each head's query is its nope part, then rope part.
- ``wkv_a`` ``[hidden, kv_lora_rank + qk_rope_head_dim]``, ``kv_a_norm`` ``[kv_lora_rank]``.
- ``wkv_b`` ``[kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim)]``: per head, W_UK
  then W_UV.
- ``wo`` ``[num_heads * v_head_dim, hidden]``.
- with ``attention_bias``: ``bq_a`` (only with ``q_lora_rank``), ``bkv_a``, ``bo``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.layers.attention import step_attention, write_step_kv
from jax_llm_runtime.models.layers.linear import linear, projection
from jax_llm_runtime.models.layers.norms import Norm, NormConfig, rms_norm
from jax_llm_runtime.models.layers.params import (
    EMBED,
    HEADS,
    LATENT,
    Block,
    layer_axes,
    shapes,
)
from jax_llm_runtime.models.layers.rope_scaling import yarn_mscale
from jax_llm_runtime.models.layers.rotary import RopeConfig, apply_rope, rope_from_hf
from jax_llm_runtime.models.weights import WeightRule
from jax_llm_runtime.pallas_kernels.paged_attention import (
    KVCache,
    kv_cache_shape,
)

_MASKED = -1e30  # finite, so a padding row with no visible key stays finite instead of NaN


@dataclass(frozen=True)
class MLAConfig:
    """Shapes and settings of one MLA layer; hashable, so it can be a static jit argument."""

    num_heads: int
    q_lora_rank: int | None  # None: queries come straight from the hidden state (``wq``)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig  # rotary_dim == qk_rope_head_dim; DeepSeek checkpoints rotate adjacent pairs
    norm_eps: float = 1e-6  # of q_a_norm and kv_a_norm
    # With scaled rope, yarn's gain yarn_mscale(rope.factor, mscale_all_dim) enters the softmax
    # scale squared (once for the query, once for the key); None leaves the scale unscaled.
    mscale_all_dim: float | None = None
    attention_bias: bool = False  # biases on the q_a, kv_a and o projections

    def __post_init__(self) -> None:
        dims = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for name in dims:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be None or >= 1, got {self.q_lora_rank}")
        if self.rope.rotary_dim != self.qk_rope_head_dim:
            raise ValueError(
                f"rope.rotary_dim ({self.rope.rotary_dim}) must equal qk_rope_head_dim "
                f"({self.qk_rope_head_dim}): MLA rotates exactly the rope part of each head"
            )
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.mscale_all_dim is not None and self.rope.rope_type == "default":
            raise ValueError("mscale_all_dim only applies with scaled rope; leave it None")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """Features cached per token: the latent ``c_kv`` then the shared rotated ``k_pe``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times yarn's ``mscale_all_dim`` gain squared when set: the
        scale of the full (nope + rope) query-key dot product."""
        scale = self.qk_head_dim**-0.5
        if self.mscale_all_dim is not None:
            scale *= yarn_mscale(self.rope.factor, self.mscale_all_dim) ** 2
        return scale


def mla_config_from_hf(hf: dict[str, Any]) -> MLAConfig:
    """The attention settings of an HF ``DeepseekV2Config`` / ``DeepseekV3Config`` dict.

    DeepSeek-V2 always rotates adjacent feature pairs (its rope is complex multiplication on
    pairs); V3 does when ``rope_interleave`` is true (its default) and rotates halves otherwise.
    ``num_key_value_heads`` is not read: every head expands the same latent.
    """
    rope_dim = int(hf["qk_rope_head_dim"])
    if hf.get("model_type") == "deepseek_v2":
        interleaved = True
    else:
        interleaved = bool(hf.get("rope_interleave", True))
    rope = dataclasses.replace(rope_from_hf(hf, rope_dim), interleaved=interleaved)
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    mscale_all_dim = params.get("mscale_all_dim") if rope.rope_type != "default" else None
    q_lora_rank = hf.get("q_lora_rank")
    return MLAConfig(
        num_heads=int(hf["num_attention_heads"]),
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(hf["v_head_dim"]),
        rope=rope,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        # 0 and null mean "off" in HF configs, as does a missing key.
        mscale_all_dim=float(mscale_all_dim) if mscale_all_dim else None,
        attention_bias=bool(hf.get("attention_bias", False)),
    )


_ATTN = r"model\.layers\.(\d+)\.self_attn\."
MLA_WEIGHT_RULES = (
    WeightRule(_ATTN + r"q_proj\.weight", "wq", transpose=True, per_layer=True),
    WeightRule(_ATTN + r"q_a_proj\.weight", "wq_a", transpose=True, per_layer=True),
    WeightRule(_ATTN + r"q_a_proj\.bias", "bq_a", per_layer=True),
    WeightRule(_ATTN + r"q_a_layernorm\.weight", "q_a_norm", per_layer=True),
    WeightRule(_ATTN + r"q_b_proj\.weight", "wq_b", transpose=True, per_layer=True),
    WeightRule(_ATTN + r"kv_a_proj_with_mqa\.weight", "wkv_a", transpose=True, per_layer=True),
    WeightRule(_ATTN + r"kv_a_proj_with_mqa\.bias", "bkv_a", per_layer=True),
    WeightRule(_ATTN + r"kv_a_layernorm\.weight", "kv_a_norm", per_layer=True),
    WeightRule(_ATTN + r"kv_b_proj\.weight", "wkv_b", transpose=True, per_layer=True),
    WeightRule(_ATTN + r"o_proj\.weight", "wo", transpose=True, per_layer=True),
    WeightRule(_ATTN + r"o_proj\.bias", "bo", per_layer=True),
)
# Every per-layer field the rules can fill; a given config declares a subset (``MLA``).
MLA_LAYER_FIELDS = tuple(rule.field for rule in MLA_WEIGHT_RULES)


def mla_cache_shapes(
    cfg: MLAConfig, num_layers: int, num_pages: int, page_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of ``KVCache.k`` (one latent row per token) and of the empty ``KVCache.v``."""
    k = kv_cache_shape(num_layers, num_pages, page_size, 1, cfg.cache_head_dim)
    return k, (*k[:4], 0)


def _queries(
    cfg: MLAConfig,
    x: jax.Array,  # [..., hidden]
    lw: Mapping[str, jax.Array],  # one layer's weights (see the module docstring)
    positions: jax.Array,  # [...] int32
) -> tuple[jax.Array, jax.Array]:
    """q_nope [..., num_heads, qk_nope_head_dim] and the rotated q_pe [..., num_heads,
    qk_rope_head_dim], for x [..., hidden] (a step's [num_tokens], or [num_seqs, q_len])."""
    if cfg.q_lora_rank is None:
        q = linear(x, lw["wq"])
    else:
        q_a = linear(x, lw["wq_a"], lw["bq_a"] if cfg.attention_bias else None)
        q = linear(rms_norm(q_a, lw["q_a_norm"], cfg.norm_eps), lw["wq_b"])
    q = q.reshape(*x.shape[:-1], cfg.num_heads, cfg.qk_head_dim)
    q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
    return q_nope, apply_rope(q_pe, positions, cfg.rope)


def _latents(
    cfg: MLAConfig,
    x: jax.Array,  # [..., hidden]
    lw: Mapping[str, jax.Array],  # one layer's weights (see the module docstring)
    positions: jax.Array,  # [...] int32
) -> jax.Array:  # [..., cache_head_dim]
    """Each token's cache row: the normed ``c_kv`` then its rotated, head-shared ``k_pe``."""
    kv_a = linear(x, lw["wkv_a"], lw["bkv_a"] if cfg.attention_bias else None)
    c_kv = rms_norm(kv_a[..., : cfg.kv_lora_rank], lw["kv_a_norm"], cfg.norm_eps)
    k_pe = apply_rope(kv_a[..., None, cfg.kv_lora_rank :], positions, cfg.rope)[..., 0, :]
    return jnp.concatenate([c_kv, k_pe], axis=-1)


def _split_kv_b(
    cfg: MLAConfig,
    wkv_b: jax.Array,  # [kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim)]
) -> tuple[jax.Array, jax.Array]:
    """W_UK [kv_lora_rank, num_heads, qk_nope_head_dim], W_UV [kv_lora_rank, num_heads, v_head_dim]."""
    w = wkv_b.reshape(cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
    return w[..., : cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim :]


def paged_mla(
    cfg: MLAConfig,
    x: jax.Array,  # [num_tokens, hidden]
    lw: Mapping[str, jax.Array],  # one layer's weights (see the module docstring)
    cache: KVCache,  # k: [num_layers, num_pages, page_size, 1, cache_head_dim]; v: unused
    layer: jax.Array,  # [] int32
    batch: StepBatch,
) -> tuple[jax.Array, KVCache]:  # [num_tokens, hidden]
    """Attention for one layer in the absorbed form; this step's latents are written to their
    pages before attending. Visibility follows ``paged_attention`` (causal, ``kv_lens``)."""
    if cache.k.shape[3:] != (1, cfg.cache_head_dim):
        raise ValueError(
            f"MLA cache k must end in (1, {cfg.cache_head_dim}), got shape {cache.k.shape}; "
            "build it with mla_cache_shapes"
        )
    num_tokens = x.shape[0]
    q_nope, q_pe = _queries(cfg, x, lw, batch.positions)
    latents = _latents(cfg, x, lw, batch.positions)[:, None, :]  # [num_tokens, 1, cache_dim]
    no_v = jnp.zeros((num_tokens, 1, 0), cache.dtype)
    cache = write_step_kv(cache, layer, latents, no_v, batch)
    w_uk, w_uv = _split_kv_b(cfg, lw["wkv_b"])
    # Absorption reassociates the products, so the latent-space query and output stay in
    # float32 and round only once, before the output projection.
    q_latent = jnp.einsum(
        "thn,rhn->thr", q_nope, w_uk.astype(x.dtype), preferred_element_type=jnp.float32
    )  # [num_tokens, num_heads, kv_lora_rank]
    q = jnp.concatenate([q_latent, q_pe.astype(jnp.float32)], axis=-1)
    # The latent row is both key and value; only its c_kv features are wanted as output.
    latent_rows = (cache.k, cache.k, cache.k_scales, cache.k_scales)
    out = step_attention(q, latent_rows, layer, batch, scale=cfg.softmax_scale, reference=True)
    out = out[..., : cfg.kv_lora_rank]  # [num_tokens, num_heads, kv_lora_rank] float32
    out = jnp.einsum("thr,rhv->thv", out, w_uv.astype(jnp.float32)).astype(x.dtype)
    out = out.reshape(num_tokens, cfg.num_heads * cfg.v_head_dim)
    out = linear(out, lw["wo"], lw["bo"] if cfg.attention_bias else None)
    return out, cache


def mla_causal(
    cfg: MLAConfig,
    x: jax.Array,  # [num_seqs, seq_len, hidden]
    lw: Mapping[str, jax.Array],  # one layer's weights (see the module docstring)
    positions: jax.Array,  # [num_seqs, seq_len] int32
    lengths: jax.Array,  # [num_seqs] int32, valid tokens per sequence
) -> jax.Array:  # [num_seqs, seq_len, hidden]
    """Causal MLA within each sequence's first ``lengths`` tokens, without the cache.

    Keys and values are expanded per head (the form HF computes). Padding rows (index >= length)
    stay finite and are never read.
    """
    num_seqs, seq_len, _ = x.shape
    q_nope, q_pe = _queries(cfg, x, lw, positions)
    latents = _latents(cfg, x, lw, positions)
    c_kv, k_pe = latents[..., : cfg.kv_lora_rank], latents[..., cfg.kv_lora_rank :]
    kv = linear(c_kv, lw["wkv_b"]).reshape(
        num_seqs, seq_len, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim
    )
    k_nope, v = kv[..., : cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim :]
    f32 = jnp.float32
    scores = jnp.einsum("bqhn,bshn->bhqs", q_nope, k_nope, preferred_element_type=f32)
    scores += jnp.einsum("bqhr,bsr->bhqs", q_pe, k_pe, preferred_element_type=f32)
    scores *= cfg.softmax_scale  # [num_seqs, num_heads, seq_len, seq_len]
    idx = jnp.arange(seq_len)
    visible = (idx[None, :] <= idx[:, None])[None] & (idx < lengths[:, None])[:, None, :]
    scores = jnp.where(visible[:, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqs,bshv->bqhv", probs, v.astype(f32)).astype(x.dtype)
    out = out.reshape(num_seqs, seq_len, cfg.num_heads * cfg.v_head_dim)
    return linear(out, lw["wo"], lw["bo"] if cfg.attention_bias else None)


class MLA(Block):
    """A layer's (or a stack of ``lead`` layers') MLA weights (see the module docstring). The
    per-head projections split by heads (``wq`` or ``wq_b``, and ``wkv_b``: each head's columns
    lie together), ``wo`` by heads along its input; the low-rank ``wq_a`` and ``wkv_a`` and
    their norms are read by every head and stay whole, as does the latent cache."""

    def __init__(
        self,
        cfg: MLAConfig,
        lead: Sequence[int],
        hidden: int,
        dtype: jnp.dtype,
        quantized: Collection[str] = (),
    ) -> None:
        self.cfg = cfg
        h, bias = cfg.num_heads, cfg.attention_bias
        norm = NormConfig("rms", cfg.norm_eps)

        def proj(features: tuple[int, int], axes: tuple[str, str], field: str, b: str | None):
            # kv_b is absorbed into the queries and outputs (never a plain linear): run dtype.
            packable = () if field == "wkv_b" else quantized
            return projection(lead, features, axes, dtype, field, b if bias else None, packable)

        def latent_norm(rank: int, field: str) -> Norm:
            return Norm(norm, (*lead, rank), (*layer_axes(lead), LATENT), dtype, field)

        rank, q_width = cfg.q_lora_rank, h * cfg.qk_head_dim
        direct = rank is None
        self.wq = proj((hidden, q_width), (EMBED, HEADS), "wq", None) if direct else None
        self.wq_a = None if direct else proj((hidden, rank), (EMBED, LATENT), "wq_a", "bq_a")
        self.q_a_norm = None if direct else latent_norm(rank, "q_a_norm")
        self.wq_b = None if direct else proj((rank, q_width), (LATENT, HEADS), "wq_b", None)
        self.wkv_a = proj((hidden, cfg.cache_head_dim), (EMBED, LATENT), "wkv_a", "bkv_a")
        self.kv_a_norm = latent_norm(cfg.kv_lora_rank, "kv_a_norm")
        kv_b = (cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.wkv_b = proj(kv_b, (LATENT, HEADS), "wkv_b", None)
        self.wo = proj((h * cfg.v_head_dim, hidden), (HEADS, EMBED), "wo", "bo")

    def __call__(
        self,
        x: jax.Array,  # [num_seqs, q_len, hidden]
        cache: KVCache,
        layer: jax.Array,  # [] int32
        batch: StepBatch,
    ) -> tuple[jax.Array, KVCache]:  # [num_seqs, q_len, hidden]
        """``paged_mla`` with this layer's weights."""
        return paged_mla(self.cfg, x, self.fields(), cache, layer, batch)

    def causal(
        self,
        x: jax.Array,  # [num_seqs, seq_len, hidden]
        positions: jax.Array,  # [num_seqs, seq_len] int32
        lengths: jax.Array,  # [num_seqs] int32
    ) -> jax.Array:  # [num_seqs, seq_len, hidden]
        """``mla_causal`` with this layer's weights."""
        return mla_causal(self.cfg, x, self.fields(), positions, lengths)


def mla_weight_shapes(
    cfg: MLAConfig, hidden_size: int, num_layers: int
) -> dict[str, tuple[int, ...]]:
    """Every attention weight field this config declares, stacked on a leading layer axis."""
    return shapes(MLA(cfg, (num_layers,), hidden_size, jnp.float32))
