"""Compose an engine from an ``EngineConfig``: resolve the model, load it, size the cache."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_llm_runtime.models.layers.linear import QuantizedWeight
from jax_llm_runtime.models.layers.linear_attention import HybridCache
from jax_llm_runtime.models.layers.mla import MLAConfig
from jax_llm_runtime.models.registry import ModelSpec, model_config_from_hf
from jax_llm_runtime.pallas_kernels import native
from jax_llm_runtime.pallas_kernels.dequant_matmul import native as native_dequant
from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import PackedWeight
from jax_llm_runtime.pallas_kernels.native import calibration
from jax_llm_runtime.pallas_kernels.paged_attention import FP8, KVCache, kv_cache_bytes
from jax_llm_runtime.pallas_kernels.paged_attention.ops import ragged_implementation
from jax_llm_runtime.pallas_kernels.selection import choose_kernels
from jax_llm_runtime.runtime.config import LAYER_LOOPS, EngineConfig
from jax_llm_runtime.runtime.engine.buckets import BucketPlan
from jax_llm_runtime.runtime.engine.core import Engine
from jax_llm_runtime.runtime.engine.embedder import EmbeddingRunner
from jax_llm_runtime.runtime.engine.image_encoder import ImageEncoder
from jax_llm_runtime.runtime.engine.model_runner import ModelRunner
from jax_llm_runtime.runtime.engine.page_allocator import PageAllocator
from jax_llm_runtime.runtime.engine.scheduler import Scheduler, prefix_cost_positions
from jax_llm_runtime.runtime.loading.cache_size import auto_kvcache_mb
from jax_llm_runtime.runtime.loading.gguf.loader import Checkpoint, load_gguf_checkpoint
from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint
from jax_llm_runtime.runtime.loading.sources import ModelFiles, cache_root, resolve_model_source
from jax_llm_runtime.runtime.loading.vision import (
    LoadedVision,
    VisionTensors,
    image_encoder,
    load_vision,
)
from jax_llm_runtime.runtime.loading.xla_cache import enable_compilation_cache
from jax_llm_runtime.runtime.parallel.data_parallel import DataParallelEngine
from jax_llm_runtime.runtime.parallel.expert_offload_plan import (
    log_expert_offload,
    with_expert_offload,
)
from jax_llm_runtime.runtime.parallel.kv_heads import kv_replicas, replicate_kv_heads
from jax_llm_runtime.runtime.parallel.sharding import (
    build_mesh,
    cache_sharding,
    check_linear_divisible,
    shard_weights,
)
from jax_llm_runtime.runtime.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# Tokens per decode call on CPU when nothing else waits: one dispatch and one host round trip
# for four tokens (BENCHMARKS.md: ~1 ms of host work per call, ~14% of a lone stream's token).
CPU_DECODE_STEPS = 4
# ... while at most this many sequences decode. A bigger batch's step is long enough that the
# host's work per call is a few percent of it (16 streams of SmolLM2: 21 ms), and its streams
# then get every token as it is sampled instead of four at a time: one call of four steps is a
# gap four steps long, which made multi-step decode the 99th percentile of the streams'
# inter-token gaps (BENCHMARKS.md, "Mixed batches").
CPU_MULTI_STEP_SEQS = 4
# What a prompt chunk's attention flop costs on CPU against a projection flop, for the step's
# token budget (scheduler.prefix_cost_positions): a SmolLM2 step of 16 decode rows and a
# 49-token chunk took 2.26x as long after 1,950 positions as from position 0, where counting
# flops alone predicts 1.34x (tools/bench_decode_step.py --mixed 15+49,15+49@1950).
CPU_ATTENTION_FLOP_COST = 4.0


def per_layer_table_dtype(model_config: Any, hf_config: dict[str, Any], dtype: jnp.dtype) -> Any:
    """``model_config`` with the dtype its per-layer embedding table is held in: bfloat16 where
    the checkpoint's dtype is bfloat16 and the run's float32 (the table's values, exactly, in
    half the memory: 4.7 GB less for Gemma 4 E2B), else the run dtype."""
    if not getattr(model_config, "per_layer_input_size", 0):
        return model_config
    text = hf_config.get("text_config") or {}
    source = next(
        (c.get(k) for c in (text, hf_config) for k in ("dtype", "torch_dtype") if c.get(k)), None
    )
    narrow = source == "bfloat16" and jnp.dtype(dtype) == jnp.float32
    return dataclasses.replace(model_config, per_layer_dtype="bfloat16" if narrow else None)


def _log_per_layer_table(model_config: Any, dtype: jnp.dtype) -> None:
    """Gemma 4 E2B/E4B hold a per-layer embedding table as large as the rest of the model; the
    log says what it takes (``models.layers.embed``)."""
    width = getattr(model_config, "per_layer_input_size", 0)
    if width:
        dtype = jnp.dtype(model_config.per_layer_dtype or dtype)
        rows, columns = model_config.per_layer_vocab_size, model_config.num_layers * width
        logger.info(
            "per-layer embedding table: %d x %d in %s, %.2f GB",
            rows, columns, jnp.dtype(dtype).name, rows * columns * jnp.dtype(dtype).itemsize / 1e9,
        )  # fmt: skip


def resolve_dtype(name: str) -> jnp.dtype:
    if name == "auto":
        # XLA:CPU has no fast bf16 matmul path; accelerators prefer bf16.
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    return jnp.dtype(name)


def resolve_kv_cache_dtype(
    name: str, model_dtype: jnp.dtype, int8_activations: bool = False
) -> jnp.dtype:
    """The KV cache's float dtype for ``--kv-cache-dtype`` (``KVCache.dtype``; on CPU a bfloat16
    or float8 one is stored as integers, ``storage_dtype``): a float dtype named, e4m3 with
    scales ("fp8*"), or for "auto" the model dtype, except that a float32 model whose projections
    take int8 activations (``int8_activations``: ``takes_int8_activations``, the native CPU
    kernels' default on x86-64 from AVX2 up and Arm with dotprod) stores float16, as llama.cpp's
    default cache does. There the cache's rounding leaves perplexity unchanged and, the integer
    dots being exact per row, a request's tokens and logprobs still do not depend on its batch;
    it halves the bytes attention reads. With float activations a 16-bit cache's rounding turns
    the float path's ~1e-7 batch-to-batch differences into ~5e-4 in logprobs, so such a model's
    "auto" stays float32 (BENCHMARKS.md)."""
    if name == "auto":
        if int8_activations and jnp.dtype(model_dtype) == jnp.float32:
            return jnp.dtype(jnp.float16)
        return jnp.dtype(model_dtype)
    return FP8 if name.startswith("fp8") else jnp.dtype(name)


def takes_int8_activations(weights: Any) -> bool:
    """Whether the model's quantized projections multiply int8 activations: packed or int8
    weights whose ``operand_dtype`` is "int8" (``--matmul-dtype``; the LM head rounds as the
    layers do and carries none of its own)."""
    kinds = (PackedWeight, QuantizedWeight)
    leaves = jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, kinds))
    return any(isinstance(leaf, kinds) and leaf.operand_dtype == "int8" for leaf in leaves)


def load_checkpoint(files: ModelFiles) -> Checkpoint:
    if files.kind == "gguf":
        return load_gguf_checkpoint(files.path)
    return load_hf_checkpoint(files.path)


def load_tokenizer(files: ModelFiles) -> Tokenizer:
    if files.kind == "gguf":
        return Tokenizer.from_gguf(files.path)
    return Tokenizer.from_pretrained_dir(files.path)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model as ``runtime-serve`` loads it: files, architecture, weights and tokenizer."""

    files: ModelFiles
    spec: ModelSpec
    config: Any  # the architecture's model config, with ``--isq`` applied
    weights: Any
    tokenizer: Tokenizer
    dtype: jnp.dtype  # the run dtype ("auto" resolved)
    # the HF-style config the model config was translated from (a prepared checkpoint keeps it)
    hf_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    vision: LoadedVision | None = None  # a vision-language model's image encoder


def load_model(config: EngineConfig, packed: bool = True) -> LoadedModel:
    """Model and tokenizer from ``config.model_id`` with its ``dtype`` and ``isq``. A checkpoint's
    quantized tensors (GGUF blocks, GPTQ, AWQ) stay packed unless ``packed`` is False, which
    loads them as ``dtype`` floats. A prepared checkpoint is restored as it was prepared
    (``runtime.loading.prepared``)."""
    enable_compilation_cache(cache_root() / "xla")
    if native_kernels_allowed(config.tensor_parallel_size):
        native.prebuild()  # a first start compiles the kernels while the model is fetched and read
    files = resolve_model_source(config.model_id, config.weight_file)
    if files.kind == "prepared":
        # orbax is imported only for prepared checkpoints
        from jax_llm_runtime.runtime.loading.prepared import load_prepared

        return load_prepared(config, files, packed)
    checkpoint = load_checkpoint(files)
    # The architecture is checked before the (slow) tokenizer and weights are read; the
    # tokenizer is read while prebuilt native kernels may still compile (configure_model waits).
    model_config_from_hf(checkpoint.config)
    tokenizer = load_tokenizer(files)
    spec, model_config = configure_model(config, checkpoint.config)
    dtype = resolve_dtype(config.dtype)
    tensors = checkpoint.tensors(packed=packed)
    vision_tensors = VisionTensors(spec) if spec.vision is not None else None
    if vision_tensors is not None:
        tensors = vision_tensors.text_tensors(tensors)
    weights = spec.load(model_config, tensors, dtype, checkpoint.num_tensors)
    _log_per_layer_table(model_config, dtype)
    vision = None
    if vision_tensors is not None:
        folder = files.path if files.kind != "gguf" else None
        vision = load_vision(vision_tensors, checkpoint.config, dtype, folder)
    return LoadedModel(
        files, spec, model_config, weights, tokenizer, dtype, checkpoint.config, vision
    )


def configure_model(config: EngineConfig, hf_config: dict[str, Any]) -> tuple[ModelSpec, Any]:
    """The architecture's spec and model config for an HF-style config dict, with ``config``'s
    ``isq``, expert offload, native kernels and matmul operands applied. Raises ValueError (an
    unsupported architecture, a malformed config)."""
    spec, model_config = model_config_from_hf(hf_config)
    check_linear_divisible(
        getattr(model_config, "linear_attention", None), config.tensor_parallel_size
    )
    if config.isq is not None:
        model_config = dataclasses.replace(model_config, quantization=config.isq)
    model_config = with_expert_offload(model_config, config)
    model_config = with_native_kernels(model_config, config.tensor_parallel_size)
    model_config = dataclasses.replace(
        model_config,
        operand_dtype=operand_dtype(config.matmul_dtype, model_config),
        unroll_layers=LAYER_LOOPS[config.layer_loop],
    )
    model_config = per_layer_table_dtype(model_config, hf_config, resolve_dtype(config.dtype))
    if model_config.unroll_layers:
        logger.info(
            "layers walked unrolled (--layer-loop unrolled), one array per layer: each "
            "compiles on its own"
        )
    return spec, model_config


def build_engine(config: EngineConfig) -> Engine | DataParallelEngine:
    """Everything from the model id to a ready-to-start engine (``start()`` compiles): one
    engine, or with ``data_parallel_size`` above 1 one per replica behind a
    ``DataParallelEngine`` (the checkpoint is read once)."""
    model = load_model(config)
    if config.data_parallel_size == 1:
        return _build_replica(config, model, config.devices)
    if jax.process_count() > 1:
        raise ValueError("--data-parallel-size with --num-nodes is not supported yet")
    size = config.tensor_parallel_size
    devices = list(config.devices or range(size * config.data_parallel_size))
    groups = [devices[i : i + size] for i in range(0, len(devices), size)]
    replicas = [_build_replica(config, model, group) for group in groups]
    logger.info("%d data-parallel replicas on devices %s", len(replicas), groups)
    return DataParallelEngine(replicas)


def _build_replica(
    config: EngineConfig, model: LoadedModel, devices: Sequence[int] | None
) -> Engine:
    """One engine on ``devices`` (its tensor-parallel mesh) with its own KV cache."""
    spec, model_config = model.spec, model.config
    weights, tokenizer, dtype = model.weights, model.tokenizer, model.dtype
    mesh = build_mesh(devices, config.tensor_parallel_size)
    if mesh is not None:
        model_config, weights = place_on_mesh(mesh, model_config, weights, config.expert_parallel)
    log_expert_offload(model_config, weights)
    if model_config.unroll_layers:
        # One array per layer: no slice of a stack to copy out, alike fusions in every layer.
        # A lone replica owns the loaded arrays (replicas share them), so its stacks go.
        weights = weights.per_layer(consume=config.data_parallel_size == 1)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, takes_int8_activations(weights))
    kernels = choose_kernels(
        model_config,
        weights,
        kv_dtype,
        {"attention": config.attention_backend, "dequant_matmul": config.matmul_backend},
    )
    cache_mb = _cache_mb(config, mesh, devices) - _state_mb(config, model_config, dtype)
    # CPU_KVCACHE_MB counts float32 bytes: a 16-bit cache holds as many tokens in half of them.
    sized_as = jnp.dtype(jnp.float32) if _default_cpu_cache(config, mesh, devices) else kv_dtype
    num_pages, max_model_len = _size_cache(config, model_config, kv_dtype, cache_mb, sized_as)
    make_cache = _cache_maker(config, model_config, (kv_dtype, dtype), num_pages)
    abstract_cache = jax.eval_shape(make_cache)
    cache_shardings = None if mesh is None else cache_sharding(abstract_cache, mesh)
    mixed = mixed_steps(model_config, abstract_cache, dtype)
    images = None
    if model.vision is not None:
        images = image_encoder(spec, model.vision, tokenizer, config.limit_mm_per_prompt)
    plan, budget, prefill_only = _plan(config, max_model_len, mixed, images)
    decode_steps, multi_step_seqs = _decode_steps(config)
    runner = ModelRunner(
        spec,
        model_config,
        weights,
        _zero_cache(make_cache, cache_shardings),
        plan,
        eos_token_ids=tokenizer.eos_token_ids,
        decode_steps=decode_steps,
        cache_sharding=cache_shardings,
        multi_step_seqs=multi_step_seqs,
        images=images,
    )
    scheduler = _scheduler(
        config, model_config, tokenizer, plan, num_pages, max_model_len, mixed,
        (budget, prefill_only), (decode_steps, multi_step_seqs),
    )  # fmt: skip
    engine = _engine(config, model, runner, scheduler, max_model_len)
    engine.kernel_choices = kernels
    return engine


