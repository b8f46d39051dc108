"""Request bodies to typed, checked values: decoding, unsupported fields, sampling.

Everything here raises ``APIError`` (400) with ``param`` naming the offending field, so no bad
request reaches the engine. (The model name is resolved before the route runs, by
``api.service.dependencies``.)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from jax_llm_runtime.api.protocol.bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from jax_llm_runtime.api.protocol.errors import bad_request, not_supported
from jax_llm_runtime.runtime.engine.request import SamplingParams

T = TypeVar("T")

# "... - at `$.a[0].b`", or for a dict's key "... - at `key` in `$.logit_bias`".
_LOCATION = re.compile(r"^(?P<text>.*?) - at (?P<key>`key` in )?`\$\.?(?P<path>[^`]*)`$", re.DOTALL)
_NAMED_FIELD = re.compile(r"field `(?P<field>[^`]+)`")

logger = logging.getLogger(__name__)


def decode_body(body: bytes, body_type: type[T]) -> T:
    """Decode a JSON body into ``body_type``; malformed JSON, a schema violation or nesting past
    the interpreter's recursion limit is a 400."""
    try:
        return msgspec.json.decode(body, type=body_type)
    except msgspec.ValidationError as exc:
        text, param = _split_location(str(exc))
        raise bad_request(f"Invalid request body: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # invalid UTF-8 inside a string
        raise bad_request(
            f"The request body is not valid JSON: it is not UTF-8 (byte {exc.start})"
        ) from None
    except RecursionError:  # msgspec recurses once per array or object level
        raise bad_request("The request body is nested too deeply.") from None


def _split_location(message: str) -> tuple[str, str | None]:
    """msgspec's "... - at `$.a[0].b`" to ("... at `a[0].b`", "a[0].b"), naming missing fields."""
    path = ""
    text = message
    where = "at"
    if match := _LOCATION.match(message):
        # msgspec writes a dict value as `[...]`; the dict (e.g. logit_bias) is the field at fault.
        text, path = match["text"], match["path"].replace("[...]", "")
        where = "at a key of" if match["key"] else where
    if field := _NAMED_FIELD.search(text):  # missing or unknown field: name it, not its parent
        path = f"{path}.{field['field']}" if path else field["field"]
    if not path:
        return text, None
    return f"{text} ({where} `{path}`)", path


def _is_default(value: Any, *defaults: Any) -> bool:
    return value is None or any(value == d for d in defaults)


_COMMON_DEFAULTS: dict[str, Callable[[Any], bool]] = {}
_CHAT_DEFAULTS: dict[str, Callable[[Any], bool]] = {}
_COMPLETION_DEFAULTS: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: not v,
    "best_of": lambda v: _is_default(v, 1),
}


def check_supported(body: SamplingFields) -> None:
    """400 for a field we declare but cannot honour yet, when it holds a non-default value."""
    extra = _CHAT_DEFAULTS if isinstance(body, ChatCompletionRequest) else {}
    if isinstance(body, CompletionRequest):
        extra = _COMPLETION_DEFAULTS
    for name, is_default in {**_COMMON_DEFAULTS, **extra}.items():
        if not is_default(getattr(body, name)):
            raise not_supported(name)


def resolve_n(n: int | None, max_n: int) -> int:
    """The number of choices; above the server's cap is a 400 naming ``n``."""
    n = 1 if n is None else n
    if n > max_n:
        raise bad_request(f"n must be at most {max_n} on this server, got {n}", param="n")
    return n


def check_top_logprobs(requested: int | None, cap: int, param: str) -> None:
    """More alternatives per token than the server's ``--max-top-logprobs`` is a 400."""
    if requested is not None and requested > cap:
        raise bad_request(
            f"{param} must be at most {cap} on this server, got {requested}", param=param
        )


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """The completion budget to submit: ``requested``, or all the context the prompt leaves.

    A ``max_tokens`` larger than the room the prompt leaves is lowered to that room (the
    completion then ends with ``finish_reason`` "length"), as candle-vllm and llama.cpp's server
    do: their clients send large fixed budgets (candle-vllm's ``examples/chat.py`` asks for
    16,384 tokens whatever the model). Nothing is checked here: a prompt that leaves no room is
    refused by the engine's one context rule (``runtime.engine.request.check_context``) when it
    is submitted, and ``start_generation`` turns that into a 400 naming the prompt.
    """
    room = max_model_len - prompt_len
    budget = max(room, 1) if requested is None else requested
    if budget > room > 0:
        logger.info("max_tokens %d lowered to %d, the context the prompt leaves", budget, room)
        budget = room
    return budget


def build_sampling(body: SamplingFields, max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for a checked body (OpenAI defaults: temperature 1, top_p 1)."""
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None or body.top_k < 0 else body.top_k,
            max_tokens=max_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens,
            min_p=body.min_p or 0.0,
            min_tokens=body.min_tokens or 0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            repeat_last_n=body.repeat_last_n or 0,
            logit_bias=_logit_bias(body.logit_bias),
            seed=body.seed,
            logprobs=requested_logprobs(body),
        )
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), param=field if hasattr(body, field) else None) from None


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` (JSON keys are strings) to sorted (id, bias) pairs."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            pairs.append((int(key), float(value)))
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
    return tuple(sorted(pairs))


def requested_logprobs(body: SamplingFields) -> int | None:
    """How many alternatives per token the body asks for; None when it wants no logprobs.

    Chat: ``logprobs: true`` plus ``top_logprobs`` (0..20, default 0); completions: the integer
    ``logprobs`` (0..20; OpenAI allows 0..5).
    """
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs:
            return body.top_logprobs or 0
        if body.top_logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        return None
    return getattr(body, "logprobs", None)
