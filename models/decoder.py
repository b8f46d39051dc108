"""The decoder-only transformer that every architecture here is a configuration of, as
``flax.nnx`` modules.

A layer (``DecoderLayer``) is: norm -> attention -> (post-norm) -> residual, then norm -> MLP or
MoE -> (post-norm) -> residual; or, with ``parallel_residual`` (Phi-2, StableLM),
x + attn(norm(x)) + mlp(norm(x)). What differs between architectures is data in
``DecoderConfig`` (norm kind, activation, biases, sandwich norms, sliding layers, soft-caps,
embedding scale) and a table of checkpoint-name rules; the architecture files (``models.families``: ``llama.py``,
``gemma.py``, ...) hold only those translations.

Each weight is declared once, by the module of its layer kind (``models.layers``: ``Embed``,
``Norm``, ``Linear``/``QuantizedLinear``, ``Attention`` or ``MLA``, ``MLP`` or ``MoE`` with its
``ExpertLinear`` stacks), with its shape, dtype, logical sharding axes and checkpoint field
(``models.layers.params``).
Layers are stacked: a ``Segment`` declares one ``DecoderLayer`` whose parameters lead with the
segment's layer axis, and runs it under ``lax.scan`` (``models.layers.decoder_layer``). A model
whose layers are not all alike (DeepSeek's dense layers before its MoE layers, Llama 4
Maverick's alternating ones) has several segments, one per run of alike layers, each scanned on
its own.

The engine holds the model split (``models.state.ModelWeights``: the static graph definition
and the state of arrays); ``forward``, ``hidden_states`` and ``lm_head`` are the pure functions
it jits over that state.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.isq import ISQ_TYPES
from jax_llm_runtime.models.layers.attention import AttentionConfig, LayerMeta
from jax_llm_runtime.models.layers.decoder_layer import DecoderLayer, Segment, shared_rows
from jax_llm_runtime.models.layers.embed import Embed, PerLayerInputs
from jax_llm_runtime.models.layers.linear import OPERAND_DTYPES, int8_operands, projection
from jax_llm_runtime.models.layers.linear_attention import (
    LINEAR_ATTENTION_QUANTIZED,
    LinearAttentionConfig,
)
from jax_llm_runtime.models.layers.mla import MLAConfig, mla_cache_shapes
from jax_llm_runtime.models.layers.mlp import check_activation
from jax_llm_runtime.models.layers.moe import MoEConfig
from jax_llm_runtime.models.layers.norms import Norm, NormConfig
from jax_llm_runtime.models.layers.params import (
    EMBED,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    VOCAB,
)
from jax_llm_runtime.models.state import ModelWeights
from jax_llm_runtime.pallas_kernels.dequant_matmul import (
    PackedWeight,
    dequant_matmul,
    packed_head,
)
from jax_llm_runtime.pallas_kernels.paged_attention import KVCache, kv_cache_shape


@dataclass(frozen=True)
class DecoderConfig:
    """Static description of one model. ``sliding_layers`` is empty (no layer slides) or one flag
    per layer; sliding layers use ``attention.sliding_window`` and, when set,
    ``attention.local_rope``. ``attention`` is multi-head latent attention (DeepSeek) when it is
    an ``MLAConfig``. With ``moe``, layers from ``first_moe_layer`` on (or, when set, the layers
    flagged in ``moe_layers``, which may alternate with dense ones: Llama 4 Maverick) replace
    the MLP with mixture-of-experts; the others keep the dense MLP of ``intermediate_size``.
    Layers flagged in ``linear_layers`` replace attention with ``linear_attention`` (Gated
    DeltaNet: a state slot per sequence instead of K/V pages; Qwen3-Next, Qwen3.5); the KV
    cache then holds only the other layers. A layer whose ``kv_sources`` entry is an earlier
    layer attends to that layer's K/V and has neither K/V projections nor a cache slot of its own
    (Gemma 4's KV sharing). With ``per_layer_input_size``, each layer also reads an input of its
    own derived from the token and its embedding (Gemma 4's per-layer embeddings:
    ``models.layers.embed.PerLayerInputs``)."""

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
    layer_scalar: bool = False  # each layer's output scaled by its ``layer_scalar`` (Gemma 4)
    # One flag per layer, or empty for none (Llama 4): layers that attend within chunks of
    # ``attention.attention_chunk`` positions, and layers without rope.
    chunked_layers: tuple[bool, ...] = ()
    nope_layers: tuple[bool, ...] = ()
    sliding_layers: tuple[bool, ...] = ()
    moe: MoEConfig | None = None
    first_moe_layer: int = 0
    moe_layers: tuple[bool, ...] = ()
    moe_beside_mlp: bool = False  # MoE layers keep the dense MLP too, beside the experts (Gemma 4)
    linear_attention: LinearAttentionConfig | None = None
    linear_layers: tuple[bool, ...] = ()
    # One index per layer, or empty (each its own): the layer whose K/V each layer attends to.
    kv_sources: tuple[int, ...] = ()
    # One MLP width per layer, or empty (``intermediate_size`` everywhere): Gemma 4's KV-sharing
    # layers may have MLPs twice as wide (``use_double_wide_mlp``).
    layer_intermediate_sizes: tuple[int, ...] = ()
    per_layer_input_size: int = 0  # width of each layer's per-layer input (0: none)
    per_layer_vocab_size: int = 0  # rows of the per-layer embedding table
    # The per-layer embedding table's dtype (None: the run dtype). Gemma 4 E2B's table is
    # 262,144 x 8,960: 9.4 GB in float32, so a bfloat16 checkpoint served in float32 keeps it
    # in bfloat16, exactly (``runtime.loading.builder.per_layer_table_dtype``).
    per_layer_dtype: str | None = None
    quantization: str | None = None  # "int8": weight-only int8 for the projections (see linear)
    operand_dtype: str | None = None  # quantized projections' operands (see models.layers.linear)
    # The step runs on XLA:CPU and is not split over a device mesh, so native CPU kernels
    # (``pallas_kernels.native``: custom calls, which XLA's partitioner does not split) may
    # replace XLA formulations where one is built; set by ``runtime.loading.builder``.
    native_kernels: bool = False
    # Layers walked by an unrolled loop instead of ``lax.scan`` (``--layer-loop``); ``None``
    # (auto) is the scan on every backend. On GPU a scanned step copies each layer's slice of
    # every stacked weight before its matmul (XLA materializes the dynamic slice), reading the
    # weights twice. Unrolled over static slices of the stacks, at 64 sequences the matmuls read
    # the stack in place, but at one row XLA still copied whole stacks out; so an engine that
    # walks the layers unrolled holds one array per layer (``ModelWeights.per_layer``), with no
    # slice left to copy. But an unrolled step compiles as many layer bodies as the model has: an
    # engine on an H200 did not finish compiling the first of its five step shapes of a
    # 30-layer model in 190 s, where the scanned engine had started in under a minute; on
    # XLA:CPU the same engine compiled in 4x the scan's time (BENCHMARKS.md, "Accelerator
    # check: third run"). On CPU the scan is also the faster step.
    unroll_layers: bool | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_activation(self.activation)
        if self.moe_layers and self.moe is None:
            raise ValueError("moe_layers needs a moe config")
        self._check_linear_layers()
        names = (
            "sliding_layers", "chunked_layers", "nope_layers", "moe_layers", "linear_layers",
            "kv_sources", "layer_intermediate_sizes",
        )  # fmt: skip
        for name in names:
            flags = getattr(self, name)
            if flags and len(flags) != self.num_layers:
                raise ValueError(f"{len(flags)} {name} flags for {self.num_layers} layers")
        self._check_kv_sources()
        if any(self.chunked_layers) and getattr(self.attention, "attention_chunk", None) is None:
            raise ValueError("chunked layers need an attention_chunk")
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

    def _check_linear_layers(self) -> None:
        if any(self.linear_layers) and self.linear_attention is None:
            raise ValueError("linear_layers need a linear_attention config")
        if self.linear_layers and all(self.linear_layers):
            raise ValueError("a model needs at least one full-attention layer")

    def _check_kv_sources(self) -> None:
        if not self.kv_sources:
            return
        if isinstance(self.attention, MLAConfig):
            raise ValueError("layers that reuse another layer's K/V need plain attention")
        linear = self.linear_layers or (False,) * self.num_layers
        for i, source in enumerate(self.kv_sources):
            if source == i:
                continue
            if not 0 <= source < i or self.kv_sources[source] != source or linear[source]:
                raise ValueError(
                    f"layer {i} reuses the K/V of layer {source}, which is not an earlier layer "
                    "with K/V of its own"
                )

    def reuses_kv(self, layer: int) -> bool:
        """Whether ``layer`` attends to an earlier layer's K/V (and has none of its own)."""
        return bool(self.kv_sources) and self.kv_sources[layer] != layer

    @property
    def first_reusing_layer(self) -> int | None:
        """The first of the last layers when every one of them reuses an earlier layer's K/V
        (Gemma 4's KV-sharing layers), else None."""
        first = self.num_layers
        while first > 0 and self.reuses_kv(first - 1):
            first -= 1
        return first if first < self.num_layers else None

    def intermediate_size_of(self, layer: int) -> int:
        """The width of ``layer``'s dense MLP."""
        sizes = self.layer_intermediate_sizes
        return sizes[layer] if sizes else self.intermediate_size

    def kv_slots(self) -> tuple[int, ...]:
        """Each layer's slot in its cache: among the layers with K/V pages (a layer that reuses
        another's K/V: its source's), or among the linear-attention layers."""
        linear = self.linear_layers or (False,) * self.num_layers
        slots: list[int] = []
        counts = {True: 0, False: 0}
        for i in range(self.num_layers):
            if self.reuses_kv(i):
                slots.append(slots[self.kv_sources[i]])
                continue
            slots.append(counts[linear[i]])
            counts[linear[i]] += 1
        return tuple(slots)

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
            self.num_kv_layers, num_pages, page_size, self.num_kv_heads, self.head_dim
        )
        return shape, shape

    @property
    def num_kv_layers(self) -> int:
        """Layers with K/V pages (all but the linear-attention layers and those that reuse
        another layer's K/V)."""
        reusing = sum(self.reuses_kv(i) for i in range(self.num_layers))
        return self.num_layers - sum(self.linear_layers) - reusing

    @property
    def num_linear_layers(self) -> int:
        """Layers with a state slot per sequence instead of K/V pages."""
        return sum(self.linear_layers)

    @property
    def segments(self) -> tuple[tuple[int, int, bool], ...]:
        """``(start, end, is_moe)`` runs of alike layers (alike in their feed-forward block, its
        width, and their attention: see ``linear_layers`` and ``kv_sources``), each scanned
        separately."""
        n = self.num_layers
        if self.moe is None:
            flags: tuple[bool, ...] = (False,) * n
        else:
            flags = self.moe_layers or tuple(i >= self.first_moe_layer for i in range(n))
        linear = self.linear_layers or (False,) * n

        def kind(i: int) -> tuple:
            return linear[i], self.reuses_kv(i), self.intermediate_size_of(i)

        runs: list[tuple[int, int, bool]] = []
        for i, is_moe in enumerate(flags):
            if runs and runs[-1][2] == is_moe and kind(i) == kind(i - 1):
                runs[-1] = (runs[-1][0], i + 1, is_moe)
            else:
                runs.append((i, i + 1, is_moe))
        return tuple(runs)


