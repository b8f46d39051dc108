"""Continuous batching: which sequences run in the next step, and what their results change.

Sequences join the running set between steps and leave it when they finish. A step is either a
prefill chunk of one sequence (at most ``prefill_chunk_size`` tokens, cut to fill a prefill
bucket) or a decode for every running sequence (one token each, or ``decode_steps`` tokens when
nothing else waits); when both kinds of work are waiting they alternate, so a long prompt delays
running streams by at most one chunk at a time. When a decode needs a page and none is free, the
newest running sequence is preempted: its pages are freed and it is recomputed later.

Prefix caching: every full page a sequence computes is registered under its prefix hash; a
sequence that starts (or restarts after preemption) first takes the cached pages of its longest
registered prefix, by reference count, and computes only the rest. At least one token is always
left to compute, since its logits give the next sample. Full pages are never written again, so
sharing them is safe.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from jax_llm_runtime.runtime.engine.buckets import fit_chunk
from jax_llm_runtime.runtime.engine.page_allocator import PageAllocator, page_hash
from jax_llm_runtime.runtime.engine.request import FinishReason
from jax_llm_runtime.runtime.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ScheduledSeq:
    """Run tokens ``[start, start + length)`` of ``seq`` in this step."""

    seq: Sequence
    start: int
    length: int

    @property
    def reaches_end(self) -> bool:
        """True when this chunk is the sequence's last pending token: its output is sampled."""
        return self.start + self.length == self.seq.num_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    """One call's work. A decode batch with ``num_steps > 1`` generates that many tokens per
    sequence, each fed back on device; pages for all of them are already reserved."""

    kind: StepKind
    items: tuple[ScheduledSeq, ...]
    num_steps: int = 1


