"""Per-token logprobs in the HTTP layer: kept aligned with the text that is sent, and formatted.

1. The engine attaches a ``TokenLogprobs`` to each generated token (see ``runtime.engine.request``).
2. ``LogprobAligner`` holds a token's logprobs until the stop-string matcher has released all of
   its text, so a streamed chunk carries the logprobs of the tokens whose text it completes. When
   a stop string cuts the text, tokens whose text starts before the cut are kept (their text is
   sent, perhaps in part) and tokens from the cut on are dropped, like their text.
3. ``chat_logprobs`` / ``completion_logprobs`` render them in OpenAI's chat and legacy formats. A
   token's text is ``decode([id])`` with special tokens shown, and ``bytes`` its UTF-8 bytes; a
   banned token's ``-inf`` is reported as -9999.0, as JSON has no infinity.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from jax_llm_runtime.api.protocol.bodies import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from jax_llm_runtime.runtime.engine.interface import TokenizerLike
from jax_llm_runtime.runtime.engine.request import TokenLogprobs

LOGPROB_FLOOR = -9999.0


class LogprobAligner:
    """Tracks which tokens' text has been released; see the module docstring."""

    def __init__(self) -> None:
        self._pending: deque[tuple[int, int, tuple[TokenLogprobs, ...]]] = deque()  # start, end
        self._fed = 0
        self._released = 0

    def add(self, text: str, logprobs: tuple[TokenLogprobs, ...]) -> None:
        """Record a delta's text (before it goes to the stop-string matcher) and its logprobs."""
        if logprobs:
            self._pending.append((self._fed, self._fed + len(text), logprobs))
        self._fed += len(text)

    def release(self, num_chars: int) -> tuple[TokenLogprobs, ...]:
        """``num_chars`` more characters were sent: the logprobs whose text is now all sent."""
        self._released += num_chars
        return self._pop(lambda start, end: end <= self._released)

    def cut(self, num_chars: int) -> tuple[TokenLogprobs, ...]:
        """A stop string matched after ``num_chars`` more characters: the tokens that started
        before the cut; the rest are dropped."""
        self._released += num_chars
        kept = self._pop(lambda start, end: start < self._released or end <= self._released)
        self._pending.clear()
        return kept

    def flush(self) -> tuple[TokenLogprobs, ...]:
        """Generation ended without a stop string: everything still held."""
        return self._pop(lambda start, end: True)

    def _pop(self, ready: Callable[[int, int], bool]) -> tuple[TokenLogprobs, ...]:
        out: list[TokenLogprobs] = []
        while self._pending and ready(*self._pending[0][:2]):
            out += self._pending.popleft()[2]
        return tuple(out)


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