QUANTIZATIONS = (None, "int8", *ISQ_TYPES)
# The weights kept packed when a checkpoint is quantized (or ``--isq`` quantizes): the layers'
# projections and the shared experts', which are ``QuantizedLinear``s then, and the routed
# expert stacks, ``QuantizedExpertLinear``s (gathered or dequantized per layer). Embeddings, the
# LM head (too wide: see models.layers.linear), norms, biases, routers and MLA's kv_b stay in the
# run dtype; a quantized checkpoint's tensors for them are dequantized at load. ``--isq int8``
# covers only the first set.
QUANTIZED_FIELDS = frozenset(
    ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "w_gate", "w_up", "w_down")
).union(("s_gate", "s_up", "s_down"), LINEAR_ATTENTION_QUANTIZED)
PACKED_FIELDS = QUANTIZED_FIELDS.union(("e_gate", "e_up", "e_down"))
# Logical axes of the KV cache's K and V (their row scales: the first four): each device keeps
# the K/V of its own KV heads. MLA's latent cache has one KV "head", which stays whole.
KV_CACHE_AXES = (LAYERS, "pages", "page_size", KV_HEADS, HEAD_DIM)


class Decoder(nnx.Module):
    """The whole model: embeddings, segments of layers, final norm and LM head. ``quantized``
    names the fields whose projections are ``QuantizedLinear``s; ``packed_head`` keeps an LM
    head (a tied embedding's too) packed for the native kernel (``models.checkpoint``)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        dtype: jnp.dtype,
        quantized: Collection[str] = (),
        packed_head: bool = False,
    ) -> None:
        self.cfg, self.dtype = cfg, dtype
        self.quantized, self.packed_head = frozenset(quantized), packed_head
        h = cfg.hidden_size
        self.embed = Embed(cfg.vocab_size, h, dtype, cfg.embed_scale)
        width = cfg.per_layer_input_size
        table = jnp.dtype(cfg.per_layer_dtype or dtype)
        self.per_layer = (
            PerLayerInputs(
                cfg.per_layer_vocab_size, h, cfg.num_layers, width, cfg.norm, dtype, table
            )
            if width
            else None
        )
        self.segments = nnx.List([Segment(cfg, *run, dtype, quantized) for run in cfg.segments])
        self.final_norm = Norm(cfg.norm, (h,), (EMBED,), dtype, "final_norm")
        tied = cfg.tie_word_embeddings
        bias = "lm_head_b" if cfg.lm_head_bias and not tied else None
        head = (h, cfg.vocab_size), (EMBED, VOCAB), dtype, "lm_head", bias
        packed = ("lm_head",) if packed_head else ()
        self.lm_head = projection((), *head, packed) if not tied or packed_head else None

    def declaration(self) -> dict[str, Any]:
        """What declared this model besides its config, as JSON (a prepared checkpoint keeps
        it beside the state: ``declared``)."""
        quantized = sorted(self.quantized)
        return {"dtype": jnp.dtype(self.dtype).name, "quantized": quantized,
                "packed_head": self.packed_head}  # fmt: skip

    @classmethod
    def declared(cls, cfg: DecoderConfig, declaration: dict[str, Any]) -> Decoder:
        """The model of ``cfg`` declared as ``declaration`` says (abstract parameters)."""
        dtype, quantized = jnp.dtype(declaration["dtype"]), frozenset(declaration["quantized"])
        return cls(cfg, dtype, quantized, bool(declaration["packed_head"]))

    def redeclared(self, cfg: DecoderConfig) -> Decoder:
        """The same model declared from ``cfg`` (abstract parameters): ``cfg`` may change run
        settings, not what is declared."""
        return Decoder(cfg, self.dtype, self.quantized, self.packed_head)

    def __call__(
        self, cache: KVCache, batch: StepBatch
    ) -> tuple[jax.Array, KVCache]:  # logits [num_seqs, vocab] float32
        """Run the step's new tokens (a ragged run: ``models.batch``) through all layers;
        logits at each sequence's last new token."""
        cfg = self.cfg
        x = self.embed(batch.tokens)  # [num_tokens, hidden]
        deep = None  # [num_tokens, levels, hidden]: added after each of the first layers
        if batch.embeds is not None:  # image soft tokens replace their placeholders' embeddings
            h = cfg.hidden_size
            rows = batch.embed_rows[:, None]
            x = jnp.where(rows, batch.embeds[:, :h].astype(x.dtype), x)
            if batch.embeds.shape[1] > h:
                deep = batch.embeds[:, h:].reshape(x.shape[0], -1, h)
        valid = batch.valid  # [num_tokens]
        per_layer = None if self.per_layer is None else self.per_layer(batch.tokens, x)

        def step(layer: DecoderLayer, carry: tuple, meta: LayerMeta) -> tuple:
            x, cache = carry
            x, cache = layer.paged(x, cache, meta, batch, valid, cfg.native_kernels)
            if deep is not None:  # deepstack: layer i's output gains level i on image rows
                levels = deep.shape[1]
                level = deep[:, jnp.minimum(meta.index, levels - 1)].astype(x.dtype)
                x = jnp.where(rows & (meta.index < levels), x + level, x)
            return x, cache

        for segment in self.segments:
            if segment.start == cfg.first_reusing_layer and not batch.decode_rows:
                x, per_layer, batch = _last_rows_only(x, per_layer, batch)
                valid = batch.valid
            x, cache = segment.scan(cfg, step, (x, cache), per_layer)
        h = x[batch.last_rows]  # [num_seqs, hidden]
        return self.logits(self.final_norm(h)), cache

    def hidden_states(
        self,
        tokens: jax.Array,  # [num_seqs, seq_len] int32
        positions: jax.Array,  # [num_seqs, seq_len] int32
        lengths: jax.Array,  # [num_seqs] int32
    ) -> jax.Array:  # [num_seqs, seq_len, hidden] float32
        """See ``hidden_states``."""
        cfg = self.cfg
        x = self.embed(tokens)
        valid = jnp.arange(x.shape[1]) < lengths[:, None]  # [num_seqs, seq_len]
        per_layer = None if self.per_layer is None else self.per_layer(tokens, x)
        shared = None  # the K/V of the layers that others reuse (``causal_self_attention``)
        if cfg.kv_sources:
            shape = (max(shared_rows(cfg)) + 1, *tokens.shape, cfg.num_kv_heads, cfg.head_dim)
            shared = (jnp.zeros(shape, x.dtype), jnp.zeros(shape, x.dtype))

        def step(layer: DecoderLayer, carry: tuple, meta: LayerMeta) -> tuple:
            x, shared = carry
            return layer.causal(x, positions, lengths, meta, valid, shared)

        for segment in self.segments:
            x, shared = segment.scan(cfg, step, (x, shared), per_layer)
        return self.final_norm(x).astype(jnp.float32)

    def logits(self, h: jax.Array) -> jax.Array:  # [..., hidden] -> [..., vocab] float32
        """See ``lm_head``."""
        cfg = self.cfg
        head = None if self.lm_head is None else self.lm_head.kernel.get_value()
        rows = h.size // h.shape[-1]
        if isinstance(head, PackedWeight) and (
            not cfg.tie_word_embeddings or packed_head_for(cfg, rows)
        ):
            int8 = int8_operands(h, cfg.operand_dtype)
            logits = dequant_matmul(h, head, native=True, int8_activations=int8)
            if self.lm_head.bias is not None:
                logits = logits + self.lm_head.bias.get_value().astype(jnp.float32)
        elif cfg.tie_word_embeddings:
            logits = self.embed.attend(h)
        else:
            logits = self.lm_head(h, out_dtype=jnp.float32)
        if cfg.final_soft_cap is not None:
            logits = cfg.final_soft_cap * jnp.tanh(logits / cfg.final_soft_cap)
        return logits


