"""One context-length rule (``check_context``), checked once, where a prompt is submitted to the
engine: the HTTP layer only lowers a budget to the room the prompt leaves, and turns the engine's
refusal into OpenAI's 400 naming the request's prompt field."""

from __future__ import annotations

import pytest

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
    [(None, 10, 6), (6, 10, 6), (1, 15, 1), (7, 10, 6), (16384, 15, 1), (None, 16, 1), (3, 20, 3)],
)
def test_the_api_budget_is_lowered_to_the_room_left(requested, prompt_len, expected) -> None:
    """Within the context as asked; beyond it, lowered to the room the prompt leaves; a prompt
    that leaves no room keeps a budget the engine's rule then refuses."""
    assert resolve_max_tokens(requested, prompt_len, 16) == expected
