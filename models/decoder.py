"""The decoder-only transformer that every architecture here is a configuration of.

A layer is: norm -> attention -> (post-norm) -> residual, then norm -> MLP or MoE -> (post-norm)
-> residual; or, with ``parallel_residual`` (Phi-2, StableLM), x + attn(norm(x)) + mlp(norm(x)).
What differs between architectures is data in ``DecoderConfig`` (norm kind, activation, biases,
sandwich norms, sliding layers, soft-caps, embedding scale) and a table of checkpoint-name rules;
the architecture files (``llama.py``, ``gemma.py``, ...) hold only those translations.

Layers are stacked per field and run with ``lax.scan``. A model whose layers are not all alike
(DeepSeek's dense layers before its MoE layers) is split into *segments* of alike layers, each
scanned on its own; ``weights["segments"]`` holds one dict of stacked fields per segment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.isq import ISQ_TYPES, packer
from jax_llm_runtime.models.layers.attention import (
    FULL_WINDOW,
    AttentionConfig,
    LayerMeta,
    paged_self_attention,
)
from jax_llm_runtime.models.layers.causal_attention import causal_self_attention
from jax_llm_runtime.models.layers.expert_offload import (
    EXPERT_FIELDS,
    HOST_SUFFIX,
    split_stack,
    to_host_memory,
)
from jax_llm_runtime.models.layers.linear import (
    OPERAND_DTYPES,
    int8_operands,
    linear,
    quantize_int8,
)
from jax_llm_runtime.models.layers.mla import (
    MLAConfig,
    mla_cache_shapes,
    mla_causal,
    mla_weight_shapes,
    paged_mla,
)
from jax_llm_runtime.models.layers.mlp import check_activation, dense_mlp
from jax_llm_runtime.models.layers.moe import MoEConfig, moe_mlp, moe_weight_shapes
from jax_llm_runtime.models.layers.norms import NormConfig, apply_norm
from jax_llm_runtime.models.weights import Packing, WeightRule, load_host_weights
from jax_llm_runtime.pallas_kernels.dequant_matmul import (
    HostPacked,
    PackedLayer,
    PackedWeight,
    dequant_matmul,
    packed_head,
)
from jax_llm_runtime.pallas_kernels.dequant_matmul import native as native_dequant
from jax_llm_runtime.pallas_kernels.paged_attention import KVCache, kv_cache_shape


@dataclass(frozen=True)
class DecoderConfig:
    """Static description of one model. ``sliding_layers`` is empty (no layer slides) or one flag
    per layer; sliding layers use ``attention.sliding_window`` and, when set,
    ``attention.local_rope``. ``attention`` is multi-head latent attention (DeepSeek) when it is
    an ``MLAConfig``. With ``moe``, layers from ``first_moe_layer`` on replace the MLP with
    mixture-of-experts; the layers before keep the dense MLP of ``intermediate_size``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention: AttentionConfig | MLAConfig
    norm: NormConfig = field(default_factory=NormConfig)
    activation: str = "silu"
    gated_mlp: bool = True
    mlp_bias: bool = False
    parallel_residual: bool = False
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2/3, GLM-4)
    embed_scale: float | None = None  # Gemma multiplies embeddings by sqrt(hidden_size)
    final_soft_cap: float | None = None  # Gemma 2: cap * tanh(logits / cap)
    lm_head_bias: bool = False
    sliding_layers: tuple[bool, ...] = ()
    moe: MoEConfig | None = None
    first_moe_layer: int = 0
    quantization: str | None = None  # "int8": weight-only int8 for the projections (see linear)
    operand_dtype: str | None = None  # quantized projections' operands (see models.layers.linear)
    # The step runs on XLA:CPU and is not split over a device mesh, so native CPU kernels
    # (``pallas_kernels.native``: custom calls, which XLA's partitioner does not split) may
    # replace XLA formulations where one is built; set by ``runtime.loading.builder``.
    native_kernels: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_activation(self.activation)
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ValueError(
                f"{len(self.sliding_layers)} sliding-layer flags for {self.num_layers} layers"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(map(str, QUANTIZATIONS))}, "
                f"got {self.quantization!r}"
            )
        if self.operand_dtype not in OPERAND_DTYPES:
            raise ValueError(
                f"operand_dtype must be one of {OPERAND_DTYPES}, got {self.operand_dtype!r}"
            )
        if not 0 <= self.first_moe_layer <= self.num_layers:
            raise ValueError(f"first_moe_layer {self.first_moe_layer} is not a layer index")
        if any(self.sliding_layers) and getattr(self.attention, "sliding_window", None) is None:
            raise ValueError("sliding layers need a sliding_window")
        if self.final_soft_cap is not None and not self.final_soft_cap > 0:
            raise ValueError(f"final logit soft-cap must be > 0, got {self.final_soft_cap}")

    @property
    def num_kv_heads(self) -> int:
        """KV heads per cache row (1 for MLA's shared latent)."""
        return 1 if isinstance(self.attention, MLAConfig) else self.attention.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Width of one cached K row (MLA: the latent plus the rotary key)."""
        if isinstance(self.attention, MLAConfig):
            return self.attention.cache_head_dim
        return self.attention.head_dim

    def cache_shapes(self, num_pages: int, page_size: int) -> tuple[tuple[int, ...], ...]:
        """Shapes of ``KVCache.k`` and ``KVCache.v`` (MLA keeps no separate V: its V is empty)."""
        if isinstance(self.attention, MLAConfig):
            return mla_cache_shapes(self.attention, self.num_layers, num_pages, page_size)
        shape = kv_cache_shape(
            self.num_layers, num_pages, page_size, self.num_kv_heads, self.head_dim
        )
        return shape, shape

    @property
    def segments(self) -> tuple[tuple[int, int, bool], ...]:
        """``(start, end, is_moe)`` runs of alike layers, each scanned separately."""
        if self.moe is None:
            return ((0, self.num_layers, False),)
        runs = ((0, self.first_moe_layer, False), (self.first_moe_layer, self.num_layers, True))
        return tuple(run for run in runs if run[1] > run[0])


_GLOBAL_FIELDS = ("embed", "final_norm", "final_norm_b", "lm_head", "lm_head_b")
QUANTIZATIONS = (None, "int8", *ISQ_TYPES)
# The weights kept packed when a checkpoint is quantized (or ``--isq`` quantizes): the layers'
# projections and the shared experts', which go through ``linear``, and the routed expert stacks
# (``models.layers.moe`` gathers or dequantizes them per layer). Embeddings, the LM head (too wide:
# see models.layers.linear), norms, biases, routers and MLA's kv_b stay in the run dtype; a
# quantized checkpoint's tensors for them are dequantized at load. ``--isq int8`` covers only
# the first set.
_QUANTIZED_FIELDS = frozenset(
    ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "w_gate", "w_up", "w_down")
).union(("s_gate", "s_up", "s_down"))
PACKED_FIELDS = _QUANTIZED_FIELDS.union(("e_gate", "e_up", "e_down"))


def weight_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every weight field and its shape; per-layer fields lead with the layer axis (MLP fields
    with their segment's layers: see ``ffn_shapes``)."""
    n, h = cfg.num_layers, cfg.hidden_size
    shapes = {"embed": (cfg.vocab_size, h), **_norm_shapes(cfg, "final_norm", ())}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, cfg.vocab_size)
        if cfg.lm_head_bias:
            shapes["lm_head_b"] = (cfg.vocab_size,)
    shapes |= _norm_shapes(cfg, "attn_norm", (n,))
    if isinstance(cfg.attention, MLAConfig):
        shapes |= mla_weight_shapes(cfg.attention, h, n)
    else:
        shapes |= _attention_shapes(cfg.attention, h, n)
    if not cfg.parallel_residual:
        shapes |= _norm_shapes(cfg, "mlp_norm", (n,))
    if cfg.sandwich_norms:
        shapes |= _norm_shapes(cfg, "attn_post_norm", (n,)) | _norm_shapes(
            cfg, "mlp_post_norm", (n,)
        )
    return shapes | ffn_shapes(cfg, dense=True) | ffn_shapes(cfg, dense=False)


