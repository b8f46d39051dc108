"""Server-side defaults and caps applied to a decoded request before it becomes SamplingParams.

``with_sampling_defaults`` fills the request fields a client left out (``None``) from the server's
``SamplingDefaults``, so ``build_sampling`` sees one body and needs no knowledge of where a value
came from. ``completion_budget`` is the ``max_tokens`` to ask for: the request's (refused above
``--max-completion-tokens-cap``), else the server default, else the endpoint's fallback.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TypeVar

import msgspec

from jax_llm_runtime.api.protocol.errors import bad_request
from jax_llm_runtime.api.service.settings import SamplingDefaults, ServerConfig

B = TypeVar("B", bound=msgspec.Struct)

# max_tokens is not filled here: a default budget is clamped to the context, see completion_budget.
_FILLED = tuple(f.name for f in fields(SamplingDefaults) if f.name != "max_tokens")


def _decides_thinking(body: msgspec.Struct) -> bool:
    """Whether the request sets thinking itself (``thinking`` or in ``chat_template_kwargs``), so
    that a server default ``enable_thinking`` would contradict it."""
    kwargs = getattr(body, "chat_template_kwargs", None) or {}
    return getattr(body, "thinking", None) is not None or bool(
        {"enable_thinking", "thinking"} & set(kwargs)
    )


def with_sampling_defaults(body: B, defaults: SamplingDefaults) -> B:
    """``body`` with each absent sampling field set to the server default (when there is one)."""
    changes = {
        name: getattr(defaults, name)
        for name in _FILLED
        if getattr(defaults, name) is not None
        and name in body.__struct_fields__
        and getattr(body, name) is None
    }
    if "enable_thinking" in changes and _decides_thinking(body):
        del changes["enable_thinking"]
    return msgspec.structs.replace(body, **changes) if changes else body


def completion_budget(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    config: ServerConfig,
    fallback: int | None,
) -> int | None:
    """The completion budget to resolve against the context (``None``: all the context leaves).

    A request above ``max_completion_tokens_cap`` is a 400 naming ``max_tokens``. Without a
    requested value the server default (else ``fallback``) is used, clamped to the room the
    prompt leaves and to the cap, so a server default never turns a request into an error.
    """
    cap = config.max_completion_tokens_cap
    if requested is not None:
        if cap is not None and requested > cap:
            raise bad_request(
                f"max_tokens is {requested}, above this server's cap of {cap} completion tokens.",
                param="max_tokens",
                code="max_tokens_too_large",
            )
        return requested
    default = config.sampling_defaults.max_tokens or fallback
    if default is None and cap is None:
        return None
    room = max(1, max_model_len - prompt_len)
    return min(x for x in (default, cap, room) if x is not None)
