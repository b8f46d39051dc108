"""``runtime-serve``: build an engine from command-line flags and serve it over HTTP.

1. Load ``.env`` from the working directory (``api.cli.serve.env_file``; set variables win), then parse
   the flags into an ``EngineConfig``, or one per model of ``--models-config`` (the flags as
   their defaults; ``api.cli.serve.models_config``). Bad values: a one-line ``runtime-serve: error: ...``
   and exit status 2, before anything heavy is imported.
   candle-vllm's spellings are accepted too (``resolve_compat_flags``): flags that mean the
   same map onto ours; those that cannot mean anything here print one
   ``runtime-serve: warning: ...`` line each, once the flags are known to be valid.
2. Build the engines (resolve and load each model; errors: one line, exit status 1). With
   ``--save-prepared DIR`` the model is loaded, written to DIR as a prepared checkpoint
   (``runtime.loading.prepared``) and the process exits with status 0 instead of serving.
3. Serve ``create_app(models)`` with uvicorn; the app's lifespan connects the MCP servers of
   ``--mcp-config`` (a failure: one line, exit status 1) and starts the engines (compilation and
   warmup) before the socket accepts requests, then ``Serving <model> on http://host:port/v1``
   is printed (several models: their names joined by commas); ``--host unix:///path`` serves on
   that unix socket instead (``api.cli.unix_socket``).
4. SIGTERM drains (``api.cli.serve.server``): no new requests, up to ``--shutdown-timeout`` for those in
   flight, the rest aborted, exit status 0. Ctrl-C stops sooner, with exit status 130.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from jax_llm_runtime.api.cli.cluster_flags import add_cluster_flags, cluster_config
from jax_llm_runtime.api.cli.env_file import load_env_file
from jax_llm_runtime.api.cli.models_config import load_models_config
from jax_llm_runtime.api.cli.service_flags import (
    add_service_flags,
    generation_config_defaults,
    sampling_flags,
    server_config,
)
from jax_llm_runtime.api.cli.unix_socket import (
    UnixSocketError,
    check_unix_socket_path,
    unix_socket_path,
)
from jax_llm_runtime.runtime.config import (
    CPU_BATCHED_TOKENS,
    CPU_KVCACHE_MB,
    DEFAULT_MAX_WAITING,
    DEFAULT_MODEL_ID,
    DTYPES,
    ISQ_CHOICES,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    LAYER_LOOPS,
    MATMUL_DTYPES,
    PRECOMPILE_CHOICES,
    EngineConfig,
)
from jax_llm_runtime.runtime.multimodal.processor import MAX_IMAGES_PER_PROMPT

if TYPE_CHECKING:
    from jax_llm_runtime.api.service.served_models import ServedModel
    from jax_llm_runtime.api.service.settings import ServerConfig
    from jax_llm_runtime.runtime.engine.interface import EngineClient
    from jax_llm_runtime.runtime.parallel.multihost import ClusterConfig

PROG = "runtime-serve"
MODELS_CONFIG_ENV = "RUNTIME_MODELS_CONFIG"
CANDLE_VLLM_MODELS_CONFIG_ENV = "CANDLE_VLLM_MODELS_CONFIG"  # read when ours is unset
# candle-vllm's short dtype names
DTYPE_ALIASES = {"bf16": "bfloat16", "f16": "float16", "fp16": "float16", "f32": "float32"}
# candle-vllm's TurboQuant KV caches; served here as fp8, the compressed cache there is
TURBO_KV_CACHE_DTYPES = ("turbo8", "turbo4", "turbo3")
# --log-level names, with RUST_LOG's (off, warn, trace) among them
LOG_LEVELS = {
    "off": logging.CRITICAL + 10,
    "error": logging.ERROR,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": logging.DEBUG,
}
# candle-vllm's --enforce-parser values -> --tool-parser
ENFORCE_PARSERS = {
    "qwen": "hermes",
    "json": "json",
    "mistral": "mistral",
    "qwen_coder": "qwen3_coder",
}
# candle-vllm flags that cannot mean anything here: (flags, argparse options, why ignored)
IGNORED_FLAGS: tuple[tuple[str, dict[str, object], str], ...] = (
    (
        "--multithread",
        {"action": "store_true"},
        "runtime-serve drives all of a model's devices from one process; there is no "
        "multi-threaded mode to switch to",
    ),
    (
        "--kvcache-mem-cpu",
        {"type": int, "metavar": "MB"},
        "the KV cache has no CPU swap space here; --kvcache-mem (--mem) alone sizes it",
    ),
    (
        "--kv-fraction",
        {"type": float, "metavar": "F"},
        "the KV cache is sized by --kvcache-mem (--mem) or, on accelerators, by "
        "--gpu-memory-utilization (a share of all device memory, not of what is free)",
    ),
    (
        "--yarn-scaling-factor",
        {"type": float, "metavar": "F"},
        "RoPE scaling cannot be overridden here; the model's config.json decides it",
    ),
    (
        "--prefix-cache-max-tokens",
        {"type": int, "metavar": "N"},
        "the prefix cache has no cap of its own: it keeps free KV pages until they are needed",
    ),
    (
        "--disable-cuda-graph",
        {"action": "store_true"},
        "XLA compiles each step shape ahead of time; there are no CUDA graphs to turn off",
    ),
)
KEEP_ALIVE_ENV = "KEEP_ALIVE_INTERVAL"  # candle-vllm's SSE keep-alive period; nothing reads it here
# Drain, abort and exit within Kubernetes' default 30 s between SIGTERM and SIGKILL.
DEFAULT_SHUTDOWN_TIMEOUT_S = 25
DEFAULT_PORT = 2000
STARTED = time.monotonic()  # module import: close enough to process start
logger = logging.getLogger(__name__)


def _device_list(text: str) -> tuple[int, ...]:
    try:
        devices = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected device indices like 0,1,2,3, got {text!r}"
        ) from None
    if any(d < 0 for d in devices):
        raise argparse.ArgumentTypeError(f"device indices must be >= 0, got {text!r}")
    return devices


def _dtype(text: str) -> str:
    return DTYPE_ALIASES.get(text.lower(), text)


def _rust_log_level(value: str | None) -> str | None:
    """The most verbose level RUST_LOG names (``info``, ``candle_vllm=debug``...), as candle-vllm
    reads it; None when it names none."""
    upper = (value or "").upper()
    named = [
        name for name in ("off", "error", "warn", "info", "debug", "trace") if name.upper() in upper
    ]
    return named[-1] if named else None


def _fraction(text: str) -> float:
    """A share in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {value}")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535, got {value}")
    return value