def _attention_shapes(a: AttentionConfig, h: int, n: int) -> dict[str, tuple[int, ...]]:
    q_width, kv_width = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    shapes = {"wq": (n, h, q_width), "wk": (n, h, kv_width), "wv": (n, h, kv_width)}
    shapes["wo"] = (n, q_width, h)
    if a.qkv_bias:
        shapes |= {"bq": (n, q_width), "bk": (n, kv_width), "bv": (n, kv_width)}
    if a.o_bias:
        shapes["bo"] = (n, h)
    if a.qk_norm is not None:
        q_shape = (n, a.num_heads, a.head_dim) if a.qk_norm_per_head else (n, a.head_dim)
        k_shape = (n, a.num_kv_heads, a.head_dim) if a.qk_norm_per_head else (n, a.head_dim)
        shapes |= {"q_norm": q_shape, "k_norm": k_shape}
        if a.qk_norm.kind == "layer" and not a.qk_norm_per_head:
            shapes |= {"q_norm_b": q_shape, "k_norm_b": k_shape}
    return shapes


def _norm_shapes(cfg: DecoderConfig, name: str, lead: tuple[int, ...]) -> dict[str, tuple]:
    shapes = {name: (*lead, cfg.hidden_size)}
    if cfg.norm.kind == "layer":
        shapes[name + "_b"] = (*lead, cfg.hidden_size)
    return shapes


