"""Continuous batching: which sequences run in the next step, and what their results change.

Sequences join the running set between steps and leave it when they finish. A step is mixed:
every running sequence that decodes adds its next token, and prefill chunks of the sequences
still prefilling, then of waiting ones (oldest first, while the running set has room), fill
the step up to ``max_num_batched_tokens`` tokens (``prefill_only_tokens`` when no sequence
decodes, so that no stream waits on it; each chunk at most ``prefill_chunk_size``;
the last one cut so that the step fills a token bucket). So a long prompt delays running
streams by one budget's worth of work per step, and a burst of short prompts is prefilled
together. When nothing prefills, a decode step generates ``decode_steps`` tokens per sequence
(multi-step) where it can. Where steps cannot mix (``mixed`` off: no native ragged attention,
see ``runtime.loading.builder.mixed_steps``) a step is one prefill chunk or a decode of every
running sequence, and when both wait they alternate. When a decode needs a page and none is free, the newest running
sequence is preempted: its pages are freed and it is recomputed later.

Models with linear-attention layers (Qwen3-Next, Qwen3.5) also keep a state slot per running
sequence (``state_slots``: taken when it starts running, given back when it finishes or is
preempted). Their prefix cache is off (a reused prefix's pages would lack its recurrent
state), and a step runs at most one prompt chunk besides its decode rows (the layers run a
chunk as one padded row and every other sequence as a single token). The forks of ``n > 1``
share the parent's full prompt pages as usual: the parent's prefill stops at the end of the
last of them, and each fork takes a slot there and has the parent's state copied into it
(``ScheduledBatch.state_copies``, applied before the next step runs); a fork that finds no
free slot recomputes the prompt from scratch.

Prefix caching: every full page a sequence computes is registered under its prefix hash; a
sequence that starts (or restarts after preemption) first takes the cached pages of its longest
registered prefix, by reference count, and computes only the rest. At least one token is always
left to compute, since its logits give the next sample. Full pages are never written again, so
sharing them is safe. A page holding image soft tokens is registered under the images' digests
too, so prompts alike but for their images share no page.

Images (vision-language prompts): the soft tokens of one image attend to each other both ways,
so a chunk never ends inside an image: it ends before the image, or grows to its end (past the
budget if need be, up to ``max_step_tokens``).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from jax_llm_runtime.runtime.engine.buckets import fit_tokens
from jax_llm_runtime.runtime.engine.page_allocator import PageAllocator, page_hash
from jax_llm_runtime.runtime.engine.request import FinishReason
from jax_llm_runtime.runtime.engine.sequence import Sequence, SequenceStatus
from jax_llm_runtime.runtime.engine.state_slots import StateSlots

logger = logging.getLogger(__name__)


class StepKind(enum.Enum):
    PREFILL = "prefill"  # at least one prefill chunk, maybe with decode tokens (mixed)
    DECODE = "decode"  # one token of every item: eligible for multi-step


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
    # (source, destination) state slots to copy before the step runs: forks of n > 1 starting
    # from their parent's state (linear-attention models).
    state_copies: tuple[tuple[int, int], ...] = ()
    # A decode batch scheduled ahead (``Scheduler.schedule_ahead``): the tokens each sequence
    # gains in the call still running, not yet on the host; this call's input tokens are that
    # call's last ones, fed on the device.
    fed_steps: int = 0


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
        max_num_batched_tokens: int | None = None,
        mixed: bool = True,
        multi_step_seqs: int | None = None,
        prefix_cost: int | None = None,
        prefill_only_tokens: int | None = None,
        max_step_tokens: int | None = None,
        state_slots: bool = False,
    ) -> None:
        self.allocator = allocator
        # A state slot per running sequence (linear-attention models), else None.
        self.state_slots = StateSlots(max_num_seqs) if state_slots else None
        self._state_copies: list[tuple[int, int]] = []  # for the next batch
        if state_slots and prefix_cache:
            raise ValueError("the prefix cache cannot be used with state slots (linear attention)")
        self.page_size = allocator.page_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.prefill_chunk_size = prefill_chunk_size
        # The most tokens one step runs (default: one chunk besides every decode).
        self.max_num_batched_tokens = max_num_batched_tokens or prefill_chunk_size + max_num_seqs
        # The budget of a step with no decode rows, where no stream waits on it (default: the same).
        self.prefill_only_tokens = prefill_only_tokens or self.max_num_batched_tokens
        # The most tokens a step may run when a chunk grows past the budget to hold a whole
        # image (the largest compiled token bucket; default: either budget).
        self.max_step_tokens = max_step_tokens or max(
            self.max_num_batched_tokens, self.prefill_only_tokens
        )
        self.mixed = mixed
        self._last_kind: StepKind | None = None  # alternating steps only
        self.decode_steps = decode_steps
        # Multi-step decode only while at most this many sequences decode (None: any number).
        self.multi_step_seqs = multi_step_seqs
        # Prefix positions a prompt token attends over that cost as much as the token's own
        # projections (None: a chunk costs its token count alone; see chunk_tokens).
        self.prefix_cost = prefix_cost
        self.prefill_lens = prefill_lens  # the runner's prefill buckets; chunks are cut to fit
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
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
        batch = self._mixed() if self.mixed else self._alternating()
        if batch is not None and self._state_copies:
            batch = dataclasses.replace(batch, state_copies=tuple(self._state_copies))
            self._state_copies.clear()
        return batch

    def _mixed(self) -> ScheduledBatch | None:
        """Decode rows and prefill chunks in one step."""
        decodes = [s for s in self.running if s.num_pending == 1]
        prefill_waits = self._prefill_waits()
        steps = 1 if prefill_waits or not decodes else self._decode_steps(decodes)
        items = self._decode_items(decodes, steps)
        budget = self.max_num_batched_tokens if items else self.prefill_only_tokens
        # One prompt chunk per step for linear-attention models (StepBatch.single_chunk).
        limit = 1 if self.state_slots is not None else None
        chunks = self._prefill_chunks(len(items), limit, budget) if prefill_waits else ()
        if chunks:
            return ScheduledBatch(StepKind.PREFILL, items + chunks)
        if not items:
            return None
        return ScheduledBatch(StepKind.DECODE, items, steps)

    def _alternating(self) -> ScheduledBatch | None:
        """One prefill chunk or a decode of every running sequence, alternating when both
        wait."""
        decodes = [s for s in self.running if s.num_pending == 1]
        prefill_waits = self._prefill_waits()
        if prefill_waits and (not decodes or self._last_kind is not StepKind.PREFILL):
            budget = self.max_num_batched_tokens if decodes else self.prefill_only_tokens
            chunks = self._prefill_chunks(0, limit=1, budget=budget)
            if chunks:
                self._last_kind = StepKind.PREFILL
                return ScheduledBatch(StepKind.PREFILL, chunks)
        if not decodes:
            return None
        steps = 1 if prefill_waits else self._decode_steps(decodes)
        items = self._decode_items(decodes, steps)
        self._last_kind = StepKind.DECODE
        return ScheduledBatch(StepKind.DECODE, items, steps) if items else None

    def _decode_items(self, decodes: list[Sequence], steps: int) -> tuple[ScheduledSeq, ...]:
        """One token of each decoding sequence that keeps its pages for ``steps`` more."""
        kept = self._reserve_decode_pages(decodes, steps)
        return tuple(ScheduledSeq(s, s.num_computed, 1) for s in kept)

    def _prefill_waits(self) -> bool:
        """Whether a running sequence is mid-prefill or a waiting one could start."""
        if any(s.num_pending > 1 for s in self.running):
            return True
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def _decode_steps(self, decodes: list[Sequence], ahead: int = 0) -> int:
        """``decode_steps`` when nothing else waits, at most ``multi_step_seqs`` sequences
        decode, every sequence has room for that many more positions, none needs per-token host
        work (``_host_bound``) and the pages for all of them are free without preempting; else
        1. ``ahead``: the tokens each sequence gains in a call still running."""
        k = self.decode_steps
        if k == 1 or self.waiting:
            return 1
        if self.multi_step_seqs is not None and len(decodes) > self.multi_step_seqs:
            return 1
        needed = 0
        for seq in decodes:
            if self._host_bound(seq, ahead):
                return 1
            # Overshooting max_tokens only costs dropped tokens; positions must stay in range.
            if self.max_model_len - (seq.num_tokens + ahead) + 1 < k:
                return 1
            needed += self._pages_needed(seq, seq.num_tokens + ahead + k - 1)
        return k if self.allocator.can_allocate(needed) else 1

    def _host_bound(self, seq: Sequence, ahead: int = 0) -> bool:
        """Whether the sequence's next tokens need the host's work on the ones before them:
        logprobs, penalties, a grammar, or stop tokens banned until min_tokens (by a bias fixed
        for the whole call; with nothing to ban, ignore_eos and no stop_token_ids, nothing
        changes within it)."""
        sp = seq.sampling
        if sp.logprobs is not None or sp.uses_penalties or seq.matcher is not None:
            return True
        pending = len(seq.output_ids) + ahead < sp.min_tokens
        return pending and bool(sp.banned_until_min_tokens(self.eos_token_ids))

    def schedule_ahead(self, batch: ScheduledBatch, steps: int) -> ScheduledBatch | None:
        """The decode call that follows ``batch`` (a decode call still running, of ``steps``
        steps), scheduled before its tokens reach the host, so that the host's turn between the
        two overlaps the device's work: every sequence of ``batch`` decodes on, its input token
        fed on the device. None when the next step must be scheduled from ``batch``'s results:
        a sequence waits or prefills, one has left, one needs per-token host work, one reaches
        the context's end, or the pages it needs are not free without preempting; and when
        every sequence reaches its ``max_tokens`` in ``batch``. A sequence
        that finishes in ``batch`` wastes its row of the call ahead (its tokens are dropped;
        its K/V go to positions past its end, in pages the device writes before any later step
        can reuse them)."""
        if batch.kind is not StepKind.DECODE or self.waiting or self._prefill_waits():
            return None
        seqs = [item.seq for item in batch.items]
        # The last call of requests that all end by length in the running one would run for
        # nothing, ahead of the next request's prompt.
        if all(len(s.output_ids) + steps >= s.sampling.max_tokens for s in seqs):
            return None
        if len(seqs) != len(self.running) or any(
            s.status is not SequenceStatus.RUNNING
            or self._host_bound(s, steps)
            or s.num_tokens + steps >= self.max_model_len
            for s in seqs
        ):
            return None
        k = self._decode_steps(seqs, steps)
        needed = [self._pages_needed(s, s.num_tokens + steps + k - 1) for s in seqs]
        if not self.allocator.can_allocate(sum(needed)):
            return None
        for seq, count in zip(seqs, needed, strict=True):
            seq.pages += self.allocator.allocate(count)
        items = tuple(ScheduledSeq(i.seq, i.start + steps, 1) for i in batch.items)
        return ScheduledBatch(StepKind.DECODE, items, k, fed_steps=steps)

    def update(self, batch: ScheduledBatch, sampled: list[list[int]]) -> list[Sequence]:
        """Apply a call's sampled tokens (one list per item: one token per step run); return the
        sequences that gained tokens or finished. Tokens after a sequence finishes are dropped."""
        changed = []
        for item, tokens in zip(batch.items, sampled, strict=True):
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed = item.start + item.length
            if seq.forks and seq.num_computed >= self._fork_point(seq):
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
        self._release_slot(seq)  # a fork waiting with its parent's state holds one too
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(seq.pages))

    def _prefill_chunks(
        self, used: int, limit: int | None = None, budget: int | None = None
    ) -> tuple[ScheduledSeq, ...]:
        """Prefill chunks (at most ``limit``) for a step that already runs ``used`` decode
        tokens: sequences mid-prefill first, then waiting ones in order while the running set
        has room, until the token budget (``budget``, default ``max_num_batched_tokens``) is
        spent or a chunk's pages cannot be allocated."""
        chunks: list[ScheduledSeq] = []
        mid = [s for s in self.running if s.num_pending > 1]
        cost = used  # the budget spent: decode rows, and chunks with their prefixes' attention
        for seq in mid + list(self.waiting):
            if limit is not None and len(chunks) == limit:
                break
            room = (budget or self.max_num_batched_tokens) - cost
            if room < 1 or (seq.status is SequenceStatus.WAITING and not self._has_room(seq)):
                break
            chunk = self._prefill_chunk(seq, room, used)
            if chunk is None:
                break
            chunks.append(chunk)
            used += chunk.length
            cost += chunk_cost(chunk.start, chunk.length, self.prefix_cost)
        if chunks and self.prefill_lens:  # the last chunk is cut so that the step fills a bucket
            last = chunks[-1]
            length = fit_tokens(self.prefill_lens, used - last.length, last.length)
            length = _image_safe_end(last.seq, last.start, last.start + length) - last.start
            chunks[-1] = ScheduledSeq(last.seq, last.start, length)
        return tuple(chunks)

    def _has_room(self, seq: Sequence | None = None) -> bool:
        """Whether the running set takes one more (``seq``, which needs a state slot unless it
        holds one already)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        slots = self.state_slots
        return slots is None or seq is None or seq.state_slot is not None or slots.num_free > 0

    def _prefill_chunk(self, seq: Sequence, room: float, used: int = 0) -> ScheduledSeq | None:
        """The sequence's next chunk (at most ``room`` tokens, unless it must grow to hold a
        whole image), its pages allocated and a waiting sequence moved to the running set; None
        when its pages cannot be allocated now, or its image does not fit the step beside the
        ``used`` tokens. (A chunk cut shorter afterwards keeps its pages for the next one.)"""
        reused = self._reuse_cached_prefix(seq) if not seq.pages else 0
        affordable = chunk_tokens(seq.num_computed, room, self.prefix_cost)
        length = min(seq.num_pending, self.prefill_chunk_size, affordable)
        if seq.forks and seq.num_computed < self._fork_point(seq):  # the forks start there
            length = min(length, self._fork_point(seq) - seq.num_computed)
        start = seq.num_computed
        safe = _image_safe_end(seq, start, start + length) - start
        too_long = safe > length and used + safe > self.max_step_tokens  # grown for an image
        length = safe
        needed = self._pages_needed(seq, seq.num_computed + length)
        if too_long or not self.allocator.can_allocate(needed):
            if reused:  # give the cached pages back until it can start
                self._release_pages(seq)
            return None
        seq.pages += self.allocator.allocate(needed)
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self.state_slots is not None and seq.state_slot is None:
                seq.state_slot = self.state_slots.take()
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
            start, stop = i * ps, i * ps + ps
            images = () if seq.images is None else seq.images.digests(start, stop)
            hashes.append(
                page_hash(hashes[-1] if i else None, seq.token_slice(start, stop), images)
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

    def _release_slot(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.state_slots.give_back(seq.state_slot)
            seq.state_slot = None

    def _fork_point(self, parent: Sequence) -> int:
        """How much of its prompt a parent computes before its forks start: all of it, or, with
        state slots, its full pages but the one holding its last token (where the forks start,
        from a copy of its state then)."""
        if self.state_slots is None:
            return len(parent.prompt_ids)
        return (len(parent.prompt_ids) - 1) // self.page_size * self.page_size

    def _release_forks(self, parent: Sequence) -> None:
        """Start the parent's forks (n > 1) on its computed prompt.

        Each fork shares, by reference count, every full page of the prompt except the one holding
        its last token, and recomputes from there: at least one token, whose logits give the fork
        its own first sample. Full pages are never written again, so sharing them is safe. With
        state slots each fork also takes a slot now, into which the parent's state (at exactly
        those pages' end: ``_fork_point``) is copied before the next step; without a free slot
        it shares nothing and recomputes the prompt.
        """
        shared = (len(parent.prompt_ids) - 1) // self.page_size
        slots = self.state_slots
        for fork in parent.forks:
            if slots is not None and (not shared or not slots.num_free):
                continue  # from position 0: a fresh state, nothing to share
            if slots is not None:
                fork.state_slot = slots.take()
                self._state_copies.append((parent.state_slot, fork.state_slot))
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
        self._release_slot(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)


def _image_safe_end(seq: Sequence, start: int, stop: int) -> int:
    """``stop``, or where a chunk from ``start`` must end instead so that it cuts no image
    (``SequenceImages.safe_end``)."""
    return stop if seq.images is None else seq.images.safe_end(start, stop)


def chunk_cost(start: int, length: int, prefix_cost: int | None) -> float:
    """What a prompt chunk of ``length`` tokens from position ``start`` spends of a step's token
    budget: its tokens, each also paying for the positions it attends over (the prefix and the
    chunk's earlier tokens, about ``start + length / 2`` on average) at one token per
    ``prefix_cost`` positions. So the last chunks of a long prompt, whose attention reads
    thousands of positions, are shorter, and a step's time stays near the budget's. (Sliding
    layers read only their window: for those models this overcounts, and chunks are shorter
    than they need be.)"""
    if prefix_cost is None:
        return length
    return length * (1 + (start + length / 2) / prefix_cost)


def chunk_tokens(start: int, room: float, prefix_cost: int | None) -> int:
    """The longest chunk from ``start`` whose ``chunk_cost`` fits ``room`` (at least 1)."""
    if prefix_cost is None:
        return max(1, int(room))
    # length * (1 + start / c) + length^2 / (2 c) <= room, solved for length
    b = 1 + start / prefix_cost
    a = 1 / (2 * prefix_cost)
    length = (-b + (b * b + 4 * a * room) ** 0.5) / (2 * a)
    return max(1, int(length))


def prefix_cost_positions(config: Any, attention_flop_cost: float = 1.0) -> int:
    """``prefix_cost`` for a decoder: the positions of attention (a score and a weighted value
    per query head, 4 flops per head dimension) whose flops equal one token's projections and
    LM head, the projections counted as a dense transformer's 12 * hidden^2 per layer, divided
    by ``attention_flop_cost``, what an attention flop costs against a projection's on the
    backend (``CPU_ATTENTION_FLOP_COST``). For SmolLM2-135M 4,275 positions, 1,069 on CPU."""
    d, layers = config.hidden_size, config.num_layers
    attention = config.attention
    q_dim = attention.num_heads * getattr(attention, "head_dim", config.head_dim)
    token = 2 * (12 * d * d * layers + d * config.vocab_size)
    # Only the layers with K/V pages attend over the prefix (not linear-attention ones).
    attending = getattr(config, "num_kv_layers", layers)
    per_position = 4 * attending * q_dim * attention_flop_cost
    return max(1, round(token / per_position))