class _OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad flag as one line, ``runtime-serve: error: ...``, and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_model_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model-id",
        "--m",
        default=None,
        help="a packaged alias (smollm2-135m-instruct, gemma3-270m), a local HF-layout folder, "
        "a local .gguf file, a Hugging Face repo id, or a folder written by --save-prepared "
        f"(default: {DEFAULT_MODEL_ID})",
    )
    group.add_argument(
        "--save-prepared",
        default=None,
        metavar="DIR",
        help="load the model as serving would (converted, --isq quantized, split by "
        "--tensor-parallel-size), write it to the new folder DIR with orbax-checkpoint, and "
        "exit without serving; --model-id DIR then restores it onto the devices without "
        "converting or quantizing again (--dtype and --isq may be left out; given, they, "
        "--tensor-parallel-size and the expert flags must be those DIR was prepared with) "
        "(default: off)",
    )
    group.add_argument(
        "--models-config",
        default=os.environ.get(MODELS_CONFIG_ENV)
        or os.environ.get(CANDLE_VLLM_MODELS_CONFIG_ENV)
        or None,
        metavar="PATH",
        help="serve the named models of this YAML file (models: {name: {model_id: ..., "
        "max_num_seqs: ..., ...}}; see example.models.yaml), each with its own engine, routed by "
        "the request's `model`; options a model leaves out take the engine flags' values; not "
        "with --model-id, --weight-file or --served-model-name "
        f"(default: ${MODELS_CONFIG_ENV}, else ${CANDLE_VLLM_MODELS_CONFIG_ENV}, else the one "
        "model of --model-id)",
    )
    _add_weight_flags(group)