def ffn_shapes(cfg: DecoderConfig, dense: bool) -> dict[str, tuple[int, ...]]:
    """The dense MLP's (or the MoE's) fields, stacked over the layers that have them."""
    n = sum(end - start for start, end, is_moe in cfg.segments if is_moe != dense)
    if n == 0:
        return {}
    if not dense:
        return {k: (n, *v) for k, v in moe_weight_shapes(cfg.moe, cfg.hidden_size).items()}
    h, f = cfg.hidden_size, cfg.intermediate_size
    shapes = {"w_up": (n, h, f), "w_down": (n, f, h)}
    if cfg.gated_mlp:
        shapes["w_gate"] = (n, h, f)
    if cfg.mlp_bias:
        shapes |= {"b_up": (n, f), "b_down": (n, h)}
    return shapes


def load(
    cfg: DecoderConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype: jnp.dtype,
    num_tensors: int | None = None,
    *,
    rules: Sequence[WeightRule],
) -> dict[str, Any]:
    """Checkpoint tensors (HF names, mapped by ``rules``) -> the weight pytree ``forward`` takes."""
    shapes = weight_shapes(cfg)
    moe_fields = ffn_shapes(cfg, dense=False)
    first_layer = dict.fromkeys(moe_fields, cfg.first_moe_layer)
    # int8 quantizes float weights on the device (``device`` below): packed ones come dequantized.
    packing = Packing(
        fields=frozenset() if cfg.quantization == "int8" else PACKED_FIELDS & shapes.keys(),
        quantize=packer(cfg.quantization) if cfg.quantization in ISQ_TYPES else None,
    )
    head: dict[str, HostPacked] = {}
    tensors = _keep_packed_head(cfg, tensors, rules, head)
    host = load_host_weights(shapes, rules, tensors, dtype, num_tensors, first_layer, packing)
    dense_fields = ffn_shapes(cfg, dense=True)
    segment_fields = [
        (moe_fields if is_moe else dense_fields).keys() for _, _, is_moe in cfg.segments
    ]
    weights: dict[str, Any] = {"segments": tuple({} for _ in cfg.segments)}

    # Each host array is dropped once it is on the device, so host memory peaks near one copy.
    def device(name: str, array: np.ndarray | HostPacked) -> Any:
        if isinstance(array, HostPacked):
            return array.to_device(cfg.operand_dtype)
        if cfg.quantization == "int8" and name in _QUANTIZED_FIELDS:
            return quantize_int8(array, cfg.operand_dtype)
        return jnp.asarray(array)

    def place(name: str, array: np.ndarray | HostPacked) -> dict[str, Any]:
        offload = cfg.moe.offload if cfg.moe is not None else None
        if offload is None or name not in EXPERT_FIELDS:
            return {name: device(name, array)}
        # Offloaded experts go straight to pinned host memory, never through the device's.
        resident, offloaded = split_stack(offload, cfg.moe.num_experts, array)
        host = to_host_memory(offloaded, cfg.operand_dtype)
        return {name: device(name, resident), name + HOST_SUFFIX: host}

    for name in list(host):
        array = host.pop(name)
        if name in _GLOBAL_FIELDS:
            weights[name] = device(name, array)
            continue
        for (start, end, _), seg, own in zip(
            cfg.segments, weights["segments"], segment_fields, strict=True
        ):
            if name in own:
                seg.update(place(name, array))
            elif name not in dense_fields and name not in moe_fields:
                seg[name] = device(name, array[start:end])
    return weights | {name: packed.to_device() for name, packed in head.items()}


def _keep_packed_head(
    cfg: DecoderConfig,
    tensors: Iterable[tuple[str, np.ndarray | HostPacked]],
    rules: Sequence[WeightRule],
    head: dict[str, HostPacked],
) -> Iterator[tuple[str, np.ndarray | HostPacked]]:
    """``tensors`` unchanged; where native kernels run, the checkpoint's LM head (or tied
    embedding) is also kept in ``head["lm_head"]`` when it comes packed, and replaces the float
    head the loader makes of it: the native kernel reads it in its own type, a quarter or less
    of the float32 bytes that a decode step otherwise reads whole (a tied embedding also stays
    float, for the lookups)."""
    # A packed head the kernel does not take is dequantized whole on every step: it stays
    # packed only where the kernel was measured faster for the head's calls of one row and more,
    # or, for a tied embedding (whose float copy stays anyway), faster for one row: lone rows
    # then read it packed and batches the float copy (``lm_head``).
    if not (cfg.native_kernels and _packed_head_for(cfg, rows=1) and native_dequant.available()):
        yield from tensors
        return
    source = "embed" if cfg.tie_word_embeddings else "lm_head"
    for key, value in tensors:
        if isinstance(value, HostPacked) and value.codes.ndim == 2:
            rule = next((r for r in rules if r.match(key)), None)
            if rule is not None and rule.fields == (source,):
                head["lm_head"] = value  # [hidden, vocab]: GGUF rows are output channels
        yield key, value


