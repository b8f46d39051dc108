"""Stop strings (the OpenAI ``stop`` field), applied to the text stream in the HTTP layer.

The matcher lives in ``runtime.stop_strings`` so that library callers (``runtime.library``) stop
exactly like the server does; ``api.generation`` applies it to each request's deltas.
"""

from __future__ import annotations

from runtime.stop_strings import StopStringMatcher

__all__ = ["StopStringMatcher"]
