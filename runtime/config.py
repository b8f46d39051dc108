"""Engine configuration: one frozen, validated dataclass built by the CLI or by library users."""

from __future__ import annotations

from dataclasses import dataclass

from jax_llm_runtime.models.isq import ISQ_TYPES
from jax_llm_runtime.runtime.multimodal.processor import MAX_IMAGES_PER_PROMPT

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
DTYPES = ("auto", "float32", "bfloat16", "float16")
# GGUF block types (the same packed weights a GGUF file of that type gives) and per-channel int8.
ISQ_CHOICES = (*ISQ_TYPES, "int8")
PRECOMPILE_CHOICES = ("first", "all", "none")
# auto: the model dtype; a float dtype: that one; fp8*: e4m3 + row scales
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3")
# quantized projections' operands; auto: int8 where the native CPU kernels have int8 dots, else
# the model dtype
MATMUL_DTYPES = ("auto", "model", "bfloat16", "int8")
DEFAULT_MAX_WAITING = 256
# prefill_chunk_size 0 (no chunking, as in candle-vllm) becomes this: a chunk longer than any
# context, so each prompt is prefilled in one step (the buckets and the scheduler cap a chunk at
# max_model_len).
UNCHUNKED_PREFILL = 1 << 30
# The token budget of a step on CPU (max_num_batched_tokens 0): with SmolLM2-135M on 2 cores a
# step of 16 decode rows takes ~21 ms and one of 64 tokens ~37 ms, so streams decoding beside a
# long prompt see gaps within twice their median; 256 made them 6.5x (BENCHMARKS.md, "Mixed
# batches"). A lone prompt's chunks cost about the same per token either way.
CPU_BATCHED_TOKENS = 64
# ... and of a step with no decode rows (a lone prompt, the first steps of a burst), which no
# stream waits on: a lone 512-token prompt's first token took 438 ms in chunks of 64 and 290 in
# chunks of 256 (BENCHMARKS.md, "Mixed batches").
CPU_PREFILL_ONLY_TOKENS = 256
# The KV cache on CPU when --kvcache-mem is not given: host memory is shared with everything
# else, so it is a fixed size rather than a share of what is free. It counts float32 bytes: a
# 16-bit cache holds the same tokens in half of them (runtime.loading.builder).
CPU_KVCACHE_MB = 1024
# --attention-backend and --matmul-backend (pallas_kernels.selection.BACKENDS).
KERNEL_BACKENDS = ("auto", "pallas", "reference")
# --layer-loop: how a step walks the layers (models.decoder.DecoderConfig.unroll_layers).
LAYER_LOOPS = {"auto": None, "scan": False, "unrolled": True}