def _packed_head_for(cfg: DecoderConfig, rows: int) -> bool:
    """Whether the packed LM head takes a call of ``rows`` rows (``dequant_matmul.packed_head``)."""
    return packed_head(rows, cfg.tie_word_embeddings, cfg.operand_dtype == "int8")


def layer_meta(cfg: DecoderConfig, start: int, end: int) -> LayerMeta:
    """Stacked per-layer facts for layers ``start:end``."""
    sliding = np.asarray(cfg.sliding_layers or (False,) * cfg.num_layers)[start:end]
    window = getattr(cfg.attention, "sliding_window", None) or FULL_WINDOW
    return LayerMeta(
        index=jnp.arange(start, end, dtype=jnp.int32),
        window=jnp.asarray(np.where(sliding, window, FULL_WINDOW), jnp.int32),
        local=jnp.asarray(sliding),
    )


def _norm(cfg: DecoderConfig, x: jax.Array, w: dict, name: str) -> jax.Array:
    return apply_norm(cfg.norm, x, w[name], w.get(name + "_b"))


def block(
    cfg: DecoderConfig, x: jax.Array, lw: dict, attend: Callable, ffn: Callable
) -> tuple[jax.Array, Any]:
    """One layer around ``attend(h) -> (attention output, state)`` and ``ffn(h) -> MLP output``;
    returns the new residual stream and attend's state (the updated cache, or None)."""
    h = _norm(cfg, x, lw, "attn_norm")
    attn, state = attend(h)
    if cfg.parallel_residual:
        return x + attn + ffn(h), state
    if cfg.sandwich_norms:
        attn = _norm(cfg, attn, lw, "attn_post_norm")
    x = x + attn
    out = ffn(_norm(cfg, x, lw, "mlp_norm"))
    if cfg.sandwich_norms:
        out = _norm(cfg, out, lw, "mlp_post_norm")
    return x + out, state


def feed_forward(
    cfg: DecoderConfig,
    lw: dict,
    is_moe: bool,
    valid: jax.Array,  # [num_seqs, q_len] bool: real tokens, not padding
) -> Callable:
    """The layer's MLP (or MoE) as a function of its normed input."""
    if is_moe:
        return lambda h: moe_mlp(cfg.moe, h, lw, valid)
    return lambda h: dense_mlp(h, lw, cfg.activation, cfg.gated_mlp)


def embed(cfg: DecoderConfig, weights: dict[str, Any], tokens: jax.Array) -> jax.Array:
    x = weights["embed"][tokens]  # [num_seqs, q_len, hidden]
    if cfg.embed_scale is not None:
        # HF rounds the scale to the activation dtype before multiplying.
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    return x


def _scanned(cfg: DecoderConfig, seg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A segment's fields as (stacked projections the native kernel reads in place, fields the
    layer scan slices). XLA copies each layer's slice of a custom call's operand, so where
    native kernels may run the packed ``[layers, in, out]`` projections stay whole and each
    layer sees them as ``PackedLayer``s (expert stacks have more axes and are sliced)."""
    if not cfg.native_kernels:
        return {}, seg
    whole = {
        name: w for name, w in seg.items() if isinstance(w, PackedWeight) and w.planes[0].ndim == 3
    }
    return whole, {name: w for name, w in seg.items() if name not in whole}


def _with_layers(lw: dict[str, Any], whole: dict[str, Any], index: jax.Array) -> dict[str, Any]:
    """A layer's sliced fields plus its ``PackedLayer`` of each whole stack."""
    return lw | {name: PackedLayer(w, index) for name, w in whole.items()}


