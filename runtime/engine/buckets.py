"""Padding buckets: the fixed shapes every step is padded to, all compiled ahead of time."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


def _geometric(start: int, stop: int, factor: int) -> tuple[int, ...]:
    """start, start*factor, ... capped by stop, always ending with stop."""
    values, v = [], start
    while v < stop:
        values.append(v)
        v *= factor
    values.append(stop)
    return tuple(values)


def pick(buckets: tuple[int, ...], n: int) -> int:
    """Smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class BucketPlan:
    """Decode steps are ``[num_seqs, 1]``; prefill steps are ``[1, q_len]``; both gather
    ``pages`` pages per sequence.

    Page buckets double (attention reads every gathered page) and so do prefill lengths: prefill
    is compute-bound, so padding a 156-token prompt to 512 cost 3x its work. The scheduler also
    cuts prompts into chunks that fill a bucket (``fit_chunk``), so only the last chunk pads.
    """

    decode_seqs: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    pages: tuple[int, ...]
    page_size: int

    @classmethod
    def build(
        cls, max_num_seqs: int, max_model_len: int, prefill_chunk_size: int, page_size: int
    ) -> BucketPlan:
        max_pages = -(-max_model_len // page_size)
        max_chunk = min(prefill_chunk_size, max_model_len)
        return cls(
            decode_seqs=_geometric(1, max_num_seqs, 2),
            prefill_lens=_geometric(min(32, max_chunk), max_chunk, 2),
            pages=_geometric(min(16, max_pages), max_pages, 2),
            page_size=page_size,
        )

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (num_seqs, q_len, pages) that a step can have."""
        decode = [(s, 1, p) for s in self.decode_seqs for p in self.pages]
        prefill = []
        shortest = 1  # the shortest chunk that is padded to bucket q
        for q in self.prefill_lens:
            least_pages = pick(self.pages, -(-shortest // self.page_size))
            prefill += [(1, q, p) for p in self.pages if p >= least_pages]
            shortest = q + 1
        return decode + prefill


def fit_chunk(prefill_lens: tuple[int, ...], pending: int, chunk_size: int) -> int:
    """How many of ``pending`` prompt tokens the next prefill step takes: at most
    ``chunk_size``; all of them when padding them to their bucket wastes at most an eighth;
    else the largest bucket that fits, so that only the last chunk pads.

    Every step pays one pass over the weights, so a nearly full bucket beats splitting; a
    156-token prompt runs as 128 + 28 (padded to 32) instead of padded to 256.
    """
    length = min(pending, chunk_size)
    if length <= prefill_lens[0] or (pick(prefill_lens, length) - length) * 8 <= length:
        return length
    return max(b for b in prefill_lens if b <= length)