def _engine(
    config: EngineConfig,
    model: LoadedModel,
    runner: ModelRunner,
    scheduler: Scheduler,
    max_model_len: int,
) -> Engine:
    """The engine over a replica's runner and scheduler, with the cache-free forward of
    models that have one (embeddings, prompt scoring) on the runner's config and weights."""
    embedder = None
    if model.spec.hidden_states is not None:
        embedder = EmbeddingRunner(model.spec, runner.config, runner.weights, max_model_len)
    return Engine(
        runner,
        scheduler,
        model.tokenizer,
        config.served_model_name or model.files.name,
        max_model_len,
        seed=config.seed,
        embedder=embedder,
        max_waiting=config.max_waiting,
        precompile=config.precompile,
        async_scheduling=config.async_scheduling,
    )


def _plan(
    config: EngineConfig, max_model_len: int, mixed: bool, images: ImageEncoder | None = None
) -> tuple[BucketPlan, int, int]:
    """The compiled buckets, and the step's token budget with and without decode rows (the
    buckets cover the larger, and with images whose tokens attend both ways one image's tokens
    beside every decode row: a chunk never cuts such an image, see ``runtime.engine.scheduler``)."""
    budget = config.batched_tokens(jax.default_backend(), max_model_len)
    prefill_only = config.prefill_only_tokens(jax.default_backend(), max_model_len)
    top = max(budget, prefill_only)
    if images is not None and images.whole_image_tokens:
        top = max(top, images.whole_image_tokens + config.max_num_seqs)
    plan = BucketPlan.build(
        config.max_num_seqs,
        max_model_len,
        config.prefill_chunk_size,
        config.page_size,
        top,
        mixed=mixed,
    )
    return plan, budget, prefill_only