def forward(
    cfg: DecoderConfig, weights: dict[str, Any], cache: KVCache, batch: StepBatch
) -> tuple[jax.Array, KVCache]:  # logits [num_seqs, vocab] float32
    """Run the new tokens through all layers; return logits at each sequence's last new token."""
    x = embed(cfg, weights, batch.tokens)
    valid = jnp.arange(x.shape[1]) < batch.q_lens[:, None]  # [num_seqs, q_len]

    for (start, end, is_moe), seg in zip(cfg.segments, weights["segments"], strict=True):
        whole, sliced = _scanned(cfg, seg)

        def layer_step(
            carry: tuple[jax.Array, KVCache],
            xs: tuple[dict, LayerMeta],
            is_moe=is_moe,
            whole=whole,
            start=start,
        ):
            x, cache = carry
            lw, meta = xs
            lw = _with_layers(lw, whole, meta.index - start)

            def attend(h: jax.Array) -> tuple[jax.Array, KVCache]:
                if isinstance(cfg.attention, MLAConfig):
                    return paged_mla(cfg.attention, h, lw, cache, meta.index, batch)
                return paged_self_attention(
                    cfg.attention, h, lw, cache, meta, batch, native=cfg.native_kernels
                )

            return block(cfg, x, lw, attend, feed_forward(cfg, lw, is_moe, valid)), None

        (x, cache), _ = jax.lax.scan(layer_step, (x, cache), (sliced, layer_meta(cfg, start, end)))
    last = jnp.maximum(batch.q_lens - 1, 0)
    h = x[jnp.arange(x.shape[0]), last]  # [num_seqs, hidden]
    return lm_head(cfg, weights, final_norm(cfg, weights, h)), cache


def final_norm(cfg: DecoderConfig, weights: dict[str, Any], h: jax.Array) -> jax.Array:
    return apply_norm(cfg.norm, h, weights["final_norm"], weights.get("final_norm_b"))


def lm_head(
    cfg: DecoderConfig,
    weights: dict[str, Any],
    h: jax.Array,  # [..., hidden], final-normed
) -> jax.Array:  # [..., vocab] float32
    """Logits from final-normed hidden states (the tied embedding when there is no LM head).

    A packed ``lm_head`` (a quantized checkpoint's, kept where native kernels run: see
    ``load``) goes to the native kernel, except batches where the float copy of a tied
    embedding was measured faster (``_packed_head_for``)."""
    head = weights.get("lm_head")
    bias = weights["lm_head_b"] if cfg.lm_head_bias else None
    rows = h.size // h.shape[-1]
    if isinstance(head, PackedWeight) and (
        not cfg.tie_word_embeddings or _packed_head_for(cfg, rows)
    ):
        int8 = int8_operands(h, cfg.operand_dtype)
        logits = dequant_matmul(h, head, native=True, int8_activations=int8)
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
    elif cfg.tie_word_embeddings:
        logits = jnp.einsum(
            "...h,vh->...v", h, weights["embed"], preferred_element_type=jnp.float32
        )
    else:
        logits = linear(h, head, bias, out_dtype=jnp.float32)
    if cfg.final_soft_cap is not None:
        logits = cfg.final_soft_cap * jnp.tanh(logits / cfg.final_soft_cap)
    return logits


def hidden_states(
    cfg: DecoderConfig,
    weights: dict[str, Any],
    tokens: jax.Array,  # [num_seqs, seq_len] int32
    positions: jax.Array,  # [num_seqs, seq_len] int32
    lengths: jax.Array,  # [num_seqs] int32, valid tokens per sequence
) -> jax.Array:  # [num_seqs, seq_len, hidden] float32
    """The final-normed hidden state of every position, without the KV cache (embeddings).

    Attention is plain causal attention within each sequence's first ``lengths`` tokens; rows
    past a sequence's length are padding and hold garbage.
    """
    x = embed(cfg, weights, tokens)
    valid = jnp.arange(x.shape[1]) < lengths[:, None]  # [num_seqs, seq_len]

    for (start, end, is_moe), seg in zip(cfg.segments, weights["segments"], strict=True):
        whole, sliced = _scanned(cfg, seg)

        def layer_step(
            x: jax.Array, xs: tuple[dict, LayerMeta], is_moe=is_moe, whole=whole, start=start
        ):
            lw, meta = xs
            lw = _with_layers(lw, whole, meta.index - start)

            def attend(h: jax.Array) -> tuple[jax.Array, None]:
                if isinstance(cfg.attention, MLAConfig):
                    return mla_causal(cfg.attention, h, lw, positions, lengths), None
                return causal_self_attention(cfg.attention, h, lw, positions, lengths, meta), None

            x, _ = block(cfg, x, lw, attend, feed_forward(cfg, lw, is_moe, valid))
            return x, None

        x, _ = jax.lax.scan(layer_step, x, (sliced, layer_meta(cfg, start, end)))
    return final_norm(cfg, weights, x).astype(jnp.float32)
