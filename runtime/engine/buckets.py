"""Padding buckets: the fixed shapes every step is padded to, all compiled ahead of time."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


def geometric(start: int, stop: int, factor: int) -> tuple[int, ...]:
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
    """A step's shape is ``(num_tokens, num_seqs, pages)``: its ragged run of new tokens
    (``models.batch.StepBatch``), the sequences they belong to, and the pages each sequence's
    page table holds. Decode steps have one token per sequence: ``(n, n, pages)`` for ``n`` in
    ``decode_seqs``. Steps that prefill have ``num_tokens`` in ``prefill_lens`` (up to the
    step's token budget) and either one sequence (a lone prompt chunk, at most ``max_chunk``
    tokens) or, where steps are mixed, ``decode_seqs[-1]`` rows of sequences (decode tokens and
    chunks of several sequences; unused rows are padding, which costs a row of sampling each).

    Page buckets double (attention reads every gathered page) and so do token counts: prefill
    is compute-bound, so padding a 156-token prompt to 512 cost 3x its work. The scheduler also
    cuts chunks so that a step fills a bucket (``fit_tokens``), so only the last chunk pads.
    """

    decode_seqs: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    pages: tuple[int, ...]
    page_size: int
    max_chunk: int
    mixed: bool = True  # steps mix sequences (``runtime.loading.builder.mixed_steps``)

    @classmethod
    def build(
        cls,
        max_num_seqs: int,
        max_model_len: int,
        prefill_chunk_size: int,
        page_size: int,
        max_num_batched_tokens: int | None = None,
        mixed: bool = True,
    ) -> BucketPlan:
        """``max_num_batched_tokens`` (default: a chunk besides every decode) tops the token
        buckets; one sequence's chunk is at most ``prefill_chunk_size`` and the context."""
        max_pages = -(-max_model_len // page_size)
        max_chunk = min(prefill_chunk_size, max_model_len)
        budget = max_num_batched_tokens or max_chunk + max_num_seqs
        max_chunk = min(max_chunk, budget)
        # Mixed steps need a bucket above the decode rows (see ``mixed_lens``).
        top = max(budget, 2 * max_num_seqs) if mixed and max_num_seqs > 1 else max_chunk
        return cls(
            decode_seqs=geometric(1, max_num_seqs, 2),
            prefill_lens=geometric(min(32, top), top, 2),
            pages=geometric(min(16, max_pages), max_pages, 2),
            page_size=page_size,
            max_chunk=max_chunk,
            mixed=mixed,
        )

    @property
    def mixed_seqs(self) -> int:
        """The sequence rows of a step that prefills with other sequences."""
        return self.decode_seqs[-1]

    def decode_shapes(self) -> list[tuple[int, int, int]]:
        """Every (num_tokens, num_seqs, pages) of a decode step."""
        return [(s, s, p) for s in self.decode_seqs for p in self.pages]

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (num_tokens, num_seqs, pages) that a step can have."""
        alone = []
        shortest = 1  # the shortest chunk that is padded to bucket q
        for q in self.prefill_lens:
            if shortest > self.max_chunk:
                break
            least_pages = pick(self.pages, -(-shortest // self.page_size))
            alone += [(q, 1, p) for p in self.pages if p >= least_pages]
            shortest = q + 1
        mixed = [(q, self.mixed_seqs, p) for q in self.mixed_lens for p in self.pages]
        return self.decode_shapes() + alone + mixed

    @property
    def mixed_lens(self) -> tuple[int, ...]:
        """The token buckets of mixed steps: more tokens than sequence rows, so that a mixed
        shape is never a decode shape."""
        if self.mixed_seqs == 1 or not self.mixed:
            return ()
        return tuple(q for q in self.prefill_lens if q > self.mixed_seqs)


def fit_tokens(token_lens: tuple[int, ...], used: int, length: int) -> int:
    """How many of ``length`` prompt tokens to add to a step that already runs ``used`` tokens:
    all of them when padding the step to its bucket wastes at most an eighth, else as many as
    fill the largest bucket the step reaches (at least one), so that only a last chunk pads.

    Every step pays one pass over the weights, so a nearly full bucket beats splitting; a
    156-token prompt alone runs as 128 + 28 (padded to 32) instead of padded to 256.
    """
    total = used + length
    if total <= token_lens[0] or (pick(token_lens, total) - total) * 8 <= total:
        return length
    fill = max(b for b in token_lens if b <= total) - used
    return fill if fill >= 1 else length
