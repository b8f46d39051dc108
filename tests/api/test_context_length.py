"""One context-length rule (``check_context``) for the engine and the HTTP layer: the API checks
a whole request with it before submitting, and the engine checks every submission with it."""

from __future__ import annotations

import pytest

from jax_llm_runtime.api.protocol.errors import APIError
from jax_llm_runtime.api.protocol.validation import resolve_max_tokens
from jax_llm_runtime.runtime.engine.request import ContextLengthError, check_context


def test_the_rule_at_its_boundaries() -> None:
    check_context(16, 15, 1)
    check_context(16, 8, 8)
    with pytest.raises(ContextLengthError) as e:
        check_context(16, 8, 9)
    assert not e.value.prompt_too_long and isinstance(e.value, ValueError)
    assert "maximum context length is 16 tokens" in str(e.value) and "17 tokens" in str(e.value)
    with pytest.raises(ContextLengthError) as e:
        check_context(16, 16, 0)  # a prompt must leave room for one token
    assert e.value.prompt_too_long


@pytest.mark.parametrize(
    ("requested", "prompt_len", "expected"),
    [(None, 10, 6), (6, 10, 6), (1, 15, 1), (7, 10, 6), (16384, 15, 1)],
)
def test_the_api_budget_follows_the_rule(requested, prompt_len, expected) -> None:
    """Within the context as asked; beyond it, lowered to the room the prompt leaves."""
    assert resolve_max_tokens(requested, prompt_len, 16, "prompt") == expected


@pytest.mark.parametrize(
    ("requested", "prompt_len", "param"),
    [(None, 16, "messages"), (3, 20, "messages"), (7, 16, "messages")],
)
def test_the_api_error_names_the_prompt_that_leaves_no_room(requested, prompt_len, param) -> None:
    with pytest.raises(APIError) as e:
        resolve_max_tokens(requested, prompt_len, 16, "messages")
    assert e.value.status_code == 400 and e.value.param == param
    assert e.value.code == "context_length_exceeded" and "in the messages" in e.value.message
