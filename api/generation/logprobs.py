"""Per-token logprobs in the HTTP layer: kept aligned with the text that is sent, and formatted.

1. The engine attaches a ``TokenLogprobs`` to each generated token (see ``runtime.engine.request``)
   and hands each delta the logprobs of the tokens whose text it completes, stop strings applied
   (``runtime.text.stop_strings.OutputText``).
2. ``chat_logprobs`` / ``completion_logprobs`` render them in OpenAI's chat and legacy formats. A
   token's text is ``decode([id])`` with special tokens shown, and ``bytes`` its UTF-8 bytes; a
   banned token's ``-inf`` is reported as -9999.0, as JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from jax_llm_runtime.api.protocol.bodies import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from jax_llm_runtime.runtime.engine.interface import TokenizerLike
from jax_llm_runtime.runtime.engine.request import TokenLogprobs

LOGPROB_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR) if not math.isnan(logprob) else LOGPROB_FLOOR


def _token(tokenizer: TokenizerLike, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: TokenizerLike, entries: Sequence[TokenLogprobs]) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat completion (or chunk)."""
    content = []
    for entry in entries:
        text = _token(tokenizer, entry.token_id)
        top = [
            TopLogprob(_token(tokenizer, t), _value(lp), list(_token(tokenizer, t).encode()))
            for t, lp in entry.top
        ]
        content.append(ChatTokenLogprob(text, _value(entry.logprob), list(text.encode()), top))
    return ChatLogprobs(content)


def completion_logprobs(
    tokenizer: TokenizerLike, entries: Sequence[TokenLogprobs], text_offset: int = 0
) -> CompletionLogprobs:
    """``choices[i].logprobs`` of a legacy completion; offsets start at ``text_offset``.

    As in vLLM, each ``top_logprobs`` dict also holds the sampled token, so it has up to
    ``logprobs + 1`` entries. Offsets add up the token texts.
    """
    out = CompletionLogprobs([], [], [], [])
    for entry in entries:
        text = _token(tokenizer, entry.token_id)
        top = {_token(tokenizer, t): _value(lp) for t, lp in entry.top}
        top[text] = _value(entry.logprob)
        out.tokens.append(text)
        out.token_logprobs.append(_value(entry.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def echo_logprobs(
    tokenizer: TokenizerLike, prompt_ids: Sequence[int], scored: Sequence[TokenLogprobs | None]
) -> CompletionLogprobs:
    """The echoed prompt's part of ``choices[i].logprobs``: its first token has no context, so
    its ``token_logprobs`` and ``top_logprobs`` entries are null, as in OpenAI and vLLM."""
    out = CompletionLogprobs([], [], [], [])
    offset = 0
    for token_id, entry in zip(prompt_ids, scored, strict=True):
        text = _token(tokenizer, token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        top = {_token(tokenizer, t): _value(lp) for t, lp in entry.top}
        top[text] = _value(entry.logprob)
        out.token_logprobs.append(_value(entry.logprob))
        out.top_logprobs.append(top)
    return out


def concat_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """``first`` then ``second`` (whose offsets already continue after ``first``'s text)."""
    return CompletionLogprobs(
        first.tokens + second.tokens,
        first.token_logprobs + second.token_logprobs,
        first.top_logprobs + second.top_logprobs,
        first.text_offset + second.text_offset,
    )
