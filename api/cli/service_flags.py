"""``runtime-serve`` flags for the HTTP service (auth, CORS, caps) and server sampling defaults,
turned into a ``ServerConfig``; ``api.cli.serve.serve`` adds them to its parser.

Sampling precedence: request field > these flags > the model's ``generation_config.json`` (HF
folders and cached hub repos; GGUF files have none) > OpenAI's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from jax_llm_runtime.api.mcp.config import load_mcp_config
from jax_llm_runtime.api.service.settings import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_N,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_TOP_LOGPROBS,
    DEFAULT_MCP_MAX_ROUNDS,
    DEFAULT_MCP_TIMEOUT_S,
    DEFAULT_REQUEST_READ_TIMEOUT_S,
    DEFAULT_RESPONSE_WRITE_TIMEOUT_S,
    TOOL_PARSERS,
    MediaConfig,
    SamplingDefaults,
    ServerConfig,
)
from jax_llm_runtime.api.ui.settings import add_ui_flags, ui_config

API_KEY_ENV = "RUNTIME_API_KEY"
MCP_CONFIG_ENV = "RUNTIME_MCP_CONFIG"
CANDLE_VLLM_MCP_CONFIG_ENV = "CANDLE_VLLM_MCP_CONFIG"  # read when $RUNTIME_MCP_CONFIG is unset


def _on_off(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


# (flags, type, SamplingDefaults field, help); the first flag is ours, the others candle-vllm's.
_SAMPLING_FLAGS: tuple[tuple[tuple[str, ...], Any, str, str], ...] = (
    (("--temperature",), float, "temperature", "default temperature"),
    (("--top-p",), float, "top_p", "default top_p"),
    (("--top-k",), int, "top_k", "default top_k"),
    (("--min-p",), float, "min_p", "default min_p"),
    (("--frequency-penalty",), float, "frequency_penalty", "default frequency_penalty"),
    (("--presence-penalty",), float, "presence_penalty", "default presence_penalty"),
    (
        ("--repetition-penalty", "--penalty"),
        float,
        "repetition_penalty",
        "default repetition_penalty (1 = none; candle-vllm's --penalty)",
    ),
    (
        ("--repeat-last-n",),
        int,
        "repeat_last_n",
        "default repeat_last_n: the penalties look at the last N tokens only (0 = the last 1024)",
    ),
    (
        ("--max-gen-tokens",),
        int,
        "max_tokens",
        "default completion budget when a request sets no max_tokens",
    ),
)


def add_service_flags(parser: argparse.ArgumentParser) -> None:
    """The ``service`` and ``sampling defaults`` flag groups."""
    add = parser.add_argument_group("service").add_argument
    _add_access_flags(add)
    add("--max-n", type=int, default=DEFAULT_MAX_N, help="largest `n` (default: %(default)s)")
    add(
        "--max-completion-tokens-cap",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for (default: max_model_len)",
    )
    add(
        "--max-top-logprobs",
        type=int,
        default=DEFAULT_MAX_TOP_LOGPROBS,
        help="largest `top_logprobs` (default: %(default)s)",
    )
    add(
        "--tool-parser",
        "--tool-call-parser",  # vLLM's spelling; the names are vLLM's too
        choices=TOOL_PARSERS,
        default="auto",
        help="how tool calls are read from replies: auto = the format the chat template names "
        "(hermes for <tool_call>, mistral for [TOOL_CALLS], llama3_json for <|python_tag|>, "
        "qwen3_coder for <function=..><parameter=..>, glm45 for <arg_key>, minimax_m2 for "
        "<minimax:tool_call>, gemma4 for <|tool_call>call:, openai for gpt-oss's harmony "
        "channels), or json with the tools described in a system message when it names none "
        "(default: %(default)s)",
    )
    add(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are a 413 (default: %(default)s)",
    )
    add(
        "--request-read-timeout",
        type=float,
        default=DEFAULT_REQUEST_READ_TIMEOUT_S,
        metavar="SECONDS",
        help="a request whose head and body have not all arrived this long after it began "
        "(or after the connection opened) is a 408 and its connection is closed, so slow or "
        "stalled senders cannot hold connections open (default: %(default)s)",
    )
    add(
        "--response-write-timeout",
        type=float,
        default=DEFAULT_RESPONSE_WRITE_TIMEOUT_S,
        metavar="SECONDS",
        help="a client that takes none of its response for this long once the server's send "
        "buffer is full (a stream it does not read) has its connection closed and its request "
        "aborted, freeing its KV pages; 0: never (default: %(default)s)",
    )
    _add_media_flags(parser.add_argument_group("images").add_argument)
    _add_mcp_flags(parser.add_argument_group("MCP").add_argument)
    add_ui_flags(parser)
    _add_sampling_default_flags(parser)


def _add_media_flags(add: Any) -> None:
    """Where image URLs may point (``api.generation.media``); data: URLs always work."""
    add(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="HOST",
        help="hosts whose http(s) image URLs the server fetches (no redirects; default: none, "
        "only data: URLs)",
    )
    add(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="a folder whose files file:// image URLs may name (default: file URLs are off)",
    )
    add(
        "--max-image-bytes",
        type=int,
        default=DEFAULT_MAX_IMAGE_BYTES,
        help="largest encoded image (default: %(default)s; a data: URL also counts against "
        "--max-request-body-bytes)",
    )


def _add_sampling_default_flags(parser: argparse.ArgumentParser) -> None:
    """The ``sampling defaults`` group: a value for each field a request may omit."""
    group = parser.add_argument_group(
        "sampling defaults",
        "used when a request omits the field; they win over the model's generation_config",
    )
    for flags, kind, dest, help_text in _SAMPLING_FLAGS:
        group.add_argument(*flags, dest=f"default_{dest}", type=kind, default=None, help=help_text)
    group.add_argument(
        "--thinking",
        dest="default_enable_thinking",
        type=_on_off,
        nargs="?",
        const=True,
        default=None,
        metavar="true|false",
        help="default enable_thinking of chat templates that read it (Qwen3 and the like) for "
        "requests that do not set thinking themselves; bare --thinking = true "
        "(default: the template's own)",
    )


def _add_access_flags(add: Any) -> None:
    """Who may call the API, from which origins, and under which model names."""
    add(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require `Authorization: Bearer <key>` on /v1/*, /tokenize and /detokenize "
        f"(default: ${API_KEY_ENV}, else no key)",
    )
    add(
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGINS",
        help="enable CORS for these origins (comma list, repeatable; '*' for any); default: off",
    )
    add(
        "--strict-model-names",
        action="store_true",
        help="a request naming no served model is a 404; by default a server of one model "
        "answers any name with it, as candle-vllm and llama.cpp do (--models-config is strict)",
    )


def _add_mcp_flags(add: Any) -> None:
    add(
        "--mcp-config",
        default=os.environ.get(MCP_CONFIG_ENV) or os.environ.get(CANDLE_VLLM_MCP_CONFIG_ENV),
        metavar="PATH",
        help='connect to the MCP servers of this mcp.json ({"mcpServers": {name: {"command", '
        '"args", "env"} or {"url", "headers"}}}) at startup; their tools, named '
        "<server>__<tool>, go to chat and responses requests that send no tools, and "
        f"/v1/responses runs them (default: ${MCP_CONFIG_ENV}, else "
        f"${CANDLE_VLLM_MCP_CONFIG_ENV}, else none)",
    )
    add(
        "--mcp-max-rounds",
        type=int,
        default=DEFAULT_MCP_MAX_ROUNDS,
        help="most model turns with MCP calls in one /v1/responses request; the turn after "
        "them answers without tools (default: %(default)s)",
    )
    add(
        "--mcp-timeout",
        type=float,
        default=DEFAULT_MCP_TIMEOUT_S,
        metavar="S",
        help="most seconds one MCP tool call may take; a call that takes longer fails and the "
        "model is told (default: %(default)s)",
    )


def sampling_flags(args: argparse.Namespace) -> SamplingDefaults:
    """The sampling defaults the flags set (ValueError when out of range)."""
    values = {dest: getattr(args, f"default_{dest}") for _, _, dest, _ in _SAMPLING_FLAGS}
    return SamplingDefaults(**values, enable_thinking=args.default_enable_thinking)


def _origins(values: list[str]) -> tuple[str, ...]:
    return tuple(o.strip() for value in values for o in value.split(",") if o.strip())


def server_config(
    args: argparse.Namespace, generation_defaults: SamplingDefaults | None = None
) -> ServerConfig:
    """The ``ServerConfig`` for parsed flags (ValueError on a bad combination or value)."""
    defaults = sampling_flags(args)
    if generation_defaults is not None:
        defaults = defaults.over(generation_defaults)
    names = args.served_model_name or []
    ui = ui_config(args)
    return ServerConfig(
        served_model_names=tuple(names),
        api_key=args.api_key or None,
        allowed_origins=_origins(args.allowed_origins) + (ui.cors_origins() if ui else ()),
        max_n=args.max_n,
        max_completion_tokens_cap=args.max_completion_tokens_cap,
        max_top_logprobs=args.max_top_logprobs,
        tool_parser=args.tool_parser,
        max_request_body_bytes=args.max_request_body_bytes,
        request_read_timeout_s=args.request_read_timeout,
        response_write_timeout_s=args.response_write_timeout,
        sampling_defaults=defaults,
        mcp_servers=load_mcp_config(args.mcp_config) if args.mcp_config else (),
        mcp_max_rounds=args.mcp_max_rounds,
        mcp_timeout_s=args.mcp_timeout,
        ui=ui,
        media=MediaConfig(
            allowed_domains=tuple(args.allowed_media_domains),
            allowed_local_path=args.allowed_local_media_path,
            max_image_bytes=args.max_image_bytes,
        ),
        strict_model_names=args.strict_model_names
        or getattr(args, "models_config", None) is not None,
    )


def _generation_config_path(model_id: str) -> Path | None:
    folder = Path(model_id).expanduser()
    if folder.is_dir():
        path = folder / "generation_config.json"
        return path if path.is_file() else None
    if folder.suffix == ".gguf" or model_id.count("/") != 1:
        return None  # GGUF files and packaged aliases carry no generation_config
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model_id, "generation_config.json")
    return Path(cached) if isinstance(cached, str) else None


def generation_config_defaults(model_id: str) -> SamplingDefaults:
    """The model's ``generation_config.json`` sampling values (empty when it has none).

    Raises ValueError when the file is not valid JSON or holds out-of-range values.
    """
    path = _generation_config_path(model_id)
    if path is None:
        return SamplingDefaults()
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    try:
        return SamplingDefaults.from_generation_config(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
