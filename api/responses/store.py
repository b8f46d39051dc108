"""Recent /v1/responses results, so ``previous_response_id`` can continue a conversation.

A bounded in-memory LRU map (``RESPONSE_STORE_SIZE`` entries, per app): the oldest unused
response is forgotten first, and a restart forgets them all, after which such an id is a 400
(``previous_response_not_found``), as OpenAI answers for one it does not know.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from jax_llm_runtime.api.protocol.bodies import ChatMessage

RESPONSE_STORE_SIZE = 1024


@dataclass(frozen=True)
class StoredResponse:
    """A finished response's whole conversation as chat messages (its ``instructions`` aside,
    which OpenAI does not carry over either)."""

    messages: tuple[ChatMessage, ...]


class ResponseStore:
    """An LRU map from response id to ``StoredResponse``. Used from the event loop only."""

    def __init__(self, capacity: int = RESPONSE_STORE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, now the most recently used; None when unknown or forgotten."""
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep ``stored``, forgetting the least recently used entry past the capacity."""
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
