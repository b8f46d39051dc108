"""Host-side owner of the KV cache pages: free list, reference counts, the prefix cache.

Pages are shared by reference count; a page returns to the free list when its last user releases
it. A full page can be registered under its prefix hash (SHA-256 chained over the previous page's
hash and this page's token ids): another sequence whose tokens hash the same reuses it instead of
computing it again. Registered pages keep their contents on the free list until they are handed
out again, least recently freed first (LRU eviction), so a finished request's prefix stays
reusable until the memory is needed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


def page_hash(parent: bytes | None, token_ids: Sequence[int], extra: Sequence[bytes] = ()) -> bytes:
    """SHA-256 of a full page's tokens chained to the hash of the page before it; ``extra``
    are the digests of the images whose soft tokens the page holds (their placeholder tokens
    are alike for every image), so that pages of different images never match."""
    h = hashlib.sha256(parent or b"")
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    for digest in extra:
        h.update(digest)
    return h.digest()


class PageAllocator:
    """Allocates physical page ids in ``[0, num_pages)``."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Unreferenced pages, least recently freed first; registered ones still hold their prefix.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._ref_counts = [0] * num_pages
        self._hash_of_page: dict[int, bytes] = {}
        self._page_of_hash: dict[bytes, int] = {}
        # Pages handed out by ``allocate`` since ``take_fresh`` (their contents are stale).
        self._fresh: list[int] = []
        self.track_fresh = False

    @property
    def num_free(self) -> int:
        """Pages that ``allocate`` can hand out (free cached prefixes included)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Free pages that still hold a registered prefix."""
        return sum(1 for page in self._free if page in self._hash_of_page)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (reference count 1 each), evicting the least recently freed."""
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popitem(last=False)[0] for _ in range(n)]
        for page in pages:
            self._forget_hash(page)
            self._ref_counts[page] = 1
        if self.track_fresh:
            self._fresh += pages
        return pages

    def share(self, page: int) -> None:
        """Add a user to an allocated page, or take a free page that holds a cached prefix."""
        if self._ref_counts[page] < 1:
            if page not in self._hash_of_page or page not in self._free:
                raise ValueError(f"page {page} is not allocated")
            del self._free[page]
        self._ref_counts[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page, in order; unreferenced pages go to the back of the
        free list (callers pass a sequence's pages last first, so its prefix outlives its tail)."""
        for page in pages:
            if self._ref_counts[page] < 1:
                raise ValueError(f"page {page} freed more often than allocated")
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free[page] = None

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def register_full_page(self, page: int, digest: bytes) -> None:
        """Record that ``page`` holds the full page whose prefix hash is ``digest`` (the first
        page registered under a digest keeps it)."""
        if self._ref_counts[page] < 1:
            raise ValueError(f"page {page} is not allocated")
        if self._hash_of_page.get(page) == digest:
            return
        self._forget_hash(page)
        self._hash_of_page[page] = digest
        self._page_of_hash.setdefault(digest, page)

    def lookup(self, digest: bytes) -> int | None:
        """A page holding the prefix ``digest``, in use or free but not yet handed out again."""
        return self._page_of_hash.get(digest)

    def take_fresh(self) -> list[int]:
        """The pages ``allocate`` handed out since the last call (``track_fresh`` only)."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def _forget_hash(self, page: int) -> None:
        digest = self._hash_of_page.pop(page, None)
        if digest is not None and self._page_of_hash.get(digest) == page:
            del self._page_of_hash[digest]