def _last_rows_only(
    x: jax.Array,  # [num_tokens, hidden]
    per_layer: jax.Array | None,  # [num_layers, num_tokens, width]
    batch: StepBatch,
) -> tuple[jax.Array, jax.Array | None, StepBatch]:
    """The step narrowed to each sequence's last new row, as a decode step's layout: from the
    first of a model's last layers that reuse earlier layers' K/V on, the other rows feed
    nothing (those layers write no K/V), so a prompt chunk runs them for one row."""
    rows, real = batch.last_rows, batch.q_lens > 0
    seqs = jnp.arange(batch.num_seqs, dtype=jnp.int32)
    q_starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(real, dtype=jnp.int32)])
    narrow = batch.replace(
        tokens=batch.tokens[rows], positions=batch.positions[rows], seq_ids=seqs, valid=real,
        q_starts=q_starts, last_rows=seqs, decode_rows=True, embeds=None, embed_rows=None,
        horizons=None if batch.horizons is None else batch.horizons[rows],
    )  # fmt: skip
    return x[rows], None if per_layer is None else per_layer[:, rows], narrow


def packed_head_for(cfg: DecoderConfig, rows: int) -> bool:
    """Whether the packed LM head takes a call of ``rows`` rows (``dequant_matmul.packed_head``)."""
    return packed_head(rows, cfg.tie_word_embeddings, cfg.operand_dtype == "int8")


