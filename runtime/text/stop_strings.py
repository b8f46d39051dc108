"""Stop strings (the OpenAI ``stop`` field), matched on the text of a generation's deltas.

The sampler stops on token ids; a stop *string* can span several tokens, so it is matched on the
text, once, where the engine turns a sequence's tokens into text (``runtime.engine.core``):

1. ``OutputText.feed`` takes each delta's detokenized text and its tokens' logprobs and gives back
   what can be handed out now. Text that could still turn out to be the start of a stop string is
   held back, so a streaming caller never sees part of a stop string.
2. A token's logprobs are held until all of its text has been handed out (``LogprobAligner``), so
   a delta carries the logprobs of the tokens whose text it completes. When a stop string cuts the
   text, tokens whose text starts before the cut are kept (their text is sent, perhaps in part)
   and tokens from the cut on are dropped, like their text.
3. When a stop string matches, the text before it is the last text handed out, the delta's
   finish reason is "stop", and the engine aborts the sequence, freeing its pages at once. When
   generation ends otherwise, ``OutputText.finish`` releases what was held.

The HTTP layer and the library both consume the engine's stream as it comes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from jax_llm_runtime.runtime.engine.request import FinishReason, TokenLogprobs


class StopStringMatcher:
    """Feeds text in, gives back what is safe to send, and says when a stop string appeared."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stop = stop
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add generated text; return the text that can be sent now.

        After a stop string matched, ``stopped`` is True, the returned text ends right before it,
        and further calls return "".
        """
        if self.stopped:
            return ""
        if not self._stop:
            return text
        pending = self._held + text
        cut = _first_match(pending, self._stop)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return pending[:cut]
        keep = _partial_suffix_len(pending, self._stop)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """The held-back text, once generation ended without a stop string."""
        held, self._held = self._held, ""
        return held


class LogprobAligner:
    """Tracks which tokens' text has been handed out; see the module docstring."""

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


class OutputText:
    """A generation's text as the engine hands it out: stop strings applied, logprobs aligned."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._matcher = StopStringMatcher(stop)
        self._aligner = LogprobAligner()

    @property
    def stopped(self) -> bool:
        """A stop string matched; nothing more is handed out."""
        return self._matcher.stopped

    def feed(
        self, text: str, logprobs: tuple[TokenLogprobs, ...]
    ) -> tuple[str, tuple[TokenLogprobs, ...]]:
        """A delta's text and logprobs in; the text and logprobs that can be handed out now."""
        self._aligner.add(text, logprobs)
        out = self._matcher.feed(text)
        if self._matcher.stopped:
            return out, self._aligner.cut(len(out))
        return out, self._aligner.release(len(out)) if out else ()

    def delta(
        self, text: str, logprobs: tuple[TokenLogprobs, ...], reason: FinishReason | None
    ) -> tuple[str, tuple[TokenLogprobs, ...], FinishReason | None]:
        """One delta's text, logprobs and finish reason as handed out: "stop" where a stop string
        matched, and what was held back released where generation ended otherwise."""
        text, logprobs = self.feed(text, logprobs)
        if self.stopped:
            return text, logprobs, FinishReason.STOP
        if reason is not None:
            held, more = self.finish()
            return text + held, logprobs + more, reason
        return text, logprobs, None

    def finish(self) -> tuple[str, tuple[TokenLogprobs, ...]]:
        """Generation ended without a stop string: the held-back text and every held logprob."""
        return self._matcher.flush(), self._aligner.flush()


def _first_match(text: str, stop: tuple[str, ...]) -> int | None:
    """The index where the earliest stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def _partial_suffix_len(text: str, stop: tuple[str, ...]) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = min(len(text), max(len(s) for s in stop) - 1)
    for size in range(longest, 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in stop):
            return size
    return 0