def _add_weight_flags(group: argparse._ArgumentGroup) -> None:
    """Where the weights are (candle-vllm's names), their dtype and the names served."""
    group.add_argument(
        "--weight-path",
        "--w",
        default=None,
        metavar="DIR",
        help="candle-vllm's --w: a local weight folder (HF layout or GGUF), the same as "
        "--model-id DIR; it wins over --model-id",
    )
    group.add_argument(
        "--weight-file",
        "--f",
        default=None,
        help="which weight file to use inside the model folder or repo (e.g. one .gguf of many); "
        "without --model-id or --weight-path, a local .gguf file to serve",
    )
    group.add_argument(
        "--dtype",
        type=_dtype,
        choices=DTYPES,
        default="auto",
        help="weight/activation dtype (bf16, f16, f32 name the same); auto: float32 on CPU, "
        "bfloat16 on accelerators (default: %(default)s)",
    )
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model names clients may send and /v1/models lists; responses report the "
        "first; default: derived from --model-id",
    )


def _add_engine_flags(group: argparse._ArgumentGroup) -> None:
    _add_batch_flags(group)
    _add_image_flags(group)
    _add_numerics_flags(group)
    _add_device_flags(group)
    _add_prefix_cache_flags(group)


def _add_batch_flags(group: argparse._ArgumentGroup) -> None:
    """How many sequences run and wait, how long they may be, and the paged KV cache's size."""
    add = group.add_argument
    add(
        "--max-num-seqs",
        type=_int_at_least(1),
        default=16,
        help="most sequences per batch (default: %(default)s)",
    )
    add(
        "--max-waiting",
        type=_int_at_least(0),
        default=DEFAULT_MAX_WAITING,
        help="most sequences waiting for a place in the batch; a request that would exceed it "
        "gets a 503 with Retry-After at once; 0 = no bound (default: %(default)s)",
    )
    add(
        "--max-model-len",
        type=_int_at_least(16),
        default=None,
        help="most tokens (prompt + completion) per sequence; default: the model's context "
        "length, capped by what the KV cache holds",
    )
    add(
        "--kvcache-mem",
        "--mem",
        "--kvcache-mem-gpu",
        dest="kvcache_mem_mb",
        type=_int_at_least(1),
        default=0,
        metavar="MB",
        help="memory for the paged KV cache, all layers, in MB; default: on CPU the tokens "
        f"{CPU_KVCACHE_MB} MB of float32 holds, on accelerators what --gpu-memory-utilization "
        "leaves after the weights",
    )
    for flag, what in (
        ("--attention-backend", "paged attention"),
        ("--matmul-backend", "the quantized projections' dequant-matmul"),
    ):
        add(
            flag,
            choices=KERNEL_BACKENDS,
            default="auto",
            help=f"what runs {what}: auto = on GPU and TPU the Pallas kernel where a startup "
            "check on the device matches the reference, on CPU the native kernel where measured "
            "faster; pallas or reference force one (default: %(default)s)",
        )
    add(
        "--layer-loop",
        choices=tuple(LAYER_LOOPS),
        default="auto",
        help="how a step walks the layers: scan (one compiled layer body), unrolled (each layer "
        "compiled on its own: on GPU no per-layer weight copies, but a many times slower "
        "compile); auto = scan (default: %(default)s)",
    )
    add(
        "--gpu-memory-utilization",
        type=_fraction,
        default=0.9,
        metavar="F",
        help="on accelerators without --kvcache-mem: the share of each device's memory for the "
        "weights and the KV cache together; the rest is left for activations "
        "(default: %(default)s)",
    )
    add(
        "--page-size",
        "--block-size",
        type=_int_at_least(1),
        default=16,
        help="tokens per KV page, a power of 2 (default: %(default)s)",
    )
    add(
        "--prefill-chunk-size",
        type=_int_at_least(0),
        default=8192,
        help="most prompt tokens one step prefills for one sequence; 0 = no limit beyond "
        "--max-num-batched-tokens (default: %(default)s)",
    )
    add(
        "--max-num-batched-tokens",
        type=_int_at_least(0),
        default=0,
        help="most tokens one step runs: every running sequence's next token plus prefill "
        "chunks of as many prompts as fit; smaller keeps running streams smooth while prompts "
        f"arrive, larger prefills long prompts in fewer steps; 0 = {CPU_BATCHED_TOKENS} on CPU, "
        "else --prefill-chunk-size plus --max-num-seqs (default: 0)",
    )


def _add_image_flags(group: argparse._ArgumentGroup) -> None:
    """How many images a prompt of a vision-language model may hold."""
    group.add_argument(
        "--limit-mm-per-prompt",
        type=_mm_limit,
        default=MAX_IMAGES_PER_PROMPT,
        metavar="N",
        help="most images one prompt of a vision-language model may hold: a number, or vLLM's "
        "JSON form '{\"image\": N}' (default: %(default)s)",
    )