def forward(
    cfg: DecoderConfig, weights: ModelWeights, cache: KVCache, batch: StepBatch
) -> tuple[jax.Array, KVCache]:  # logits [num_seqs, vocab] float32
    """Run the new tokens through all layers; return logits at each sequence's last new token.
    ``cfg`` is the config the weights were loaded with, or its run settings changed
    (``native_kernels``)."""
    return weights.model(cfg)(cache, batch)


def hidden_states(
    cfg: DecoderConfig,
    weights: ModelWeights,
    tokens: jax.Array,  # [num_seqs, seq_len] int32
    positions: jax.Array,  # [num_seqs, seq_len] int32
    lengths: jax.Array,  # [num_seqs] int32, valid tokens per sequence
) -> jax.Array:  # [num_seqs, seq_len, hidden] float32
    """The final-normed hidden state of every position, without the KV cache (embeddings).

    Attention is plain causal attention within each sequence's first ``lengths`` tokens; rows
    past a sequence's length are padding and hold garbage.
    """
    return weights.model(cfg).hidden_states(tokens, positions, lengths)


def lm_head(
    cfg: DecoderConfig,
    weights: ModelWeights,
    h: jax.Array,  # [..., hidden], final-normed
) -> jax.Array:  # [..., vocab] float32
    """Logits from final-normed hidden states (the tied embedding when there is no LM head).

    A packed LM head (a quantized checkpoint's, kept where native kernels run: see
    ``models.checkpoint``) goes to the native kernel, except batches where the float copy of a
    tied embedding was measured faster (``packed_head_for``)."""
    return weights.model(cfg).logits(h)
