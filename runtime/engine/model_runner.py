"""Turns a scheduled batch into one call of the jitted step, padded to a compiled bucket.

A single step is two ``jax.jit`` functions: the model forward, which returns each sequence's
logits (the KV cache is donated to it and comes back updated in place), and the sampler, compiled
once per count of rows rather than once per step shape. A multi-step decode call is one function
that samples inside its scan. Every shape is compiled ahead of time: short-context buckets in
``warmup``, the rest on a background thread right after (see ``CompiledShapes``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.layers.linear_attention import HybridCache
from jax_llm_runtime.models.registry import ModelSpec
from jax_llm_runtime.pallas_kernels.paged_attention import KVCache, to_stored
from jax_llm_runtime.runtime.engine.buckets import BucketPlan, pick
from jax_llm_runtime.runtime.engine.compiled_shapes import CompiledShapes
from jax_llm_runtime.runtime.engine.image_encoder import ImageEncoder
from jax_llm_runtime.runtime.engine.request import MAX_STOP_TOKEN_IDS, PENALTY_WINDOW, TokenLogprobs
from jax_llm_runtime.runtime.engine.sampler import (
    BIAS_SLOTS,
    MAX_LOGIT_BIAS,
    SamplerOutput,
    SamplingMetadata,
    bitmask_width,
    empty_sampling_metadata,
    sample,
)
from jax_llm_runtime.runtime.engine.scheduler import ScheduledBatch, ScheduledSeq, StepKind
from jax_llm_runtime.runtime.multimodal.inputs import SequenceImages
from jax_llm_runtime.runtime.parallel.sharding import host_inputs, placed, replicated_sharding

# The bias slots left for EOS ids, suppressed until min_tokens.
MAX_EOS_IDS = BIAS_SLOTS - MAX_LOGIT_BIAS - MAX_STOP_TOKEN_IDS
# The state slot of padding sequences (and of sequences of models without state slots): out of
# range, so a step reads zeros for it and writes nothing (models.layers.linear_attention).
NO_STATE_SLOT = 2**30


@dataclass
class StepResult:
    """The tokens sampled for each scheduled sequence, in order (one per step run), and the
    requested logprobs (single-step calls only)."""

    token_ids: list[list[int]]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # by request id

    def logprobs_for(self, request_id: str) -> list[TokenLogprobs]:
        """The request's logprobs for this step's token (empty when it did not ask)."""
        entry = self.logprobs.get(request_id)
        return [] if entry is None else [entry]


@dataclass
class InFlight:
    """A call dispatched to the device (``ModelRunner.dispatch``), its results not yet read."""

    batch: ScheduledBatch
    steps: int  # the steps it runs: batch.num_steps, or 1 where that bucket is not compiled
    tokens: jax.Array | None  # [num_seqs, steps] of a multi-step call
    out: SamplerOutput | None  # the sampler's output of a single step
    wants_logprobs: bool
    # A multi-step call's last column, [num_seqs], returned by the compiled call itself (an
    # index taken here would compile on first use, while serving).
    last: jax.Array | None = None

    def last_tokens(self) -> jax.Array:
        """Each row's last sampled token, [num_seqs] int32 on the device: the input of a call
        scheduled ahead of this one."""
        if self.out is not None:
            return self.out.token_ids  # int32
        return self.last


class ModelRunner:
    """Owns the weights and the KV cache on device and runs steps."""

    def __init__(
        self,
        spec: ModelSpec,
        config: Any,
        weights: Any,
        cache: KVCache,
        plan: BucketPlan,
        eos_token_ids: Iterable[int] = (),
        decode_steps: int = 1,
        cache_sharding: Any = None,
        multi_step_seqs: int | None = None,
        images: ImageEncoder | None = None,
    ) -> None:
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        if len(self.eos_token_ids) > MAX_EOS_IDS:
            raise ValueError(f"at most {MAX_EOS_IDS} EOS ids are supported, got {eos_token_ids}")
        self.vocab_size = int(config.vocab_size)
        self.config = config
        self.weights = weights
        self.cache = cache
        self.plan = plan
        self.decode_steps = decode_steps
        self.images = images  # a vision-language model's image encoder
        # The width of a step's image rows: the soft token, then any deepstack levels (models.batch).
        self.embed_width = getattr(getattr(images, "config", None), "out_width", config.hidden_size)
        # Multimodal rope (Qwen3-VL): every step carries each row's three rotary positions.
        rope = getattr(getattr(config, "attention", None), "rope", None)
        self.mrope = getattr(rope, "mrope_section", None) is not None
        self.multi_step_seqs = (
            multi_step_seqs  # multi-step buckets only up to this many (None: all)
        )
        # With a device mesh the updated cache keeps the input's sharding (runtime.parallel.sharding).
        forward = functools.partial(_constrained, spec.forward, cache_sharding)
        # The sampled tokens (and logprobs) are replicated, so every process can read them; so
        # is every host input of a step, compiled and passed with this one sharding.
        replicated = replicated_sharding(cache_sharding)
        self.input_sharding = replicated
        self._step = jax.jit(
            functools.partial(_step, forward, config, replicated), donate_argnums=(1,)
        )
        self._sample = jax.jit(functools.partial(_sample, replicated))
        self._multi_step = jax.jit(
            functools.partial(_multi_step, forward, config, replicated),
            static_argnums=(0,),
            donate_argnums=(2,),
        )
        self.compiled = CompiledShapes("step shapes", self._lower)
        # True when nothing compiles ahead (EngineConfig.precompile "none"): a multi-step bucket
        # then compiles when a batch first asks for it, like every other shape.
        self.compile_on_demand = False
        # These keep the cache's sharding too, so the compiled steps take what they return.
        fill = functools.partial(_keeping, _fill_pages, cache_sharding)
        self._fill = jax.jit(fill, donate_argnums=(0,))
        copy_slots = functools.partial(_keeping, _copy_state_slots, cache_sharding)
        self._copy_slots = jax.jit(copy_slots, donate_argnums=(0,))
        # The grammar bitmask of batches without a constrained sequence, per batch bucket, kept
        # on the device (see _allowed); device_put traces nothing, so nothing compiles here.
        self._all_allowed = {
            n: jax.device_put(
                np.full((n, bitmask_width(self.vocab_size)), -1, np.int32), self.input_sharding
            )
            for n in {1, *plan.decode_seqs}
        }
        # Multi-node (runtime.parallel.multihost): sees each device call before it runs, on process 0.
        self.mirror: Callable[..., None] | None = None

    def startup_shapes(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """(compile before serving, compile in the background), as (num_tokens, num_seqs,
        pages, steps) keys of steps and ``(SAMPLER, rows)`` keys of the sampler. Before
        serving: what a lone request at a short context runs (its prompt chunks and its decode,
        one sequence, single steps, and the sampler of one row), so that a start is ready as
        soon as one request can be served (13 shapes became 5 for SmolLM2 on CPU: 12.3 s to 9 s
        of a warm start). Then in the background the sampler's other row counts, and the steps
        from short contexts to long, each context's single steps before its multi-step decode;
        a batch that needs a shape not compiled yet compiles it then (``CompiledShapes.get``),
        once.

        Shapes are lowered from abstract values, so nothing runs: a bucket of 8192 prompt tokens
        costs its compile time only.
        """
        shapes = [(*s, 1) for s in self.plan.shapes()]
        if self.decode_steps > 1:
            seqs = self.plan.decode_seqs
            most = seqs[-1]
            if self.multi_step_seqs:
                most = pick(seqs, min(self.multi_step_seqs, most))
            shapes += [(*s, self.decode_steps) for s in self.plan.decode_shapes() if s[1] <= most]
        first = [s for s in shapes if s[2] == self.plan.pages[0] and s[3] == 1 and s[1] == 1]
        if self.images is not None:  # the steps that prefill image tokens (models.batch)
            decode = set(self.plan.decode_shapes())
            shapes += [(*s, 1, IMAGES) for s in self.plan.shapes() if s not in decode]
        rest = sorted((s for s in shapes if s not in first), key=lambda s: (s[2], s[3], s[1], s[0]))
        rows = sorted({s[1] for s in shapes if s[3] == 1})
        return [*first, (SAMPLER, 1)], [(SAMPLER, n) for n in rows if n != 1] + rest

    def _lower(self, key: tuple[Any, ...]) -> Any:
        """A step of ``(num_tokens, num_seqs, pages, steps)``, ``IMAGES`` last for a step that
        prefills image tokens; or the sampler of ``(SAMPLER, rows)``."""
        if key[0] == SAMPLER:
            logits = jax.ShapeDtypeStruct((key[1], self.vocab_size), jnp.float32)
            meta = empty_sampling_metadata(key[1], self.vocab_size)
            return self._sample.lower(*host_inputs((logits, meta), self.input_sharding))
        single = self._single_chunk(key[1], key[0])
        batch, meta = _empty_inputs(*key[:3], self.vocab_size, single)
        if self.mrope:
            batch = batch.replace(rope_positions=np.zeros((key[0], 3), np.int32))
        if key[-1] == IMAGES:
            batch = _with_images(batch, self.embed_width, self.images.bidirectional)
        batch, meta = host_inputs((batch, meta), self.input_sharding)
        weights, cache = placed(self.weights), placed(self.cache)
        if key[3] == 1:
            return self._step.lower(weights, cache, batch)
        return self._multi_step.lower(key[3], weights, cache, batch, meta)

    def run(self, batch: ScheduledBatch) -> StepResult:
        """Run one call; return the tokens sampled for every scheduled sequence, in order."""
        return self.collect(self.dispatch(batch))

    def dispatch(self, batch: ScheduledBatch, fed: InFlight | None = None) -> InFlight:
        """Start one call on the device and return without waiting for it (``collect`` waits).

        A multi-step batch runs ``batch.num_steps`` steps in one call once that bucket is
        compiled (or, with ``compile_on_demand``, compiling it now), else one step (the
        scheduler takes however many tokens come back). A batch scheduled ahead
        (``batch.fed_steps``) takes its input tokens from ``fed``, the call before it, on the
        device.
        """
        if batch.state_copies:
            self.copy_state_slots(batch.state_copies)
        step_batch, meta = self._prepare(batch)
        if fed is not None:
            step_batch = step_batch.replace(tokens=fed.last_tokens())
        key = _key(step_batch, batch.num_steps)
        steps = batch.num_steps if self.compile_on_demand or key in self.compiled else 1
        tokens, out = self.execute(step_batch, meta, steps)
        wants_logprobs = steps == 1 and bool(np.any(meta.wants_logprobs))
        last = None
        if tokens is not None:
            tokens, last = tokens
        return InFlight(batch, steps, tokens, out, wants_logprobs, last)

    def collect(self, call: InFlight) -> StepResult:
        """Wait for a dispatched call; the tokens sampled for every scheduled sequence, in
        order, and the requested logprobs (copied to the host only when a sequence asked)."""
        count = len(call.batch.items)
        if call.out is None:
            return StepResult(np.asarray(call.tokens)[:count].tolist())
        result = StepResult([[t] for t in np.asarray(call.out.token_ids)[:count].tolist()])
        if call.wants_logprobs:
            result.logprobs = _host_logprobs(call.batch.items, call.out)
        return result

    def execute(
        self, step_batch: StepBatch, meta: SamplingMetadata, steps: int
    ) -> tuple[Any, SamplerOutput | None]:
        """The device part of ``run``: ``steps`` steps of the compiled bucket on prepared inputs;
        ((tokens [num_seqs, steps], their last column) of a multi-step call, None) or (None,
        the sampler's output).
        ``mirror`` (multi-node) sees the call first; a ``None`` grammar mask means all-ones."""
        if self.mirror is not None:
            shared = meta if isinstance(meta.allowed, np.ndarray) else meta.replace(allowed=None)
            self.mirror("execute", step_batch, shared, steps)
        if meta.allowed is None:
            meta = meta.replace(allowed=self._all_allowed[step_batch.num_seqs])
        key = _key(step_batch, steps)
        if steps > 1:
            tokens, self.cache = self.compiled.get(key)(self.weights, self.cache, step_batch, meta)
            return tokens, None
        logits, self.cache = self.compiled.get(key)(self.weights, self.cache, step_batch)
        return None, self.compiled.get((SAMPLER, step_batch.num_seqs))(logits, meta)

    def cache_lost(self) -> bool:
        """True when a failed step had already consumed the donated KV cache: no sequence can
        go on, so the engine must stop."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache))

    def fill_pages(self, pages: list[int]) -> None:
        """Set every K/V element (and row scale) of ``pages`` to NaN: the debug mode that shows a
        read of stale K/V as a non-finite output. The page list is padded to a power of two by
        repeating its first page, so few shapes compile."""
        ids = np.full(1 << (len(pages) - 1).bit_length(), pages[0], np.int32)
        ids[: len(pages)] = pages
        self.fill_page_ids(ids)

    def fill_page_ids(self, ids: np.ndarray) -> None:
        """The device part of ``fill_pages`` (``mirror`` sees it first)."""
        if self.mirror is not None:
            self.mirror("fill_page_ids", ids)
        self.cache = self._fill(self.cache, ids)

    def copy_state_slots(self, copies: Iterable[tuple[int, int]]) -> None:
        """Copy each (source, destination) state slot of a linear-attention model's cache (the
        forks of n > 1 start from their parent's state). The pairs are padded to a power of two
        by repeating the first, so few shapes compile; ``mirror`` sees the call first."""
        pairs = list(copies)
        padded = np.asarray(pairs + pairs[:1] * ((1 << (len(pairs) - 1).bit_length()) - len(pairs)))
        if self.mirror is not None:
            self.mirror("copy_state_slots", tuple(map(tuple, padded.tolist())))
        self.cache = self._copy_slots(
            self.cache, padded[:, 0].astype(np.int32), padded[:, 1].astype(np.int32)
        )

    def _prepare(self, batch: ScheduledBatch) -> tuple[StepBatch, SamplingMetadata]:
        items = batch.items
        num_tokens, num_seqs = self._bucket(batch)
        # A multi-step call writes num_steps - 1 positions past each sequence's current end.
        reach = batch.num_steps - 1
        ps = self.plan.page_size
        pages = pick(self.plan.pages, max(-(-(i.start + i.length + reach) // ps) for i in items))
        tokens, positions, seq_ids = np.zeros((3, num_tokens), np.int32)
        q_starts = np.zeros(num_seqs + 1, np.int32)
        kv_lens = np.zeros(num_seqs, np.int32)
        page_indices = np.zeros((num_seqs, pages), np.int32)
        state_slots = np.full(num_seqs, NO_STATE_SLOT, np.int32)
        row = 0
        for s, item in enumerate(items):
            seq, end, rows = item.seq, item.start + item.length, slice(row, row + item.length)
            if not batch.fed_steps:  # else the call before this one gives them, on the device
                tokens[rows] = seq.token_slice(item.start, end)
            positions[rows] = np.arange(item.start, end)
            seq_ids[rows] = s
            row += item.length
            q_starts[s + 1 :] = row
            kv_lens[s] = end
            # A chunk cut shorter than its allocation holds pages past the step's reach, which
            # the step neither reads nor writes: the bucket covers the positions it does.
            held = min(len(seq.pages), pages)
            page_indices[s, :held] = seq.pages[:held]
            if seq.state_slot is not None:
                state_slots[s] = seq.state_slot
        valid = np.arange(num_tokens) < row
        last_rows = np.maximum(q_starts[1:] - 1, 0)
        decode = batch.kind is StepKind.DECODE
        single = self._single_chunk(num_seqs, num_tokens) and not decode
        if single and sum(item.length > 1 for item in items) > 1:
            raise RuntimeError("a mixed step of a linear-attention model has several prompt chunks")
        # Host arrays go straight into the jitted call: one transfer each, nothing to compile.
        step_batch = StepBatch(
            tokens, positions, seq_ids, valid, q_starts, kv_lens, page_indices, last_rows, decode,
            state_slots=state_slots, single_chunk=single,
        )  # fmt: skip
        if self.mrope:
            step_batch = step_batch.replace(rope_positions=_rope_positions(items, num_tokens))
        if self.images is not None and any(_reaches_images(item) for item in items):
            step_batch = self._image_rows(step_batch, items)
        meta = _sampling_metadata(items, num_seqs, self.eos_token_ids, batch.fed_steps)
        return step_batch, meta.replace(allowed=self._allowed(items, num_seqs))

    def _single_chunk(self, num_seqs: int, num_tokens: int) -> bool:
        """Whether a step of this shape is a mixed step of a linear-attention model, which the
        scheduler gives one prompt chunk at most (``StepBatch.single_chunk``)."""
        mixed = num_seqs > 1 and num_tokens != num_seqs  # as _empty_inputs tells decode steps
        return mixed and isinstance(self.cache, HybridCache)

    def _image_rows(self, step_batch: StepBatch, items: tuple[ScheduledSeq, ...]) -> StepBatch:
        """The step's image inputs (``models.batch``): each chunk's image tokens take their
        image's soft tokens (the encoder runs for a sequence's images when a chunk first
        reaches them) and, when an image's tokens attend both ways, see to the end of their
        image."""
        both_ways = self.images.bidirectional
        batch = _with_images(step_batch, self.embed_width, both_ways)
        embeds, rows, horizons = batch.embeds, batch.embed_rows, batch.horizons
        self._encode_new_images(items)
        row = 0
        for item in items:
            images, end = item.seq.images, item.start + item.length
            for i in [] if images is None else images.overlapping(item.start, end):
                a, b = images.spans[i]
                lo, hi = max(a, item.start), min(b, end)
                chunk_rows = np.arange(row + lo - item.start, row + hi - item.start)
                take, soft = images.soft_tokens(i, lo, hi)
                embeds[chunk_rows[take]] = soft
                rows[chunk_rows[take]] = True
                if both_ways:
                    horizons[chunk_rows] = b - 1
            row += item.length
        return batch

    def _encode_new_images(self, items: tuple[ScheduledSeq, ...]) -> None:
        """Run the image encoder once for the images of every sequence whose chunk reaches them
        first in this step (all of a sequence's images, those of several requests packed
        together), and keep each sequence's soft tokens with it."""
        pending: dict[int, SequenceImages] = {}
        for item in items:
            images = item.seq.images
            if images is not None and images.embeds is None and _reaches_images(item):
                pending[id(images)] = images
        if not pending:
            return
        soft = self.images.encode(tuple(i for images in pending.values() for i in images.images))
        start = 0
        for images in pending.values():
            images.embeds = soft[start : start + len(images.images)]
            start += len(images.images)

    def _bucket(self, batch: ScheduledBatch) -> tuple[int, int]:
        """(num_tokens, num_seqs) of the compiled shape the batch is padded to."""
        if batch.kind is StepKind.DECODE:
            num_seqs = pick(self.plan.decode_seqs, len(batch.items))
            return num_seqs, num_seqs
        tokens = sum(i.length for i in batch.items)
        if len(batch.items) == 1:
            return pick(self.plan.prefill_lens, tokens), 1
        return pick(self.plan.mixed_lens, tokens), self.plan.mixed_seqs

    def _allowed(self, items: tuple[ScheduledSeq, ...], num_seqs: int) -> Any:
        """The step's grammar bitmask: the constrained rows' masks on the host, or, when no
        sequence of the batch samples under a grammar, an all-ones mask kept on the device, so
        free batches transfer none."""
        constrained = [
            (row, item.seq.matcher)
            for row, item in enumerate(items)
            if item.seq.matcher is not None and item.reaches_end
        ]
        if not constrained:
            return self._all_allowed[num_seqs]
        mask = np.full((num_seqs, bitmask_width(self.vocab_size)), -1, np.int32)
        for row, matcher in constrained:
            matcher.fill_mask(mask, row)
        return mask


def _fill_pages(cache: KVCache | HybridCache, pages: jax.Array) -> KVCache | HybridCache:
    if isinstance(cache, HybridCache):  # the pages are the full-attention layers' K/V
        return cache.replace(kv=_fill_pages(cache.kv, pages))
    nan = jnp.asarray(jnp.nan, jnp.float32)
    # to_stored: a cache in integer storage gets NaN's bits, not NaN cast to an integer (0).
    return jax.tree.map(lambda a: a.at[:, pages].set(to_stored(nan, a.dtype)), cache)


def _copy_state_slots(
    cache: HybridCache,
    sources: jax.Array,  # [n] int32
    destinations: jax.Array,  # [n] int32
) -> HybridCache:
    return cache.replace(
        conv=cache.conv.at[:, destinations].set(cache.conv[:, sources]),
        recurrent=cache.recurrent.at[:, destinations].set(cache.recurrent[:, sources]),
    )


def _keeping(update: Any, sharding: Any, cache: KVCache | HybridCache, *args: Any) -> Any:
    """``update(cache, *args)``, the cache it returns kept in ``sharding`` (None: off a mesh)."""
    cache = update(cache, *args)
    return cache if sharding is None else jax.lax.with_sharding_constraint(cache, sharding)


def _constrained(
    forward: Any, sharding: Any, config: Any, weights: Any, cache: KVCache, batch: StepBatch
) -> tuple[jax.Array, KVCache]:
    logits, cache = forward(config, weights, cache, batch)
    if sharding is not None:
        cache = jax.lax.with_sharding_constraint(cache, sharding)
    return logits, cache


def _step(
    forward: Any,
    config: Any,
    replicated: Any,
    weights: Any,
    cache: KVCache,
    batch: StepBatch,
) -> tuple[jax.Array, KVCache]:  # logits [num_seqs, vocab] float32
    """One step's forward: the logits the sampler (``_sample``, compiled on its own) takes."""
    logits, cache = forward(config, weights, cache, batch)
    return _replicate(logits.astype(jnp.float32), replicated), cache


def _sample(replicated: Any, logits: jax.Array, meta: SamplingMetadata) -> SamplerOutput:
    return _replicate(sample(logits, meta), replicated)


def _replicate(tree: Any, sharding: Any) -> Any:
    return tree if sharding is None else jax.lax.with_sharding_constraint(tree, sharding)


def _multi_step(
    forward: Any,
    config: Any,
    replicated: Any,
    num_steps: int,
    weights: Any,
    cache: KVCache,
    batch: StepBatch,
    meta: SamplingMetadata,
) -> tuple[tuple[jax.Array, jax.Array], KVCache]:  # ([num_seqs, num_steps], [num_seqs]) int32
    """``num_steps`` decode steps in one call, each feeding its sampled tokens to the next."""

    def one(carry: tuple[KVCache, StepBatch, SamplingMetadata], _: None):
        cache, batch, meta = carry
        logits, cache = forward(config, weights, cache, batch)
        # The sampler takes replicated logits, as after a single step: on a mesh it then runs
        # the same computation (a seeded draw does not depend on the call) and compiles faster.
        logits = _replicate(logits.astype(jnp.float32), replicated)
        # A decode batch: row s is sequence s's one token (num_tokens == num_seqs).
        tokens = sample(logits, meta).token_ids.astype(jnp.int32)  # [num_seqs]
        active = batch.q_lens > 0  # padding rows stay empty and write nothing
        batch = batch.replace(
            tokens=tokens,
            positions=batch.positions + 1,
            rope_positions=None if batch.rope_positions is None else batch.rope_positions + 1,
            kv_lens=jnp.where(active, batch.kv_lens + 1, 0),
        )
        meta = meta.replace(output_index=meta.output_index + 1)
        return (cache, batch, meta), tokens

    (cache, _, _), tokens = jax.lax.scan(one, (cache, batch, meta), None, length=num_steps)
    return _replicate((tokens.T, tokens[-1]), replicated), cache


def _sampling_metadata(
    items: tuple[ScheduledSeq, ...],
    num_seqs: int,
    eos_token_ids: tuple[int, ...],
    fed_steps: int = 0,
) -> SamplingMetadata:
    """The sampling inputs of a step: padding rows are greedy with nothing to penalize or bias.
    ``fed_steps``: the tokens each sequence gains in the call still running before this one
    (a batch scheduled ahead, whose sequences need no per-token host work)."""
    meta = empty_sampling_metadata(num_seqs)
    for row, item in enumerate(items):
        seq, sp = item.seq, item.seq.sampling
        meta.temperature[row], meta.top_k[row], meta.top_p[row] = sp.temperature, sp.top_k, sp.top_p
        meta.seeds[row], meta.output_index[row] = seq.seed, len(seq.output_ids) + fed_steps
        meta.min_p[row] = sp.min_p
        meta.presence_penalty[row] = sp.presence_penalty
        meta.frequency_penalty[row] = sp.frequency_penalty
        meta.repetition_penalty[row] = sp.repetition_penalty
        meta.wants_logprobs[row] = sp.logprobs is not None and item.reaches_end
        if sp.uses_penalties and item.reaches_end:
            n = min(sp.repeat_last_n if sp.repeat_last_n > 0 else PENALTY_WINDOW, seq.num_tokens)
            meta.history[row, PENALTY_WINDOW - n :] = seq.token_slice(
                seq.num_tokens - n, seq.num_tokens
            )
            meta.num_output_in_history[row] = min(n, len(seq.output_ids))
        bias = [(t, -np.inf if b <= -100.0 else b) for t, b in sp.logit_bias]
        if len(seq.output_ids) + fed_steps < sp.min_tokens:
            banned = sp.banned_until_min_tokens(eos_token_ids)
            bias += [(t, -np.inf) for t in banned]
        if bias:
            ids, values = zip(*bias, strict=True)
            meta.bias_ids[row, : len(ids)], meta.bias_values[row, : len(ids)] = ids, values
    return meta


def _host_logprobs(items: tuple[ScheduledSeq, ...], out: SamplerOutput) -> dict[str, TokenLogprobs]:
    """Copy the logprobs of the rows that asked for them to the host."""
    tokens, chosen = np.asarray(out.token_ids), np.asarray(out.logprobs)
    top_ids, top_values = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    result = {}
    for row, item in enumerate(items):
        k = item.seq.sampling.logprobs
        if k is None or not item.reaches_end:
            continue
        top = tuple(zip(top_ids[row, :k].tolist(), top_values[row, :k].tolist(), strict=True))
        entry = TokenLogprobs(int(tokens[row]), float(chosen[row]), top)
        result[item.seq.request_id] = entry
    return result


def _shape(batch: StepBatch) -> tuple[int, int, int]:
    """(num_tokens, num_seqs, pages): the bucket a prepared batch was padded to."""
    return batch.tokens.shape[0], batch.num_seqs, batch.page_indices.shape[1]


IMAGES = "images"  # the last element of the compiled key of a step that prefills image tokens
SAMPLER = "sampler"  # the first element of the compiled key of the sampler, (SAMPLER, rows)


def _key(batch: StepBatch, steps: int) -> tuple[Any, ...]:
    """The compiled key of a prepared batch run for ``steps`` steps."""
    return (*_shape(batch), steps) + (() if batch.embeds is None else (IMAGES,))


def _rope_positions(items: tuple[ScheduledSeq, ...], num_tokens: int) -> np.ndarray:
    """Each row's (temporal, height, width) rotary positions in a multimodal-rope model: its
    position three times, or inside and after a prompt's images what ``SequenceImages``
    gives (padding rows: zeros)."""
    out = np.zeros((num_tokens, 3), np.int32)
    row = 0
    for item in items:
        start, end, images = item.start, item.start + item.length, item.seq.images
        if images is None or images.grids is None:
            out[row : row + item.length] = np.arange(start, end)[:, None]
        else:
            out[row : row + item.length] = images.rope_positions(start, end)
        row += item.length
    return out


def _reaches_images(item: ScheduledSeq) -> bool:
    images = item.seq.images
    return images is not None and bool(images.overlapping(item.start, item.start + item.length))


def _with_images(batch: StepBatch, width: int, both_ways: bool) -> StepBatch:
    """``batch`` with image inputs that change nothing: no row takes an embedding, and, for
    images whose tokens attend both ways, every row sees up to its own position (host arrays,
    filled in by ``_image_rows``; causal images need no horizons, so the kernels still run)."""
    num_tokens = batch.tokens.shape[0]
    return batch.replace(
        embeds=np.zeros((num_tokens, width), np.float32),
        embed_rows=np.zeros(num_tokens, bool),
        horizons=np.array(batch.positions, np.int32) if both_ways else None,
    )


def _empty_inputs(
    num_tokens: int, num_seqs: int, pages: int, vocab_size: int, single_chunk: bool = False
) -> tuple[StepBatch, SamplingMetadata]:
    """All-padding inputs of a bucket's shape: they compile the step and write nothing."""
    zeros = functools.partial(np.zeros, dtype=np.int32)
    batch = StepBatch(
        zeros(num_tokens),
        zeros(num_tokens),
        zeros(num_tokens),
        np.zeros(num_tokens, bool),
        zeros(num_seqs + 1),
        zeros(num_seqs),
        zeros((num_seqs, pages)),
        zeros(num_seqs),
        decode_rows=num_tokens == num_seqs,  # mixed steps have more tokens than sequences
        state_slots=np.full(num_seqs, NO_STATE_SLOT, np.int32),
        single_chunk=single_chunk,
    )
    return batch, empty_sampling_metadata(num_seqs, vocab_size)