def _decode_steps(config: EngineConfig) -> tuple[int, int | None]:
    """(tokens per decode call, the most decoding sequences that take several per call; None:
    any): ``--decode-steps`` as given, or auto (see ``CPU_DECODE_STEPS``)."""
    if config.decode_steps:
        return config.decode_steps, None
    if jax.default_backend() == "cpu":
        return CPU_DECODE_STEPS, CPU_MULTI_STEP_SEQS
    return 8, None


def _scheduler(
    config: EngineConfig,
    model_config: Any,
    tokenizer: Tokenizer,
    plan: BucketPlan,
    num_pages: int,
    max_model_len: int,
    mixed: bool,
    budgets: tuple[int, int],
    decode: tuple[int, int | None],
) -> Scheduler:
    """The replica's scheduler over a fresh page allocator: ``budgets`` are the step's token
    budget with and without decode rows, ``decode`` the multi-step settings."""
    allocator = PageAllocator(num_pages, config.page_size)
    allocator.track_fresh = config.debug_fill_freed_pages
    cost = CPU_ATTENTION_FLOP_COST if jax.default_backend() == "cpu" else 1.0
    slots = has_state_slots(model_config)
    if slots and config.prefix_cache:
        logger.info(
            "prefix cache: off (linear-attention layers keep a recurrent state per sequence "
            "that a reused prefix of K/V pages would lack)"
        )
    return Scheduler(
        allocator,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        prefill_chunk_size=config.prefill_chunk_size,
        eos_token_ids=tokenizer.eos_token_ids,
        decode_steps=decode[0],
        prefill_lens=plan.prefill_lens,
        prefix_cache=config.prefix_cache and not slots,
        max_num_batched_tokens=budgets[0],
        prefill_only_tokens=budgets[1],
        mixed=mixed,
        multi_step_seqs=decode[1],
        prefix_cost=prefix_cost_positions(model_config, cost),
        max_step_tokens=plan.prefill_lens[-1],
        state_slots=slots,
    )