def _check_at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine.

    max_waiting bounds the sequences admitted beyond the max_num_seqs that run at once: past it a
    request is refused with ``EngineOverloadedError`` instead of queued (0: no bound).
    kvcache_mem_mb sizes the paged KV cache (all layers, K and V); 0 (auto) is
    ``CPU_KVCACHE_MB`` on CPU and, on accelerators, what ``gpu_memory_utilization`` of each
    device's memory leaves after the weights (vLLM's ``--gpu-memory-utilization``;
    ``runtime.loading.cache_size``). max_model_len defaults to the
    model's context length, capped by what the cache can hold. prefill_chunk_size is the most
    prompt tokens one step processes for one sequence (chunked prefill); 0 lifts that limit
    (stored as ``UNCHUNKED_PREFILL``), leaving the step's budget. max_num_batched_tokens is
    that budget: the most tokens one step runs, every running sequence's next token plus
    prefill chunks of as many prompts as fit (mixed batches); 0 picks ``CPU_BATCHED_TOKENS`` on
    CPU and prefill_chunk_size plus max_num_seqs elsewhere (``batched_tokens``). decode_steps is how many
    tokens a decode call generates per sequence when no other work waits (multi-step decode: one
    dispatch and one host round trip for several tokens); 0 picks 4 on CPU while at most 4
    sequences decode (~1 ms of host work per call is felt by a few streams, not by a batch whose
    step takes 20 ms; ``runtime.loading.builder.CPU_MULTI_STEP_SEQS``), and 8 on accelerators,
    where dispatch dominates small models. A stream then receives its tokens in bursts of that
    many.
    kv_cache_dtype "fp8" (or vLLM's "fp8_e4m3") stores K and V as float8 e4m3 with one scale per
    token and KV head; "float32", "float16" or "bfloat16" in that dtype; "auto" in the model
    dtype. matmul_dtype "bfloat16" multiplies
    quantized projections with bfloat16 operands (faster on CPU, not batch-invariant: see
    models.layers.linear); "int8" rounds their activations to int8 blocks of 32 (llama.cpp's
    rounding) and multiplies with integer dots in the native CPU kernel; "model" multiplies in
    the model dtype; "auto" is int8 where the native CPU kernels run with int8 dots (x86-64
    from AVX2 up, Arm with dotprod) and the model dtype elsewhere
    (``runtime.loading.builder.operand_dtype``).
    attention_backend and matmul_backend choose the paged-attention and dequant-matmul
    implementations: "auto" (on GPU and TPU the Pallas kernel where a startup check on the device
    matches the reference, on CPU native kernels where measured faster), "pallas" or
    "reference" (``pallas_kernels.selection``).
    layer_loop says how a step walks the layers: "scan" (``lax.scan``: one compiled layer body),
    "unrolled" (each layer compiled on its own, over one array per layer: no slice of a stack
    for XLA to copy out, but the step compiles several times slower), or "auto" (the scan, on
    every backend today: ``models.decoder.DecoderConfig.unroll_layers`` says why).
    prefix_cache reuses the cached K/V of full pages whose tokens (and every token before them)
    match an earlier sequence's. debug_fill_freed_pages fills every page with NaN when it is
    handed to a new owner, so that a read of stale K/V shows up as a non-finite output.
    devices (indices into ``jax.devices()``) and tensor_parallel_size build the device mesh the
    step is split over (``runtime.parallel.sharding``); one device by default. expert_parallel splits a
    mixture-of-experts model's routed experts over the same devices. data_parallel_size
    replicas of the model, each on its own tensor_parallel_size devices with its own KV cache of
    kvcache_mem_mb and its own max_num_seqs, share the requests (``runtime.parallel.data_parallel``).
    num_experts_offload_per_rank keeps that many routed experts of each rank (each device of the
    expert-parallel mesh, or each device when the experts are not split) in pinned host memory,
    the last ones of the rank's share, and brings them to the device only for the layers whose
    tokens chose one (``runtime.parallel.expert_offload_plan``); 0 keeps every expert on the device.
    limit_mm_per_prompt is the most images one prompt of a vision-language model may hold
    (vLLM's --limit-mm-per-prompt); the image encoder compiles for batches up to it.
    precompile says when the step shapes compile (``runtime.engine.core.Engine.start``): "first"
    compiles what a lone request runs before serving and every other shape in the background;
    "all" compiles every shape before serving (the slowest start; no step ever waits for a
    compile); "none" compiles nothing ahead, each shape when a step first needs it (the fastest
    start, for short jobs that run few shapes; the first steps of each shape wait).
    async_scheduling dispatches the next decode call while the current one runs, its input
    tokens fed on the device, wherever the next call does not depend on the host's work on
    this one's tokens (``runtime.engine.scheduler.Scheduler.schedule_ahead``); off, each call
    is scheduled after the one before it returns.
    """

    model_id: str = DEFAULT_MODEL_ID
    weight_file: str | None = None
    dtype: str = "auto"
    max_num_seqs: int = 16
    max_waiting: int = DEFAULT_MAX_WAITING
    max_model_len: int | None = None
    kvcache_mem_mb: int = 0
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"
    matmul_backend: str = "auto"
    layer_loop: str = "auto"
    page_size: int = 16
    prefill_chunk_size: int = 8192
    max_num_batched_tokens: int = 0
    seed: int = 0
    decode_steps: int = 0
    isq: str | None = (
        None  # in-situ quantization at load: a GGUF block type or "int8" (ISQ_CHOICES)
    )
    kv_cache_dtype: str = "auto"
    matmul_dtype: str = "auto"
    served_model_name: str | None = None
    prefix_cache: bool = True
    debug_fill_freed_pages: bool = False
    devices: tuple[int, ...] | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel: bool = False
    num_experts_offload_per_rank: int = 0
    limit_mm_per_prompt: int = MAX_IMAGES_PER_PROMPT
    precompile: str = "first"
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check_at_least("max_waiting (0: no bound)", self.max_waiting, 0)
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError(f"max_model_len must be >= 16, got {self.max_model_len}")
        self._check_device_settings()
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.isq is not None and self.isq not in ISQ_CHOICES:
            raise ValueError(f"isq must be one of {', '.join(ISQ_CHOICES)}, got {self.isq!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(
                f"matmul_dtype must be one of {', '.join(MATMUL_DTYPES)}, got {self.matmul_dtype!r}"
            )
        self._check_parallel()
        if not 0 <= self.decode_steps <= 64:
            raise ValueError(f"decode_steps must be 0 (auto) to 64, got {self.decode_steps}")
        self._check_prefill_chunk_size()
        _check_at_least("limit_mm_per_prompt", self.limit_mm_per_prompt, 0)
        if self.precompile not in PRECOMPILE_CHOICES:
            raise ValueError(
                f"precompile must be one of {', '.join(PRECOMPILE_CHOICES)}, "
                f"got {self.precompile!r}"
            )

    def _check_device_settings(self) -> None:
        _check_at_least("kvcache_mem_mb (0: auto)", self.kvcache_mem_mb, 0)
        for name in ("attention_backend", "matmul_backend"):
            value = getattr(self, name)
            if value not in KERNEL_BACKENDS:
                raise ValueError(
                    f"{name} must be one of {', '.join(KERNEL_BACKENDS)}, got {value!r}"
                )
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(
                f"layer_loop must be one of {', '.join(LAYER_LOOPS)}, got {self.layer_loop!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def prefill_only_tokens(self, backend: str, max_model_len: int) -> int:
        """The token budget of a step with no decode rows: ``max_num_batched_tokens`` when given,
        else ``CPU_PREFILL_ONLY_TOKENS`` on CPU and the step budget elsewhere."""
        if self.max_num_batched_tokens or backend != "cpu":
            return self.batched_tokens(backend, max_model_len)
        return max(CPU_PREFILL_ONLY_TOKENS, self.batched_tokens(backend, max_model_len))

    def batched_tokens(self, backend: str, max_model_len: int) -> int:
        """The step's token budget on ``backend`` for a context of ``max_model_len`` (see the
        class docstring); above max_num_seqs, so that prompts are prefilled while every
        sequence decodes."""
        budget = self.max_num_batched_tokens
        if not budget:
            chunk = min(self.prefill_chunk_size, max_model_len)
            budget = CPU_BATCHED_TOKENS if backend == "cpu" else chunk + self.max_num_seqs
        return max(budget, 2 * self.max_num_seqs)

    def _check_prefill_chunk_size(self) -> None:
        if self.max_num_batched_tokens and self.max_num_batched_tokens <= self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens must be above max_num_seqs ({self.max_num_seqs}) "
                f"or 0 (auto), got {self.max_num_batched_tokens}"
            )
        if self.prefill_chunk_size == 0:
            object.__setattr__(self, "prefill_chunk_size", UNCHUNKED_PREFILL)
        if self.prefill_chunk_size < self.page_size:
            raise ValueError(
                f"prefill_chunk_size must be 0 (no chunking) or >= page_size ({self.page_size}), "
                f"got {self.prefill_chunk_size}"
            )

    def _check_parallel(self) -> None:
        _check_at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_at_least("data_parallel_size", self.data_parallel_size, 1)
        _check_at_least("num_experts_offload_per_rank", self.num_experts_offload_per_rank, 0)
        needed = self.tensor_parallel_size * self.data_parallel_size
        if self.devices is not None and len(self.devices) != needed:
            raise ValueError(
                f"devices lists {len(self.devices)} devices but tensor_parallel_size "
                f"{self.tensor_parallel_size} x data_parallel_size {self.data_parallel_size} "
                f"needs {needed}"
            )