def _add_numerics_flags(group: argparse._ArgumentGroup) -> None:
    """How weights, the KV cache and the matmuls' operands are stored and computed; decode steps; the seed."""
    add = group.add_argument
    add(
        "--isq",
        choices=ISQ_CHOICES,
        default=None,
        help="quantize the layers' projections at load into a GGUF block type (q4_0 q4_1 q5_0 "
        "q5_1 q8_0 q2k q3k q4k q5k q6k; k-quants fall back to a 32-block type for widths that are "
        "not multiples of 256, as llama.cpp does) or int8 (one scale per output channel) "
        "(default: off)",
    )
    add(
        "--kv-cache-dtype",
        "--kvcache-dtype",
        choices=(*KV_CACHE_DTYPES, *TURBO_KV_CACHE_DTYPES),
        default="auto",
        help="KV cache storage: auto = the model dtype (float16 for a float32 model whose projections "
        "take int8 activations); float32, float16 or bfloat16 = that dtype; "
        "fp8 (or fp8_e4m3) = float8 e4m3 with one scale per token and KV head, about a quarter of "
        "float32's bytes; candle-vllm's turbo8, turbo4, turbo3 are served as fp8, with a warning "
        "(default: %(default)s)",
    )
    add(
        "--matmul-dtype",
        choices=MATMUL_DTYPES,
        default="auto",
        help="operands of the quantized projections' matmuls: model = the model dtype; "
        "bfloat16 = activations rounded to bfloat16, products summed in float32, except when one "
        "sequence decodes alone: about 1.5x faster prefill and batched decode on CPUs with "
        "AVX512-BF16, logits within ~1%%, but a request's tokens may then depend on what it is "
        "batched with; int8 = activations rounded to int8 blocks of 32 as llama.cpp rounds "
        "them (a lone row too), multiplied with integer dots by the native CPU kernel; auto = "
        "int8 where the native CPU kernels have int8 dots (x86-64 from AVX2 up, Arm with "
        "dotprod), else model (default: %(default)s)",
    )
    add(
        "--fp8-kvcache",
        dest="kv_cache_dtype",
        action="store_const",
        const="fp8",
        help="same as --kv-cache-dtype fp8",
    )
    add(
        "--decode-steps",
        type=_int_at_least(0),
        default=0,
        help="tokens generated per decode call when no request waits (multi-step decode: "
        "streams get tokens in bursts of that many); 0 = 4 on CPU while at most 4 sequences "
        "decode, 8 on accelerators; 1 streams every token as it is sampled (default: %(default)s)",
    )
    add(
        "--precompile",
        choices=PRECOMPILE_CHOICES,
        default="first",
        help="when the step shapes compile: 'first' compiles what a lone request runs before "
        "serving and the rest in the background; 'all' everything before serving; 'none' "
        "nothing ahead, each shape when a step first needs it (fastest start, slower first "
        "requests) (default: %(default)s)",
    )
    add(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="dispatch the next decode call while the current one runs, its input tokens fed "
        "on the device, so the host's turn between calls overlaps the device's work "
        "(requests with logprobs, penalties or a grammar still wait for each token; default: on)",
    )
    add(
        "--seed",
        type=int,
        default=0,
        help="seed of the engine's sampling random stream (default: %(default)s)",
    )