class Scheduler:
    """Owns the waiting queue, the running set and, through the allocator, their pages."""

    def __init__(
        self,
        allocator: PageAllocator,
        max_num_seqs: int,
        max_model_len: int,
        prefill_chunk_size: int,
        eos_token_ids: Iterable[int],
        decode_steps: int = 1,
        prefill_lens: tuple[int, ...] = (),
        prefix_cache: bool = True,
    ) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.prefill_chunk_size = prefill_chunk_size
        self.decode_steps = decode_steps
        self.prefill_lens = prefill_lens  # the runner's prefill buckets; chunks are cut to fit
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._last_kind: StepKind | None = None
        self.num_preemptions = 0
        self.num_cache_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_cache_hit_tokens = 0  # ... and found there

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """Remove a sequence wherever it is (waiting, running, or parked as a fork) and free its
        pages. Forks parked on an aborted parent are released to run on their own."""
        for seq in list(self.waiting) + self.running:
            if seq.request_id == request_id:
                self._finish(seq, reason)
                self.waiting.extendleft(reversed(seq.forks))
                seq.forks = []
                return seq
            for fork in seq.forks:
                if fork.request_id == request_id:
                    seq.forks.remove(fork)
                    fork.status = SequenceStatus.FINISHED
                    fork.finish_reason = reason
                    return fork
        return None

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's work, allocating the pages it writes; None when idle."""
        prefill = self._next_prefill()
        decodes = [s for s in self.running if s.num_pending == 1]
        if prefill is not None and (not decodes or self._last_kind is not StepKind.PREFILL):
            self._last_kind = StepKind.PREFILL
            return ScheduledBatch(StepKind.PREFILL, (prefill,))
        if not decodes:
            return None
        steps = self._decode_steps(decodes, prefill is not None)
        decodes = self._reserve_decode_pages(decodes, steps)
        self._last_kind = StepKind.DECODE
        return ScheduledBatch(
            StepKind.DECODE, tuple(ScheduledSeq(s, s.num_computed, 1) for s in decodes), steps
        )

    def _decode_steps(self, decodes: list[Sequence], prefill_waits: bool) -> int:
        """``decode_steps`` when nothing else waits, every sequence has room for that many more
        positions, none needs per-token host work (logprobs, penalties, stop tokens banned
        until min_tokens) and the pages for all of them are free without preempting; else 1."""
        k = self.decode_steps
        if k == 1 or prefill_waits or self.waiting:
            return 1
        needed = 0
        for seq in decodes:
            sp = seq.sampling
            # min_tokens bans tokens by a bias fixed for the whole call; with nothing to ban
            # (ignore_eos and no stop_token_ids) nothing changes within it.
            pending = len(seq.output_ids) < sp.min_tokens
            if sp.logprobs is not None or sp.uses_penalties or seq.matcher is not None:
                return 1
            if pending and sp.banned_until_min_tokens(self.eos_token_ids):
                return 1
            # Overshooting max_tokens only costs dropped tokens; positions must stay in range.
            if self.max_model_len - seq.num_tokens + 1 < k:
                return 1
            needed += self._pages_needed(seq, seq.num_tokens + k - 1)
        return k if self.allocator.can_allocate(needed) else 1

    def update(self, batch: ScheduledBatch, sampled: list[list[int]]) -> list[Sequence]:
        """Apply a call's sampled tokens (one list per item: one token per step run); return the
        sequences that gained tokens or finished. Tokens after a sequence finishes are dropped."""
        changed = []
        for item, tokens in zip(batch.items, sampled, strict=True):
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed = item.start + item.length
            if seq.forks and seq.num_computed >= len(seq.prompt_ids):
                self._release_forks(seq)
            reason, sampled_here = None, item.reaches_end  # before the new tokens extend it
            for i, token in enumerate(int(t) for t in (tokens if sampled_here else ())):
                # Token i was sampled after the step fed token i - 1 back: its K/V are cached.
                seq.num_computed = item.start + item.length + i
                seq.output_ids.append(token)
                reason = self._advance_grammar(seq, token) or self._finish_reason(seq, token)
                if reason is not None:
                    break
            self._register_full_pages(seq)  # before finishing: a finished prefix stays cached
            if reason is not None:
                self._finish(seq, reason)
            if sampled_here:
                changed.append(seq)
        return changed

    def _advance_grammar(self, seq: Sequence, token: int) -> FinishReason | None:
        """Feed a sampled token to the sequence's matcher: ERROR when the grammar refuses it
        (the mask allowed it, so the matcher disagrees), STOP at EOS once it is complete (also
        with ignore_eos)."""
        if seq.matcher is None:
            return None
        if not seq.matcher.accept(token):
            logger.error(
                "%s: token %d broke its grammar: %s", seq.request_id, token, seq.matcher.error
            )
            return FinishReason.ERROR
        if token in self.eos_token_ids and seq.matcher.done:
            return FinishReason.STOP
        return None

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        sp = seq.sampling
        stops = (token in self.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids
        # The sampler suppresses stop tokens before min_tokens; this guards the count anyway.
        if stops and len(seq.output_ids) > sp.min_tokens:
            return FinishReason.STOP
        if len(seq.output_ids) >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release_pages(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(seq.pages))

    def _next_prefill(self) -> ScheduledSeq | None:
        """The running sequence mid-prefill, else the next waiting one if it fits now."""
        seq = next((s for s in self.running if s.num_pending > 1), None)
        if seq is None:
            if not self.waiting or len(self.running) >= self.max_num_seqs:
                return None
            seq = self.waiting[0]
        reused = self._reuse_cached_prefix(seq) if not seq.pages else 0
        length = min(seq.num_pending, self.prefill_chunk_size)
        if self.prefill_lens:
            length = fit_chunk(self.prefill_lens, seq.num_pending, self.prefill_chunk_size)
        needed = self._pages_needed(seq, seq.num_computed + length)
        if not self.allocator.can_allocate(needed):
            if reused:  # give the cached pages back until it can start
                self._release_pages(seq)
            return None
        seq.pages += self.allocator.allocate(needed)
        if seq.status is SequenceStatus.WAITING:
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self.prefix_cache and seq.num_preemptions == 0:
                seq.num_cached_tokens = reused * self.page_size
                self.num_cache_queried_tokens += len(seq.prompt_ids)
                self.num_cache_hit_tokens += seq.num_cached_tokens
        return ScheduledSeq(seq, seq.num_computed, length)

    def _reserve_decode_pages(self, decodes: list[Sequence], steps: int = 1) -> list[Sequence]:
        """Give each decoding sequence room for ``steps`` more tokens, preempting the newest if
        needed (multi-step calls are only scheduled when no preemption is needed)."""
        kept = []
        for seq in sorted(decodes, key=lambda s: s.arrival):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below to make room for an older one
            needed = self._pages_needed(seq, seq.num_tokens + steps - 1)
            while not self.allocator.can_allocate(needed):
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                seq.pages += self.allocator.allocate(needed)
                kept.append(seq)
        return kept

    def _reuse_cached_prefix(self, seq: Sequence) -> int:
        """Start a sequence without pages on the cached pages of its longest registered prefix;
        return how many pages it took."""
        if not self.prefix_cache:
            return 0
        hashes = self._page_hashes(seq, (seq.num_tokens - 1) // self.page_size)
        for digest in hashes:
            page = self.allocator.lookup(digest)
            if page is None:
                break
            self.allocator.share(page)
            seq.pages.append(page)
        reused = seq.num_registered_pages = len(seq.pages)
        seq.num_computed = reused * self.page_size
        return reused

    def _page_hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """The prefix hashes of the sequence's first ``num_pages`` full pages."""
        ps, hashes = self.page_size, seq.page_hashes
        while len(hashes) < num_pages:
            i = len(hashes)
            hashes.append(
                page_hash(hashes[-1] if i else None, seq.token_slice(i * ps, i * ps + ps))
            )
        return hashes[:num_pages]

    def _register_full_pages(self, seq: Sequence) -> None:
        """Register the pages the sequence has filled since the last call under their hashes."""
        if not self.prefix_cache or seq.status is not SequenceStatus.RUNNING:
            return
        full = min(seq.num_computed // self.page_size, len(seq.pages))
        if full <= seq.num_registered_pages:
            return
        hashes = self._page_hashes(seq, full)
        for i in range(seq.num_registered_pages, full):
            self.allocator.register_full_page(seq.pages[i], hashes[i])
        seq.num_registered_pages = full

    def _release_pages(self, seq: Sequence) -> None:
        """Drop the sequence's pages, last first: the free list evicts the least recently freed,
        so a shared prefix outlives the tails that extend it."""
        self.allocator.free(reversed(seq.pages))
        seq.pages = []
        seq.num_computed = seq.num_registered_pages = 0

    def _release_forks(self, parent: Sequence) -> None:
        """Start the parent's forks (n > 1) on its computed prompt.

        Each fork shares, by reference count, every full page of the prompt except the one holding
        its last token, and recomputes from there: at least one token, whose logits give the fork
        its own first sample. Full pages are never written again, so sharing them is safe.
        """
        shared = (len(parent.prompt_ids) - 1) // self.page_size
        for fork in parent.forks:
            for page in parent.pages[:shared]:
                self.allocator.share(page)
            fork.pages = parent.pages[:shared]
            fork.num_computed = shared * self.page_size
            fork.page_hashes = parent.page_hashes[:shared]
            fork.num_registered_pages = min(shared, parent.num_registered_pages)
        self.waiting.extendleft(reversed(parent.forks))
        parent.forks = []

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages; it waits at the front and is recomputed from scratch."""
        self.running.remove(seq)
        self._release_pages(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