def has_state_slots(model_config: Any) -> bool:
    """Whether the model has linear-attention layers, which keep a state slot per sequence."""
    return getattr(model_config, "linear_attention", None) is not None


def _state_mb(config: EngineConfig, model_config: Any, dtype: Any) -> int:
    """MB of the state slots (one per ``--max-num-seqs``) of a linear-attention model, taken
    from the KV cache's memory; 0 for other models."""
    if not has_state_slots(model_config):
        return 0
    per_slot = model_config.linear_attention.slot_bytes(model_config.num_linear_layers, dtype)
    mb = -(-per_slot * config.max_num_seqs // 2**20)
    logger.info(
        "state slots: %d of %.1f MB (%d linear-attention layers), %d MB of the cache memory",
        config.max_num_seqs, per_slot / 2**20, model_config.num_linear_layers, mb,
    )  # fmt: skip
    return mb


def _cache_maker(
    config: EngineConfig, model_config: Any, dtypes: tuple[Any, Any], num_pages: int
) -> Callable[[], KVCache | HybridCache]:
    """What makes the zeroed KV cache of ``num_pages`` pages (``dtypes``: the cache's and the
    model's), with a linear-attention model's zeroed state slots beside it."""
    kv_dtype, dtype = dtypes
    k_shape, v_shape = model_config.cache_shapes(num_pages, config.page_size)

    def make() -> KVCache | HybridCache:
        kv = KVCache.zeros(k_shape, kv_dtype, v_shape)
        if not has_state_slots(model_config):
            return kv
        cfg, layers = model_config.linear_attention, model_config.num_linear_layers
        return HybridCache.zeros(kv, cfg, layers, config.max_num_seqs, dtype)

    return make


def place_on_mesh(
    mesh: Any, model_config: Any, weights: Any, expert_parallel: bool
) -> tuple[Any, Any]:
    """The model config and weights placed on the tensor-parallel mesh (heads must divide over
    its devices; KV heads fewer than the devices are repeated: ``runtime.parallel.kv_heads``)."""
    attention = model_config.attention
    is_mla = not hasattr(attention, "num_kv_heads")
    times = kv_replicas(attention.num_heads, model_config.num_kv_heads, mesh.size, is_mla)
    if times > 1:
        model_config, weights = replicate_kv_heads(model_config, weights, times)
    weights = shard_weights(weights, mesh, expert_parallel)
    logger.info("tensor parallel over %d devices: %s", mesh.size, list(mesh.devices.flat))
    return model_config, weights


def _replica_devices(mesh: Any, devices: Sequence[int] | None) -> list[Any]:
    """The replica's devices: its mesh's, else the one device it runs on."""
    return list(mesh.devices.flat) if mesh is not None else [jax.devices()[(devices or [0])[0]]]


def _cache_mb(config: EngineConfig, mesh: Any, devices: Sequence[int] | None) -> int:
    """MB for the replica's KV cache: ``--kvcache-mem``, or what its devices leave
    (``cache_size.auto_kvcache_mb``)."""
    if config.kvcache_mem_mb:
        return config.kvcache_mem_mb
    return auto_kvcache_mb(_replica_devices(mesh, devices), config.gpu_memory_utilization)


def _default_cpu_cache(config: EngineConfig, mesh: Any, devices: Sequence[int] | None) -> bool:
    """Whether the replica's KV cache takes ``CPU_KVCACHE_MB`` (no ``--kvcache-mem``, on CPU)."""
    replica = _replica_devices(mesh, devices)
    return not config.kvcache_mem_mb and all(d.platform == "cpu" for d in replica)


def _size_cache(
    config: EngineConfig, model_config: Any, kv_dtype: Any, cache_mb: int, sized_as: Any = None
) -> tuple[int, int]:
    """The KV cache's page count for ``cache_mb`` MB of ``sized_as`` pages (``kv_dtype``'s
    unless given), and ``max_model_len`` capped by it."""
    shapes = model_config.cache_shapes(1, config.page_size)
    page_bytes = kv_cache_bytes(*shapes, kv_dtype)
    sized_bytes = page_bytes if sized_as is None else kv_cache_bytes(*shapes, sized_as)
    num_pages = max(cache_mb, 0) * 2**20 // sized_bytes
    capacity = num_pages * config.page_size
    max_model_len = min(config.max_model_len or model_config.max_position_embeddings, capacity)
    if max_model_len < 16:
        raise ValueError(
            f"a KV cache of {max(cache_mb, 0)} MB holds only {capacity} tokens; raise --kvcache-mem"
        )
    logger.info(
        "KV cache: %d pages of %d tokens in %s (%.0f MB), max_model_len %d",
        num_pages,
        config.page_size,
        kv_dtype.name,
        num_pages * page_bytes / 2**20,
        max_model_len,
    )
    return num_pages, max_model_len


def native_kernels_allowed(tensor_parallel_size: int) -> bool:
    """Whether native kernels may run: the step runs on XLA:CPU without a device mesh."""
    return jax.default_backend() == "cpu" and tensor_parallel_size == 1


def with_native_kernels(model_config: Any, tensor_parallel_size: int) -> Any:
    """``model_config`` with ``native_kernels`` set: on where the step runs on XLA:CPU without a
    device mesh (one device per replica). A native kernel is a custom call, which XLA's SPMD
    partitioner does not split, so a tensor-parallel step keeps the XLA formulations. Decided
    before the weights load: where native kernels run, a quantized LM head stays packed.

    Each kernel's call classes are then timed against XLA on this CPU (once per machine and
    build: ``pallas_kernels.native.calibration``), and each runs the faster; the log names
    the instruction set built for and each choice."""
    allowed = native_kernels_allowed(tensor_parallel_size)
    if allowed and not calibration.calibrate():
        logger.info("native CPU kernels unavailable: every kernel runs its XLA formulation")
    return dataclasses.replace(model_config, native_kernels=allowed)


def mixed_steps(model_config: Any, cache: Any, dtype: Any) -> bool:
    """Whether a step (over the abstract ``cache``, a ``KVCache`` or ``HybridCache``) mixes
    decode rows with prefill chunks of several sequences: where the ragged attention runs on
    its native CPU kernel. Elsewhere (a device mesh, accelerators,
    MLA's absorbed attention, attention sinks) the ragged contract has only its jnp reference,
    which reads each row's whole page table, so a step is one kind of work and the two kinds
    alternate."""
    if not model_config.native_kernels or isinstance(model_config.attention, MLAConfig):
        choice = False
    else:
        q = jax.ShapeDtypeStruct((2, 1, model_config.head_dim), dtype)
        sinks = model_config.attention.sinks
        kv = cache.kv if isinstance(cache, HybridCache) else cache
        chosen = ragged_implementation("auto", q, kv.k, kv.v, 2, native_ok=True, sinks=sinks)
        choice = chosen == "native"
    logger.info(
        "steps: %s",
        "mixed (decode rows and prefill chunks together)"
        if choice
        else "a decode or prefill chunks alone, alternating (no native ragged attention here)",
    )
    return choice


def operand_dtype(matmul_dtype: str, model_config: Any) -> str | None:
    """The quantized projections' operands for ``--matmul-dtype`` (``models.layers.linear``):
    "model" is the model dtype (None); "auto" is int8 where the native CPU kernels run and their
    build multiplies int8 faster than float (``native.int8_wins``: there int8 activations, rounded
    as llama.cpp rounds them and as accurate, multiply fastest), else the model dtype. ``--isq
    int8``'s weights are not packed and multiply int8 activations only more slowly, so auto
    leaves them alone."""
    if matmul_dtype != "auto":
        return None if matmul_dtype == "model" else matmul_dtype
    int8 = (
        model_config.native_kernels
        and model_config.quantization != "int8"
        and native_dequant.available()
        and native.int8_wins()
    )
    choice = "int8" if int8 else None
    logger.info(
        "matmul operands: %s (--matmul-dtype auto: %s)",
        "int8 activations" if int8 else "the model dtype",
        f"the {native.cpu_isa().name} kernels multiply int8 fastest"
        if int8
        else "int8 activations only where native CPU kernels with int8 dots run (x86-64 from "
        "AVX2 up, Arm with dotprod)",
    )
    return choice


def _zero_cache(make: Callable[[], KVCache | HybridCache], shardings: Any) -> KVCache | HybridCache:
    """A zeroed cache; sharded, each device allocates only its own KV heads (and state slots'
    heads)."""
    if shardings is None:
        return make()
    return jax.jit(make, out_shardings=shardings)()