def _add_device_flags(group: argparse._ArgumentGroup) -> None:
    """Which devices run the model, and how it is split over them (tensor, data and expert parallelism)."""
    add = group.add_argument
    add("--cpu", dest="device", action="store_const", const="cpu", help="same as --device cpu")
    add(
        "--device",
        choices=("cpu", "gpu", "tpu", "metal"),
        default=None,
        help="JAX platform to run on (gpu = CUDA; metal = a hand-installed Metal plugin, untested); a "
        "platform that is not available is an error (default: JAX's own choice)",
    )
    add(
        "--tensor-parallel-size",
        "--tp",
        type=_int_at_least(1),
        default=None,
        help="devices one model is split over (tensor parallelism: attention and KV heads, MLP "
        "columns and the vocabulary divided among them; default: the devices --devices lists "
        "over --data-parallel-size (over --num-nodes hosts: times --num-nodes), else 1)",
    )
    add(
        "--data-parallel-size",
        "--dp",
        type=_int_at_least(1),
        default=1,
        help="replicas of the model, each on its own --tensor-parallel-size devices with its own "
        "KV cache (--kvcache-mem each) and batch; requests go to the least loaded "
        "(default: %(default)s)",
    )
    add(
        "--devices",
        "--d",
        type=_device_list,
        default=None,
        metavar="0,1,...",
        help="indices into JAX's devices to run on, --tensor-parallel-size x "
        "--data-parallel-size of them, replica by replica (default: the first ones)",
    )
    add(
        "--enable-expert-parallel",
        dest="expert_parallel",
        action="store_true",
        help="split a mixture-of-experts model's routed experts over the --tensor-parallel-size "
        "devices (each keeps its share of the experts whole) instead of replicating them",
    )
    add(
        "--num-experts-offload-per-rank",
        type=_int_at_least(0),
        default=0,
        metavar="N",
        help="keep the last N routed experts of each device's share (all experts without "
        "--enable-expert-parallel) in pinned host memory and copy a layer's to the device only "
        "when a token of the step chose one; for MoE models larger than device memory; N must "
        "be below the experts per device (default: %(default)s, every expert on the device)",
    )


def _add_prefix_cache_flags(group: argparse._ArgumentGroup) -> None:
    """The prefix cache, and a debugging aid for the pages' reuse."""
    add = group.add_argument
    add(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the cached K/V of full pages whose tokens match an earlier request's prefix "
        "(--no-prefix-cache computes every prompt in full; default: on)",
    )
    add(
        "--disable-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="same as --no-prefix-cache",
    )
    add(
        "--debug-fill-freed-pages",
        action="store_true",
        help="DEBUGGING AID: fill every KV page with NaN when it is handed to a new owner, so "
        "that a read of another request's stale K/V shows as a non-finite output (slower)",
    )


def _add_server_flags(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--host",
        "--h",
        default="127.0.0.1",
        help="interface to listen on; HOST:PORT, [IPv6]:PORT and tcp://HOST[:PORT] set --port "
        "too; unix:///PATH (or file://, socket://) serves on that unix socket instead, removed "
        "at shutdown (default: %(default)s)",
    )
    add(
        "--port",
        "--p",
        type=_port,
        default=DEFAULT_PORT,
        help="TCP port; 0 picks a free one (default: %(default)s)",
    )
    add(
        "--log",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="append logs to this file instead of stderr; bare --log (candle-vllm's switch) "
        "keeps them on stderr",
    )
    add(
        "--log-level",
        choices=tuple(LOG_LEVELS),
        type=str.lower,
        default=_rust_log_level(os.environ.get("RUST_LOG")) or "info",
        help="least severe log records kept (default: the level $RUST_LOG names, else info)",
    )
    add(
        "--shutdown-timeout",
        type=_int_at_least(0),
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="S",
        help="on SIGTERM, refuse new requests (503, /health 503) and give those in flight this "
        "many seconds to finish before aborting them; then exit with status 0 (default: "
        "%(default)s, which fits Kubernetes' default 30 s grace period)",
    )
    add(
        "--mock-engine",
        action="store_true",
        help="TESTING AID: serve a deterministic mock engine (no model, no weights) that echoes "
        "prompts reversed; for API end-to-end tests",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every flag's help states its default."""
    parser = _OneLineErrorParser(
        prog=PROG,
        description="Serve a model through an OpenAI-compatible HTTP API "
        "(/v1/chat/completions, /v1/responses, /v1/completions, /v1/models, /health).",
        allow_abbrev=False,
    )
    _add_model_flags(parser.add_argument_group("model"))
    _add_engine_flags(parser.add_argument_group("engine"))
    _add_server_flags(parser.add_argument_group("server"))
    add_service_flags(parser)
    add_cluster_flags(parser)
    _add_candle_vllm_flags(parser.add_argument_group("candle-vllm flags without a flag of ours"))
    return parser


def _add_candle_vllm_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--enforce-parser",
        choices=tuple(ENFORCE_PARSERS),
        default=None,
        help="candle-vllm's tool parser choice: qwen = --tool-parser hermes, qwen_coder = "
        "--tool-parser qwen3_coder, json and mistral the same",
    )
    for flag, options, why in IGNORED_FLAGS:
        group.add_argument(flag, default=None, help=f"ignored, with a warning: {why}", **options)


