"""One decoder layer (norms, attention, feed-forward block) and the segments of alike layers
that a ``Decoder`` (``models.decoder``) scans: a ``Segment`` declares one ``DecoderLayer``
whose parameters lead with its layer axis, and runs it under ``lax.scan``, merging the layer
module from each layer's slice of its state."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.layers.attention import FULL_WINDOW, Attention, LayerMeta
from jax_llm_runtime.models.layers.linear import projection
from jax_llm_runtime.models.layers.linear_attention import GatedDeltaNet, HybridCache
from jax_llm_runtime.models.layers.mla import MLA, MLAConfig
from jax_llm_runtime.models.layers.mlp import ACTIVATIONS, MLP
from jax_llm_runtime.models.layers.moe import MoE
from jax_llm_runtime.models.layers.norms import Norm
from jax_llm_runtime.models.layers.params import (
    EMBED,
    NORM,
    PER_LAYER,
    PerLayer,
    declare,
    layer_axes,
)
from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedLayer, PackedWeight
from jax_llm_runtime.pallas_kernels.paged_attention import KVCache

if TYPE_CHECKING:
    from jax_llm_runtime.models.decoder import DecoderConfig


def layer_meta(cfg: DecoderConfig, start: int, end: int) -> LayerMeta:
    """Stacked per-layer facts for layers ``start:end``. A layer's index is its slot in its
    cache (``DecoderConfig.kv_slots``)."""
    sliding = np.asarray(cfg.sliding_layers or (False,) * cfg.num_layers)[start:end]
    window = getattr(cfg.attention, "sliding_window", None) or FULL_WINDOW
    chunked = np.asarray(cfg.chunked_layers or (False,) * cfg.num_layers)[start:end]
    chunk = getattr(cfg.attention, "attention_chunk", None) or FULL_WINDOW
    rotates = None if not cfg.nope_layers else ~np.asarray(cfg.nope_layers)[start:end]
    slots = cfg.kv_slots()[start:end]
    return LayerMeta(
        index=jnp.asarray(slots, jnp.int32),
        window=jnp.asarray(np.where(sliding, window, FULL_WINDOW), jnp.int32),
        local=jnp.asarray(sliding),
        chunk=jnp.asarray(np.where(chunked, chunk, FULL_WINDOW), jnp.int32)
        if cfg.chunked_layers
        else None,
        rotates=None if rotates is None else jnp.asarray(rotates),
        shared_row=jnp.asarray(shared_rows(cfg)[start:end], jnp.int32) if cfg.kv_sources else None,
    )


def shared_rows(cfg: DecoderConfig) -> list[int]:
    """Each layer's row in the cache-free path's buffer of shared K/V (``LayerMeta.shared_row``):
    the sources that some layer reuses get rows in layer order."""
    sources = sorted({s for i, s in enumerate(cfg.kv_sources) if s != i})
    return [sources.index(s) if s in sources else -1 for s in cfg.kv_sources]


class DecoderLayer(nnx.Module):
    """One layer's (or a stack of ``lead`` layers') norms, attention and feed-forward block."""

    def __init__(
        self,
        cfg: DecoderConfig,
        lead: tuple[int, ...],
        is_moe: bool,
        dtype: jnp.dtype,
        quantized: Collection[str] = (),
        is_linear: bool = False,
        first: int = 0,
    ) -> None:
        """Layers like layer ``first`` of the model (its attention kind and MLP width)."""
        h = cfg.hidden_size
        self.parallel_residual = cfg.parallel_residual

        def norm(name: str) -> Norm:
            return Norm(cfg.norm, (*lead, h), (*layer_axes(lead), EMBED), dtype, name)

        self.attn_norm = norm("attn_norm")
        if is_linear:
            self.attn = GatedDeltaNet(cfg.linear_attention, lead, h, dtype, quantized)
        elif isinstance(cfg.attention, MLAConfig):
            self.attn = MLA(cfg.attention, lead, h, dtype, quantized)
        else:
            reuses = cfg.reuses_kv(first)
            self.attn = Attention(cfg.attention, lead, h, dtype, quantized, reuses_kv=reuses)
        self.mlp_norm = None if cfg.parallel_residual else norm("mlp_norm")
        self.attn_post_norm = norm("attn_post_norm") if cfg.sandwich_norms else None
        self.mlp_post_norm = norm("mlp_post_norm") if cfg.sandwich_norms else None
        # Gemma 4 scales each layer's output (residual included) by a scalar of its own.
        scalar = (*lead, 1), dtype, (*layer_axes(lead), NORM), "layer_scalar"
        self.layer_scalar = declare(*scalar) if cfg.layer_scalar else None
        # Gemma 4: a MoE layer runs the dense MLP and the experts side by side, each with norms
        # of its own; the router reads the residual stream.
        beside = is_moe and cfg.moe_beside_mlp
        self.moe = MoE(cfg.moe, lead, h, dtype, quantized) if beside else None
        self.mlp_post_norm_1 = norm("mlp_post_norm_1") if beside else None
        self.moe_norm = norm("moe_norm") if beside else None
        self.moe_post_norm = norm("moe_post_norm") if beside else None
        if is_moe and not beside:
            self.ffn = MoE(cfg.moe, lead, h, dtype, quantized)
        else:
            self.ffn = MLP(
                lead, h, cfg.intermediate_size_of(first), dtype, cfg.activation, cfg.gated_mlp,
                cfg.mlp_bias, quantized,
            )  # fmt: skip
        # Gemma 4's per-layer embeddings: the layer's output gates its per-layer input, which is
        # projected back to the residual stream, normed and added.
        width, self.activation = cfg.per_layer_input_size, cfg.activation
        ple = (h, width), (EMBED, PER_LAYER), (width, h), (PER_LAYER, EMBED)
        self.ple_gate = projection(lead, *ple[:2], dtype, "ple_gate") if width else None
        self.ple_out = projection(lead, *ple[2:], dtype, "ple_out") if width else None
        self.ple_post_norm = norm("ple_post_norm") if width else None

    def __call__(
        self,
        x: jax.Array,  # [num_seqs, q_len, hidden]
        attend: Callable[[jax.Array], tuple[jax.Array, Any]],
        valid: jax.Array,  # [num_seqs, q_len] bool: real tokens, not padding
        per_layer_input: jax.Array | None = None,  # [num_seqs, q_len, width]
    ) -> tuple[jax.Array, Any]:
        """The layer around ``attend(h) -> (attention output, state)``; returns the new residual
        stream and attend's state (the updated cache, or None)."""
        h = self.attn_norm(x)
        attn, state = attend(h)
        if self.parallel_residual:
            return self._scaled(x + attn + self._ffn(h, valid, x), per_layer_input), state
        if self.attn_post_norm is not None:
            attn = self.attn_post_norm(attn)
        x = x + attn
        out = self._ffn(self.mlp_norm(x), valid, x)
        if self.mlp_post_norm is not None:
            out = self.mlp_post_norm(out)
        return self._scaled(x + out, per_layer_input), state

    def _scaled(self, x: jax.Array, per_layer_input: jax.Array | None) -> jax.Array:
        """The layer's output: with per-layer inputs, plus the input gated by the output and
        projected back; times the layer's scalar where it has one."""
        if self.ple_gate is not None:
            gated = ACTIVATIONS[self.activation](self.ple_gate(x)) * per_layer_input
            x = x + self.ple_post_norm(self.ple_out(gated))
        if self.layer_scalar is None:
            return x
        return x * self.layer_scalar.get_value().astype(x.dtype)

    def _ffn(self, h: jax.Array, valid: jax.Array, residual: jax.Array) -> jax.Array:
        if self.moe is not None:
            dense = self.mlp_post_norm_1(self.ffn(h))
            experts = self.moe(self.moe_norm(residual), valid, router_x=residual)
            return dense + self.moe_post_norm(experts)
        return self.ffn(h, valid) if isinstance(self.ffn, MoE) else self.ffn(h)

    def paged(
        self,
        x: jax.Array,  # [num_tokens, hidden]
        cache: KVCache | HybridCache,
        meta: LayerMeta,
        batch: StepBatch,
        valid: jax.Array,  # [num_tokens] bool
        native: bool,
    ) -> tuple[jax.Array, KVCache | HybridCache]:
        """The layer over the paged cache (its new K/V written first), or, for a linear-attention
        layer, over its sequences' state slots (``HybridCache``)."""

        def attend(h: jax.Array) -> tuple[jax.Array, KVCache | HybridCache]:
            if isinstance(self.attn, GatedDeltaNet):
                return self.attn(h, cache, meta.index, batch)
            kv = cache.kv if isinstance(cache, HybridCache) else cache
            if isinstance(self.attn, MLA):
                out, kv = self.attn(h, kv, meta.index, batch)
            else:
                out, kv = self.attn(h, kv, meta, batch, native)
            return out, cache.replace(kv=kv) if isinstance(cache, HybridCache) else kv

        return self(x, attend, valid, meta.per_layer_input)

    def causal(
        self,
        x: jax.Array,  # [num_seqs, seq_len, hidden]
        positions: jax.Array,  # [num_seqs, seq_len] int32
        lengths: jax.Array,  # [num_seqs] int32
        meta: LayerMeta,
        valid: jax.Array,  # [num_seqs, seq_len] bool
        shared: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """The layer without the cache: causal attention within each sequence. ``shared`` is the
        buffer of K/V that layers reuse (``models.layers.attention.causal_self_attention``),
        returned updated; None when no layer reuses another's."""

        def attend(h: jax.Array) -> tuple[jax.Array, Any]:
            if isinstance(self.attn, GatedDeltaNet):
                return self.attn.causal(h, lengths), shared
            if isinstance(self.attn, MLA):
                return self.attn.causal(h, positions, lengths), shared
            return self.attn.causal(h, positions, lengths, meta, shared)

        return self(x, attend, valid, meta.per_layer_input)


class Segment(nnx.Module):
    """Layers ``start:end``, alike: one ``DecoderLayer`` with stacked parameters, scanned."""

    def __init__(
        self,
        cfg: DecoderConfig,
        start: int,
        end: int,
        is_moe: bool,
        dtype: jnp.dtype,
        quantized: Collection[str] = (),
    ) -> None:
        self.start, self.end = start, end
        is_linear = bool(cfg.linear_layers) and cfg.linear_layers[start]
        lead = (end - start,)
        self.layers = DecoderLayer(cfg, lead, is_moe, dtype, quantized, is_linear, first=start)

    def scan(
        self,
        cfg: DecoderConfig,
        step: Callable[[DecoderLayer, Any, LayerMeta], Any],
        carry: Any,
        per_layer_inputs: jax.Array | None = None,  # [num_layers, ..., width], all the model's
    ) -> Any:
        """``carry = step(layer, carry, meta)`` for each layer in order, under ``lax.scan``;
        each layer's meta carries its slice of ``per_layer_inputs`` when given.

        XLA copies each layer's slice of a custom call's operand, so where native kernels may
        run (``cfg.native_kernels``) the packed ``[layers, in, out]`` projections stay whole and
        each layer sees them as ``PackedLayer``s (expert stacks have more axes and are sliced).
        Where ``cfg.unroll_layers`` says (``--layer-loop unrolled``) the layers are walked by a
        Python loop instead: each layer's values are its own arrays where the state holds them
        per layer (``PerLayer``), else static slices of the stacks.
        """
        graphdef, whole, sliced = nnx.split(self.layers, _whole_stack(cfg.native_kernels), ...)

        def body(carry: Any, xs: tuple[nnx.State, LayerMeta]) -> tuple[Any, None]:
            state, meta = xs
            index = meta.index - self.start
            own = jax.tree.map(
                lambda v: v.replace(PackedLayer(v.get_value(), index)),
                whole,
                is_leaf=lambda v: isinstance(v, nnx.Variable),
            )
            return step(nnx.merge(graphdef, state, own), carry, meta), None

        meta = layer_meta(cfg, self.start, self.end)
        if per_layer_inputs is not None:
            meta = meta.replace(per_layer_input=per_layer_inputs[self.start : self.end])
        if not cfg.unroll_layers:  # None (auto): the scan
            carry, _ = jax.lax.scan(body, carry, (sliced, meta))
            return carry
        for i in range(self.end - self.start):
            layer = jax.tree.map(
                lambda v, i=i: v.replace(_layer_value(v.get_value(), i)),
                sliced,
                is_leaf=lambda v: isinstance(v, nnx.Variable),
            )
            carry, _ = body(carry, (layer, jax.tree.map(lambda a, i=i: a[i], meta)))
        return carry


def _layer_value(value: Any, i: int) -> Any:
    """Layer ``i``'s value of a stacked parameter: its own array where the weights are held
    per layer (``PerLayer``), else a static slice of the stack."""
    if isinstance(value, PerLayer):
        return value.layers[i]
    return jax.tree.map(lambda a: a[i], value)


def _whole_stack(native: bool) -> Callable[[tuple, Any], bool]:
    """The filter of the parameters a layer scan keeps whole: packed ``[layers, in, out]``
    projections, where native kernels may run."""

    def whole(path: tuple, var: Any) -> bool:
        value = var.get_value()
        return native and isinstance(value, PackedWeight) and value.planes[0].ndim == 3

    return whole
