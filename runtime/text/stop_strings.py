"""Stop strings (the OpenAI ``stop`` field), matched on the text of a generation's deltas.

The engine stops on token ids; a stop *string* can span several tokens, so it is matched on the
text. Text that could still turn out to be the start of a stop string is held back, so a streaming
caller never sees part of a stop string. When one matches, the text before it is the last text
handed out and the caller closes the engine stream, which aborts the sequence and frees its pages
at once. The HTTP layer (``api.generation.stream``) and the library (``runtime.library.inference_engine``) both use this.
"""

from __future__ import annotations


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
