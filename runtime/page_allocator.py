"""Host-side owner of the KV cache pages: free list, reference counts, prefix hashes.

Pages are shared by reference count (a full page whose tokens hash to a known prefix can be reused
by another sequence); a page returns to the free list when its last user releases it.
Prefix hashes chain SHA-256 over the previous page's hash and this page's token ids.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


def page_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """SHA-256 of a full page's tokens chained to the hash of the page before it."""
    h = hashlib.sha256(parent or b"")
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    return h.digest()


class PageAllocator:
    """Allocates physical page ids in ``[0, num_pages)``."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._ref_counts = [0] * num_pages
        self._hash_of_page: dict[int, bytes] = {}
        self._page_of_hash: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (reference count 1 each)."""
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            self._forget_hash(page)
            self._ref_counts[page] = 1
        return pages

    def share(self, page: int) -> None:
        """Add a user to an allocated page."""
        if self._ref_counts[page] < 1:
            raise ValueError(f"page {page} is not allocated")
        self._ref_counts[page] += 1

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; unreferenced pages go back on the free list."""
        for page in pages:
            if self._ref_counts[page] < 1:
                raise ValueError(f"page {page} freed more often than allocated")
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free.append(page)

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def register_full_page(self, page: int, digest: bytes) -> None:
        """Record that ``page`` holds the full page whose prefix hash is ``digest``."""
        self._forget_hash(page)
        self._hash_of_page[page] = digest
        self._page_of_hash.setdefault(digest, page)

    def lookup(self, digest: bytes) -> int | None:
        """A page holding the prefix ``digest``, if one is still allocated."""
        page = self._page_of_hash.get(digest)
        if page is None or self._ref_counts[page] < 1:
            return None
        return page

    def _forget_hash(self, page: int) -> None:
        digest = self._hash_of_page.pop(page, None)
        if digest is not None and self._page_of_hash.get(digest) == page:
            del self._page_of_hash[digest]