def _bind_address(text: str) -> tuple[str, int | None]:
    """candle-vllm's --h forms of a TCP address: host, host:port, [ipv6]:port, tcp://host[:port]
    (ValueError for a bad port)."""
    address = text
    if address.startswith("tcp://"):
        address = address[len("tcp://") :].rstrip("/")
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            raise ValueError(f"--host {text}: expected [IPv6]:PORT")
    elif address.count(":") == 1:
        host, _, port_text = address.partition(":")
    else:
        host, port_text = address, None  # a name, IPv4 or a bare IPv6 address
    if port_text is None:
        return host, None
    try:
        return host, _port(port_text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--host {text}: port {exc}") from None


def resolve_compat_flags(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> list[str]:
    """Turn candle-vllm's spellings in ``args`` into ours, in place; the warning lines (without
    the ``runtime-serve: warning:`` prefix) for what cannot mean anything here. ValueError for a
    bad value."""
    env = os.environ if environ is None else environ
    warnings = []
    if args.weight_path is not None:
        if args.model_id is not None:
            warnings.append(
                f"--model-id {args.model_id} ignored: --weight-path (--w) names the model"
            )
        args.model_id = args.weight_path
    if args.model_id is None and args.weight_file is not None and args.models_config is None:
        path = Path(args.weight_file).expanduser()
        if path.suffix.lower() != ".gguf" or not path.is_file():
            raise ValueError(
                f"--weight-file {args.weight_file}: without --model-id or --weight-path it must "
                "be a local .gguf file"
            )
        args.model_id, args.weight_file = str(path), None
    if args.kv_cache_dtype in TURBO_KV_CACHE_DTYPES:
        warnings.append(
            f"--kvcache-dtype {args.kv_cache_dtype} served as fp8: TurboQuant KV caches are not "
            "implemented here; fp8 is float8 e4m3 with a scale per token and KV head"
        )
        args.kv_cache_dtype = "fp8"
    warnings += _resolve_bind_address(args)
    if args.enforce_parser is not None:
        args.tool_parser = ENFORCE_PARSERS[args.enforce_parser]
    for flag, _, why in IGNORED_FLAGS:
        if getattr(args, flag[2:].replace("-", "_")) is not None:  # given, even as 0
            warnings.append(f"{flag} ignored: {why}")
    if env.get(KEEP_ALIVE_ENV):
        warnings.append(
            f"${KEEP_ALIVE_ENV} ignored: streamed responses here send no keep-alive comments"
        )
    return warnings


def _resolve_bind_address(args: argparse.Namespace) -> list[str]:
    """Split --host into ``args.host`` and ``args.port``, or ``args.uds`` (a unix socket's path,
    else None); the warning lines for the flags a unix socket leaves without meaning."""
    args.uds = unix_socket_path(args.host)
    if args.uds is None:
        args.host, port = _bind_address(args.host)
        if port is not None:
            args.port = port
        return []
    warnings = []
    if args.port != DEFAULT_PORT:
        warnings.append(f"--port {args.port} ignored: the API is served on unix://{args.uds}")
    if args.ui_port is not None:
        warnings.append(
            f"--ui-port {args.ui_port} ignored: there is no TCP port beside a unix socket; "
            "the web UI is served at / of the socket"
        )
        args.ui_port, args.ui_server = None, "1"
    return warnings


def _tensor_parallel_size(args: argparse.Namespace) -> int:
    """--tensor-parallel-size, else as candle-vllm infers it: the devices --devices lists over
    --data-parallel-size (times --num-nodes: --devices then names each host's devices)."""
    if args.tensor_parallel_size is not None:
        return int(args.tensor_parallel_size)
    if args.devices is None:
        return 1
    count, replicas = len(args.devices), args.data_parallel_size
    if count % replicas:
        raise ValueError(
            f"--devices lists {count} devices, not a multiple of --data-parallel-size {replicas}"
        )
    return count // replicas * getattr(args, "num_nodes", 1)


def _devices(args: argparse.Namespace) -> tuple[int, ...] | None:
    """--devices; over several hosts without --tensor-parallel-size (candle-vllm's --d 0,1,...
    on every host), every host's devices: None, the first ones of all of them."""
    nodes = getattr(args, "num_nodes", 1)
    if args.devices is None or nodes == 1 or args.tensor_parallel_size is not None:
        return args.devices
    if args.devices != tuple(range(len(args.devices))):
        raise ValueError(
            "over several hosts, --devices without --tensor-parallel-size must list each host's "
            f"devices from 0 (0,1,...), got {','.join(map(str, args.devices))}"
        )
    return None


def _mm_limit(text: str) -> int:
    """``--limit-mm-per-prompt``: ``N`` or ``{"image": N}`` (other modalities are refused)."""
    value: Any = text
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None
        if not isinstance(value, dict) or set(value) - {"image"}:
            raise argparse.ArgumentTypeError('only images are limited: {"image": N}')
        value = value.get("image", MAX_IMAGES_PER_PROMPT)
    try:
        limit = int(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a count of images: {text!r}") from None
    if limit < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {limit}")
    return limit


def _config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_id=args.model_id or DEFAULT_MODEL_ID,
        weight_file=args.weight_file,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        max_model_len=args.max_model_len,
        kvcache_mem_mb=args.kvcache_mem_mb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
        matmul_backend=args.matmul_backend,
        layer_loop=args.layer_loop,
        page_size=args.page_size,
        prefill_chunk_size=args.prefill_chunk_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_steps=args.decode_steps,
        precompile=args.precompile,
        async_scheduling=args.async_scheduling,
        isq=args.isq,
        kv_cache_dtype=args.kv_cache_dtype,
        matmul_dtype=args.matmul_dtype,
        seed=args.seed,
        prefix_cache=args.prefix_cache,
        tensor_parallel_size=_tensor_parallel_size(args),
        data_parallel_size=args.data_parallel_size,
        devices=_devices(args),
        expert_parallel=args.expert_parallel,
        num_experts_offload_per_rank=args.num_experts_offload_per_rank,
        debug_fill_freed_pages=args.debug_fill_freed_pages,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
    )


def _engine_configs(args: argparse.Namespace) -> tuple[EngineConfig, ...]:
    """One engine config per model to serve: the flags', or each of ``--models-config`` over
    them. ValueError for a bad value or file, or a flag that names the model beside the file."""
    base = _config_from_args(args)
    if args.models_config is None:
        return (base,)
    naming = {
        "--weight-path": args.weight_path,
        "--model-id": args.model_id,
        "--weight-file": args.weight_file,
        "--served-model-name": args.served_model_name,
    }
    given = [flag for flag, value in naming.items() if value is not None]
    if given:
        raise ValueError(
            f"{given[0]} cannot be combined with --models-config (or ${MODELS_CONFIG_ENV}, "
            f"${CANDLE_VLLM_MODELS_CONFIG_ENV}): the "
            "file names each model and its source"
        )
    return load_models_config(args.models_config, base)


def _configure_logging(args: argparse.Namespace) -> None:
    """Logs to --log's file (bare --log or none: stderr) from --log-level up."""
    handler: logging.Handler = (
        logging.FileHandler(args.log, encoding="utf-8") if args.log else logging.StreamHandler()
    )
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=LOG_LEVELS[args.log_level], handlers=[handler], force=True)


def _start_logging(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        _configure_logging(args)
    except OSError as exc:
        parser.error(f"cannot open log file {args.log}: {exc}")  # exits with status 2


def _build_engine(config: EngineConfig, mock: bool) -> EngineClient:
    if mock:
        from jax_llm_runtime.runtime.engine.mock import MockEngine

        return MockEngine(
            model_name=config.served_model_name or config.model_id,
            max_model_len=config.max_model_len or 2048,
            max_num_seqs=config.max_num_seqs,
            max_waiting=config.max_waiting,
        )
    from jax_llm_runtime.runtime.loading.builder import build_engine

    return build_engine(config)


def _load_models(configs: Sequence[EngineConfig], args: argparse.Namespace) -> list[ServedModel]:
    """Each model's engine, with its sampling defaults: the flags over its generation_config.
    A model of ``--models-config`` that cannot be loaded is a ValueError naming it."""
    from jax_llm_runtime.api.service.served_models import ServedModel
    from jax_llm_runtime.runtime.loading.sources import ModelSourceError

    flags = sampling_flags(args)
    models = []
    for config in configs:
        try:
            engine = _build_engine(config, args.mock_engine)
            defaults = None
            if not args.mock_engine:
                defaults = flags.over(generation_config_defaults(config.model_id))
        except (ModelSourceError, ValueError, OSError) as exc:
            if args.models_config is None:
                raise
            name = config.served_model_name
            raise ValueError(f"{args.models_config}: model {name!r}: {exc}") from None
        models.append(ServedModel(engine, defaults))
    return models


def _serve(
    models: list[ServedModel],
    host: str,
    port: int,
    server: ServerConfig,
    shutdown_timeout_s: int,
    uds: str | None = None,
) -> bool:
    """Run uvicorn until SIGTERM or Ctrl-C; False when the app failed to start (engine error).
    ``uds``: a unix socket's path to serve on instead of ``host`` and ``port``."""
    from jax_llm_runtime.api.cli.server import serve

    return serve(models, host, port, server, shutdown_timeout_s, STARTED, uds)


def _checked_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[tuple[EngineConfig, ...], ClusterConfig]:
    """The engine and cluster configs of valid flags (a bad value: one line, exit status 2), after
    one warning line for each candle-vllm flag that is ignored."""
    try:
        warnings = resolve_compat_flags(args)
        _check_save_prepared(args)
        configs = _engine_configs(args)
        cluster = cluster_config(args)
        if args.uds is not None and cluster.leads:  # only rank 0 serves HTTP
            check_unix_socket_path(args.uds)
        server_config(args)  # validate the service flags before loading anything
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2
    for warning in warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    return configs, cluster


def _check_save_prepared(args: argparse.Namespace) -> None:
    if args.save_prepared is None:
        return
    if args.models_config is not None:
        raise ValueError("--save-prepared writes one model; it cannot be used with --models-config")
    if args.mock_engine:
        raise ValueError("--save-prepared needs a model; drop --mock-engine")


def _save_prepared(config: EngineConfig, args: argparse.Namespace, cluster: ClusterConfig) -> int:
    """``--save-prepared DIR``: load the model, write it to DIR and exit (status 0; an error is
    one line and status 1). Every node of a multi-node run writes its own shards."""
    from jax_llm_runtime.runtime.loading.prepared import save_prepared
    from jax_llm_runtime.runtime.loading.sources import ModelSourceError
    from jax_llm_runtime.runtime.parallel.multihost import ClusterError, finish, initialize
    from jax_llm_runtime.runtime.platform import DeviceUnavailableError, select_platform

    try:
        initialize(cluster)
        if args.device is not None:
            select_platform(args.device)
        path = save_prepared(config, args.save_prepared)
    except (ModelSourceError, DeviceUnavailableError, ClusterError, ValueError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finish(cluster)
    print(f"Prepared {config.model_id} in {path}; serve it with --model-id {path}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``runtime-serve``; returns the process exit status."""
    try:
        load_env_file()  # before the parser: flag defaults read the environment
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    configs, cluster = _checked_flags(parser, args)
    _start_logging(parser, args)
    if args.save_prepared is not None:
        return _save_prepared(configs[0], args, cluster)
    from jax_llm_runtime.runtime.loading.sources import ModelSourceError
    from jax_llm_runtime.runtime.parallel.multihost import (
        ClusterError,
        Leader,
        finish,
        follow,
        initialize,
    )
    from jax_llm_runtime.runtime.platform import DeviceUnavailableError, select_platform

    leader: Leader | None = None
    try:
        initialize(cluster)  # before anything else uses JAX
        if args.device is not None:
            select_platform(args.device)
        models = _load_models(configs, args)
        server = server_config(args)
        if cluster.multi and not cluster.leads:
            follow(cluster, models[0].engine)  # until rank 0 says stop
            models[0].engine.shutdown()
            finish(cluster)
            return 0
        if cluster.multi:
            leader = Leader.accept(cluster)
            leader.attach(models[0].engine)
    except (ModelSourceError, DeviceUnavailableError, ClusterError, ValueError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    from jax_llm_runtime.api.mcp.client import McpStartupError
    from jax_llm_runtime.api.ui.port_server import UiPortError

    try:
        started = _serve(models, args.host, args.port, server, args.shutdown_timeout, args.uds)
        return 0 if started else 1
    except (McpStartupError, UiPortError, UnixSocketError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        return 130
    finally:
        if leader is not None:
            leader.close()
            finish(cluster)


if __name__ == "__main__":
    sys.exit(main())
