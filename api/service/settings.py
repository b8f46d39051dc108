"""The HTTP server's settings: names, auth, CORS, request caps and server-side sampling defaults.

Precedence for a sampling setting: the request's field > the ``runtime-serve`` flag > the model's
``generation_config.json`` > OpenAI's default. ``SamplingDefaults.over`` layers the flag values
over the generation_config ones; ``api.protocol.bodies.defaults`` fills a request's absent fields from the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from jax_llm_runtime.api.mcp.config import McpServerConfig
from jax_llm_runtime.api.ui.settings import UiConfig
from jax_llm_runtime.runtime.engine.request import PENALTY_WINDOW

DEFAULT_MAX_N = 16
DEFAULT_MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 2**20
DEFAULT_REQUEST_READ_TIMEOUT_S = 60.0
DEFAULT_RESPONSE_WRITE_TIMEOUT_S = 30.0
DEFAULT_MCP_MAX_ROUNDS = 8
DEFAULT_MCP_TIMEOUT_S = 60.0
DEFAULT_MCP_MAX_OUTPUT_BYTES = 64 * 1024
# "auto" and the names of api.tool_calling.parsers.PARSERS (kept literal: config must not import the API).
TOOL_PARSERS = (
    "auto",
    "hermes",
    "mistral",
    "llama3_json",
    "llama3_function",
    "json",
    "qwen3_coder",
    "glm45",
    "minimax_m2",
    "gemma4",
    "openai",
)

# generation_config.json key -> SamplingDefaults field (HF transformers' names).
_GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """Values used when a request omits the field; ``None`` leaves OpenAI's default in place.

    ``max_tokens`` is the default completion budget (candle-vllm's ``--max-gen-tokens``), still
    capped by what the context leaves after the prompt. ``enable_thinking`` reaches a chat
    template that reads it (candle-vllm's ``--thinking``) unless the request decides it itself.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    max_tokens: int | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None
    enable_thinking: bool | None = None

    def __post_init__(self) -> None:
        checks = {
            "temperature": lambda v: v >= 0,
            "top_p": lambda v: 0 < v <= 1,
            "top_k": lambda v: v >= -1,
            "min_p": lambda v: 0 <= v <= 1,
            "frequency_penalty": lambda v: -2 <= v <= 2,
            "presence_penalty": lambda v: -2 <= v <= 2,
            "max_tokens": lambda v: v >= 1,
            "repetition_penalty": lambda v: 0 < v <= 10,
            "repeat_last_n": lambda v: 0 <= v <= PENALTY_WINDOW,
            "enable_thinking": lambda v: isinstance(v, bool),
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or not ok(value)):
                raise ValueError(f"default {name} is out of range: {value}")

    def over(self, base: SamplingDefaults) -> SamplingDefaults:
        """These values where set, ``base``'s elsewhere (flags over generation_config)."""
        mine = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(base, **{k: v for k, v in mine.items() if v is not None})

    @classmethod
    def from_generation_config(cls, config: dict[str, Any]) -> SamplingDefaults:
        """The sampling values of an HF ``generation_config.json``; other keys are ignored.

        A model that does not sample by default (``do_sample`` false) gets temperature 0 unless
        the file sets none of the sampling values. Values out of range raise ValueError.
        """
        values: dict[str, Any] = {}
        for key, name in _GENERATION_CONFIG_KEYS.items():
            value = config.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
        if values.get("top_k") == 0:
            values.pop("top_k")  # HF's "disabled"; our default already disables it
        if config.get("do_sample") is False and "temperature" in values:
            values["temperature"] = 0.0
        return cls(**values)


DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20
DEFAULT_MEDIA_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaConfig:
    """Where a request's image URLs may point (``api.generation.media``): ``data:`` URLs
    always; ``http(s)`` only to ``allowed_domains`` (exact host names, vLLM's
    ``--allowed-media-domains``); ``file:`` only under ``allowed_local_path`` (vLLM's
    ``--allowed-local-media-path``). ``max_image_bytes`` caps one image's encoded size and
    ``fetch_timeout_s`` one fetch."""

    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    fetch_timeout_s: float = DEFAULT_MEDIA_FETCH_TIMEOUT_S

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "allowed_domains", tuple(d.strip().lower() for d in self.allowed_domains)
        )
        if any(not d or "/" in d for d in self.allowed_domains):
            raise ValueError(
                f"allowed media domains must be host names, got {self.allowed_domains}"
            )
        if self.max_image_bytes < 1:
            raise ValueError(f"max_image_bytes must be >= 1, got {self.max_image_bytes}")
        if not (math.isfinite(self.fetch_timeout_s) and self.fetch_timeout_s > 0):
            raise ValueError(f"fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``create_app`` needs besides the engine.

    ``served_model_names``: names requests may use; the first is reported in responses. Empty
    means the engine's ``model_name`` only. ``api_key``: when set, ``/v1/*``, ``/tokenize`` and
    ``/detokenize`` need ``Authorization: Bearer <key>``. ``allowed_origins``: CORS is off when
    empty. ``max_completion_tokens_cap``: None means ``max_model_len``. ``mcp_servers``: the MCP
    servers connected at startup (``api.mcp.client.client``); ``mcp_max_rounds``: how many model turns of MCP
    calls one /v1/responses request may run; ``mcp_timeout_s`` bounds each call and
    ``mcp_max_output_bytes`` each result. ``ui``: the web chat UI's settings (``api.ui``); None
    serves no UI. ``request_read_timeout_s``: how long a request's head and body together may
    take to arrive, ``response_write_timeout_s`` how long a client may leave its response unread
    before its connection is closed and its request aborted (0: for ever; both
    ``api.cli.http_protocol``). ``media``: where image URLs may point (``MediaConfig``).
    """

    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_n: int = DEFAULT_MAX_N
    max_completion_tokens_cap: int | None = None
    max_top_logprobs: int = DEFAULT_MAX_TOP_LOGPROBS
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    response_write_timeout_s: float = DEFAULT_RESPONSE_WRITE_TIMEOUT_S
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    tool_parser: str = "auto"  # a name of api.tool_calling.parsers.PARSERS, or "auto"
    mcp_servers: tuple[McpServerConfig, ...] = ()
    mcp_max_rounds: int = DEFAULT_MCP_MAX_ROUNDS
    mcp_timeout_s: float = DEFAULT_MCP_TIMEOUT_S
    mcp_max_output_bytes: int = DEFAULT_MCP_MAX_OUTPUT_BYTES
    ui: UiConfig | None = None
    media: MediaConfig = field(default_factory=MediaConfig)
    # False: with one model served, a request naming another is answered by it (candle-vllm's
    # and llama.cpp's behaviour; their clients send any name); True: such a name is a 404.
    strict_model_names: bool = False

    def __post_init__(self) -> None:
        self._check_mcp()
        if self.tool_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_parser!r}"
            )
        if any(not name for name in self.served_model_names):
            raise ValueError("served model names must not be empty")
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError(f"served model names repeat: {list(self.served_model_names)}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key must not be empty or blank")
        if any(not origin for origin in self.allowed_origins):
            raise ValueError("allowed origins must not be empty")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_completion_tokens_cap is not None and self.max_completion_tokens_cap < 1:
            raise ValueError(
                f"max_completion_tokens_cap must be >= 1, got {self.max_completion_tokens_cap}"
            )
        if self.max_top_logprobs < 0:
            raise ValueError(f"max_top_logprobs must be >= 0, got {self.max_top_logprobs}")
        if self.max_request_body_bytes < 1024:
            raise ValueError(
                f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}"
            )
        if not (math.isfinite(self.request_read_timeout_s) and self.request_read_timeout_s > 0):
            raise ValueError(
                f"request_read_timeout_s must be > 0, got {self.request_read_timeout_s}"
            )
        write_timeout_s = self.response_write_timeout_s
        if not (math.isfinite(write_timeout_s) and write_timeout_s >= 0):
            raise ValueError(f"response_write_timeout_s must be >= 0, got {write_timeout_s}")

    def _check_mcp(self) -> None:
        names = [server.name for server in self.mcp_servers]
        if len(set(names)) != len(names):
            raise ValueError(f"MCP server names repeat: {names}")
        if self.mcp_max_rounds < 1:
            raise ValueError(f"mcp_max_rounds must be >= 1, got {self.mcp_max_rounds}")
        if not (math.isfinite(self.mcp_timeout_s) and self.mcp_timeout_s > 0):
            raise ValueError(f"mcp_timeout_s must be > 0, got {self.mcp_timeout_s}")
        if self.mcp_max_output_bytes < 256:
            raise ValueError(
                f"mcp_max_output_bytes must be >= 256, got {self.mcp_max_output_bytes}"
            )

    def model_names(self, engine_model_name: str) -> tuple[str, ...]:
        """The accepted names, the reported one first."""
        return self.served_model_names or (engine_model_name,)
