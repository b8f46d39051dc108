"""The engine: a loop thread that steps the scheduler and the model runner, and request streams.

1. ``generate`` validates the prompt, wraps it in a ``Sequence`` and posts it to the loop thread's
   inbox; it returns an async iterator bound to the caller's event loop.
2. The loop thread drains the inbox (new sequences, aborts), then runs ``step``: the scheduler picks
   the work, the runner pads it to a bucket and dispatches the jitted step, the scheduler applies
   the sampled tokens (stops, finishes, frees pages). With async scheduling, while a decode call
   runs the next one is dispatched already (``Scheduler.schedule_ahead``: its input tokens are
   fed on the device), so the host's turn between calls overlaps the device's work.
3. Each changed sequence's new token goes to its stream with ``call_soon_threadsafe``; the iterator
   detokenizes incrementally, applies stop strings (``runtime.text.stop_strings``: a match ends
   the sequence) and yields ``GenerationDelta``s of finished text. Leaving it early aborts.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from jax_llm_runtime.runtime.engine.compiled_shapes import CompiledShapes, release_freed_memory
from jax_llm_runtime.runtime.engine.embedder import EmbeddingRunner, ForwardJob, Pooling
from jax_llm_runtime.runtime.engine.grammar import GrammarCompiler, GrammarMatcher
from jax_llm_runtime.runtime.engine.interface import EngineOverloadedError
from jax_llm_runtime.runtime.engine.model_runner import InFlight, ModelRunner, StepResult
from jax_llm_runtime.runtime.engine.request import (
    FinishReason,
    GenerationDelta,
    OutputError,
    SamplingFieldError,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
    check_context,
)
from jax_llm_runtime.runtime.engine.scheduler import ScheduledBatch, Scheduler
from jax_llm_runtime.runtime.engine.sequence import Sequence, SequenceStatus
from jax_llm_runtime.runtime.engine.stats import EngineStats
from jax_llm_runtime.runtime.multimodal.inputs import ImageInput, SequenceImages
from jax_llm_runtime.runtime.multimodal.processor import ImageProcessor
from jax_llm_runtime.runtime.text.stop_strings import OutputText

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StepOutput]


class EngineDeadError(RuntimeError):
    """The loop thread stopped; no request can be served."""


class Engine:
    """Implements ``runtime.engine.interface.EngineClient`` over a scheduler and a model runner."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        seed: int = 0,
        embedder: EmbeddingRunner | None = None,
        max_waiting: int = 0,
        precompile: str = "first",
        async_scheduling: bool = True,
    ) -> None:
        self.runner = runner
        # Dispatch the next decode call before reading the running one's tokens (vLLM's
        # --async-scheduling); ``_ahead`` is that call, dispatched and not yet applied.
        self.async_scheduling = async_scheduling
        self._ahead: InFlight | None = None
        self.precompile = precompile  # when the step shapes compile (EngineConfig.precompile)
        # Each kernel's implementation, {kernel: implementation}, set by the builder
        # (pallas_kernels.selection); /metrics reports it.
        self.kernel_choices: dict[str, str] = {}
        self.embedder = embedder
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting  # sequences admitted past max_num_seqs; 0: no bound
        self._admission = threading.Lock()  # the admission check and its streams, together
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._compiler: threading.Thread | None = None
        self.compile_done = threading.Event()  # set once every bucket is compiled
        self._arrivals = 0
        # Per-request sampling seeds: reproducible for a given --seed and request order.
        self._seeds = random.Random(seed)
        self._error: BaseException | None = None
        self.num_steps = 0
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, compile_all: bool = False, loop: bool = True) -> None:
        """Compile ahead as ``precompile`` says (``compile_all`` overrides it with "all"): what
        the first requests need before returning and every other bucket on a background thread
        ("first"), everything before returning ("all"), or nothing, each shape then compiling
        when a step first needs it ("none"). Then start the loop thread. Without ``loop`` only
        the compiling happens: a multi-node follower replays the leader's calls instead."""
        if self._thread is not None or self._compiler is not None or self.compile_done.is_set():
            return
        mode = "all" if compile_all else self.precompile
        background = self._compile_ahead(mode)
        self.runner.compile_on_demand = mode == "none"
        if loop:
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()
        if not any(keys for _, keys in background):
            release_freed_memory()
            self.compile_done.set()
            return
        self._compiler = threading.Thread(
            target=self._compile_background, args=(background,), name="compile", daemon=True
        )
        self._compiler.start()

    def _compile_ahead(self, mode: str) -> list[tuple[CompiledShapes, list]]:
        """Compile what ``mode`` compiles before serving; return what is left for the
        background thread."""
        if mode == "none":
            logger.info("no step shape compiled ahead: each compiles when a step first needs it")
            return []
        first, rest = self.runner.startup_shapes()
        if mode == "all":
            first, rest = first + rest, []
        seconds = self.runner.compiled.compile_now(first)
        logger.info(
            "compiled %d step shapes in %.1fs (%d more compile in the background)",
            len(first),
            seconds,
            len(rest),
        )
        background = [(self.runner.compiled, rest)]
        images = self.runner.images
        if images is not None and mode == "all":
            images.compiled.compile_now(images.keys())
        elif images is not None:
            background.insert(0, (images.compiled, images.keys()))
        if self.embedder is not None:
            if mode == "all":
                seconds = self.embedder.compiled.compile_now(self.embedder.keys())
                logger.info(
                    "compiled %d cache-free forward shapes in %.1fs",
                    len(self.embedder.keys()),
                    seconds,
                )
            else:
                background.append((self.embedder.compiled, self.embedder.keys()))
        return background

    def _compile_background(self, work: list[tuple[CompiledShapes, list]]) -> None:
        t0 = time.perf_counter()
        try:
            count = sum(compiled.compile_each(keys, self._stop) for compiled, keys in work)
        except Exception:  # a failed compile is that shape's; the step compiles it on first use
            logger.exception("the background compile stopped")
        else:
            if not self._stop.is_set():
                logger.info(
                    "compiled the other %d shapes in the background in %.1fs",
                    count,
                    time.perf_counter() - t0,
                )
        finally:
            release_freed_memory()
            self.compile_done.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._compiler is not None:
            self._compiler.join(timeout=120)
            self._compiler = None

    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def stats(self) -> EngineStats:
        """Read from any thread without a lock: in CPython, reading an int attribute or ``len()``
        of a list/deque is atomic, so each count is a value the loop thread really held (the
        counts may come from adjacent steps, which is fine for monitoring)."""
        scheduler = self.scheduler
        slots = scheduler.state_slots
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_pages_total=scheduler.allocator.num_pages,
            num_pages_free=scheduler.allocator.num_free,
            num_preemptions=scheduler.num_preemptions,
            num_prefix_cache_queries=scheduler.num_cache_queried_tokens,
            num_prefix_cache_hits=scheduler.num_cache_hit_tokens,
            num_pages_cached=scheduler.allocator.num_cached,
            num_compiling=int(not self.compile_done.is_set()),
            num_state_slots_used=0 if slots is None else slots.num_used,
            num_state_slots_total=0 if slots is None else slots.num_slots,
        )

    # -- requests ----------------------------------------------------------------------------
    @property
    def image_processor(self) -> ImageProcessor | None:
        """How this model's images are preprocessed and placed in its prompts; None for a
        model that takes no images."""
        return None if self.runner.images is None else self.runner.images.processor

    def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        images: tuple[ImageInput, ...] = (),
    ) -> AsyncIterator[GenerationDelta]:
        """Validate now (``ValueError`` at call time), then stream the request's deltas."""
        return self.generate_n(prompt_token_ids, sampling, request_id, 1, images)[0]

    def generate_n(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        n: int,
        images: tuple[ImageInput, ...] = (),
    ) -> list[AsyncIterator[GenerationDelta]]:
        """``n`` independent samples of one prompt, computed once: the first sequence prefills
        the prompt, the others start on its pages (shared by reference count).

        Stream ``i`` has request id ``f"{request_id}-{i}"`` when ``n > 1``. The sequences are
        queued at once; closing a stream before it finished aborts that sequence only. Raises
        EngineOverloadedError, queueing nothing, when they would make more than ``max_waiting``
        sequences wait for a slot. ``images`` (a vision-language model's, preprocessed by
        ``image_processor``) go, in order, to the runs of image tokens in the prompt; a count
        that differs is a ``ValueError``.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self._validate(prompt_token_ids, sampling)
        seq_images = self._images(prompt_token_ids, images)
        if not self.healthy():
            raise EngineDeadError("the engine is not running")
        ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        matchers = [self._matcher(sampling.grammar) for _ in ids]
        loop = asyncio.get_running_loop()
        with self._admission:
            self._admit(n)
            seqs = [
                Sequence(
                    rid,
                    list(prompt_token_ids),
                    sampling,
                    self._seed(sampling, i),
                    self._next_arrival(),
                )
                for i, rid in enumerate(ids)
            ]
            seqs[0].forks = seqs[1:]
            for seq, matcher in zip(seqs, matchers, strict=True):
                seq.matcher, seq.images = matcher, seq_images
            # Streams exist before the loop thread sees the sequences, so no token can be missed.
            streams = []
            for seq in seqs:
                self._streams[seq.request_id] = _Stream(loop, asyncio.Queue())
                streams.append(self._deltas(seq))
        self._post("add", seqs[0])
        return streams

    def _images(self, prompt: list[int], images: tuple[ImageInput, ...]) -> SequenceImages | None:
        """Where the prompt's images go; a ValueError when the model takes none, or the prompt's
        image tokens do not match them."""
        processor = self.image_processor
        if processor is None:
            if images:
                raise ValueError(f"{self.model_name} does not accept images")
            return None
        return processor.locate(prompt, tuple(images))

    def _matcher(self, grammar: str | None) -> GrammarMatcher | None:
        """A new matcher for one sequence of a constrained request (GrammarError, a ValueError,
        when the grammar does not compile)."""
        if grammar is None:
            return None
        if self._grammars is None:
            hf = getattr(self.tokenizer, "hf", None)
            if hf is None:
                raise ValueError(f"{self.model_name}'s tokenizer cannot constrain output")
            self._grammars = GrammarCompiler(
                hf, self.runner.vocab_size, self.scheduler.eos_token_ids
            )
        return self._grammars.matcher(grammar)

    def _seed(self, sampling: SamplingParams, index: int) -> int:
        """The request's seed (sample ``index`` of n > 1 adds its index), else a random one."""
        if sampling.seed is None:
            return self._seeds.getrandbits(32)
        return (sampling.seed + index) % 2**32

    def _validate(self, prompt: list[int], sampling: SamplingParams) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            bad_id = next(t for t in prompt if not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad_id} is outside the vocabulary [0, {vocab})")
        bad = [t for t, _ in sampling.logit_bias if t >= vocab]
        if bad:
            raise SamplingFieldError(
                "logit_bias", f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        check_context(self.max_model_len, len(prompt), sampling.max_tokens)
        requested = len(prompt) + sampling.max_tokens
        # Beyond the whole KV cache a sequence would wait for pages forever.
        page_size, num_pages = self.scheduler.page_size, self.scheduler.allocator.num_pages
        if -(-requested // page_size) > num_pages:
            raise ValueError(
                f"The KV cache holds {num_pages * page_size} tokens in all; you requested "
                f"{requested} tokens ({len(prompt)} in the messages, {sampling.max_tokens} in "
                "the completion). Please reduce the length of the messages or completion."
            )

    def _next_arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals

    async def embed(self, inputs: list[list[int]], pooling: Pooling) -> list[np.ndarray]:
        """Pooled, unnormalised float32 embeddings, computed on the loop thread between steps."""
        if self.embedder is None:
            raise ValueError(f"{self.model_name} cannot produce embeddings")
        for ids in inputs:
            if not 1 <= len(ids) <= self.max_model_len:
                raise ValueError(
                    f"an input has {len(ids)} tokens; embeddings take 1 to "
                    f"{self.max_model_len} tokens"
                )
        if not self.healthy():
            raise EngineDeadError("the engine is not running")
        inputs = [list(ids) for ids in inputs]
        job = ForwardJob(lambda runner: [runner.embed(ids, pooling) for ids in inputs])
        self._post("forward", job)
        return await job.future

    async def prompt_logprobs(
        self, prompt_token_ids: list[int], top: int
    ) -> list[TokenLogprobs | None]:
        """Each prompt token's logprob given the ones before it (None for the first), with the
        ``top`` most likely alternatives; computed on the loop thread between steps."""
        if self.embedder is None:
            raise ValueError(f"{self.model_name} cannot score prompts")
        if not 1 <= len(prompt_token_ids) <= self.max_model_len:
            raise ValueError(f"the prompt must have 1 to {self.max_model_len} tokens")
        if not self.healthy():
            raise EngineDeadError("the engine is not running")
        ids = list(prompt_token_ids)
        job = ForwardJob(lambda runner: runner.prompt_logprobs(ids, top))
        self._post("forward", job)
        return await job.future

    def _deltas(self, seq: Sequence) -> _RequestStream:
        return _RequestStream(self, seq, self._streams[seq.request_id].queue)

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    # -- the loop thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.scheduler.has_work() and self._ahead is None:
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self.step()
        except BaseException as e:  # the loop must report any death to every waiting client
            logger.exception("engine loop died")
            self._error = e
        finally:
            self._drain_inbox()
            for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
                self.scheduler.abort(seq.request_id)
            for request_id in list(self._streams):
                self._send(request_id, StepOutput([], FinishReason.ABORT))

    def step(self) -> None:
        """One engine step: schedule (or take the call scheduled ahead), run the jitted step,
        apply and publish the results. With async scheduling the next decode call is
        dispatched before this one's tokens are read, so that this turn of the host overlaps
        the device's work on it."""
        call, self._ahead = self._ahead, None
        if call is None:
            batch = self.scheduler.schedule()
            if batch is None:
                return
            call = self._dispatch(batch)
        if call is not None:
            ahead = self._dispatch_ahead(call)
            try:
                result = self.runner.collect(call)
            except Exception as exc:
                self._isolate_failure(call.batch, exc)  # the call ahead ran on its tokens
            else:
                self._publish(call.batch, result)
                self._ahead = ahead
        self.num_steps += 1

    def _dispatch(self, batch: ScheduledBatch) -> InFlight | None:
        """Start ``batch`` on the device; None when it raised (its requests isolated)."""
        self._fill_fresh_pages()
        try:
            return self.runner.dispatch(batch)
        except Exception as exc:
            self._isolate_failure(batch, exc)
            return None

    def _dispatch_ahead(self, call: InFlight) -> InFlight | None:
        """The decode call after ``call``, dispatched now where the scheduler can tell it
        without ``call``'s tokens (``Scheduler.schedule_ahead``); not on a multi-node leader,
        whose followers replay host inputs."""
        if not self.async_scheduling or self.runner.mirror is not None:
            return None
        batch = self.scheduler.schedule_ahead(call.batch, call.steps)
        if batch is None:
            return None
        self._fill_fresh_pages()
        try:
            return self.runner.dispatch(batch, fed=call)
        except Exception:
            if self.runner.cache_lost():
                raise
            # Its sequences keep the pages it reserved and decode in the next scheduled step.
            logger.exception("a decode call scheduled ahead did not start")
            return None

    def _fill_fresh_pages(self) -> None:
        fresh = self.scheduler.allocator.take_fresh()  # empty unless --debug-fill-freed-pages
        if fresh:
            self.runner.fill_pages(fresh)

    def _publish(self, batch: ScheduledBatch, result: StepResult) -> None:
        before = {id(item.seq): len(item.seq.output_ids) for item in batch.items}
        for seq in self.scheduler.update(batch, result.token_ids):
            logprobs = result.logprobs_for(seq.request_id)
            new_tokens = seq.output_ids[before[id(seq)] :]
            self._send(seq.request_id, StepOutput(new_tokens, seq.finish_reason, logprobs))

    def _isolate_failure(self, batch: ScheduledBatch, exc: Exception) -> None:
        """A step raised: fail the requests whose work raises on its own, serve the others.

        Each sequence of a batch runs alone once; the ones that still raise end with
        ``FinishReason.ERROR``. When the step had consumed the donated KV cache no sequence can
        go on: the loop dies (re-raising) and every client gets an error. (No count of failed
        steps ends the loop: a client could then stop the server by repeating a bad request.)
        """
        if self.runner.cache_lost():
            raise exc
        logger.exception("a step of %d sequences failed", len(batch.items))
        # Sequences that finished since (in the call before one scheduled ahead) are done.
        items = [i for i in batch.items if i.seq.status is SequenceStatus.RUNNING]
        if len(items) == 1:
            self._fail(items[0].seq)
            return
        for item in items:
            alone = ScheduledBatch(batch.kind, (item,))
            try:
                result = self.runner.run(alone)
            except Exception:
                if self.runner.cache_lost():
                    raise exc from None
                logger.exception("request %s failed", item.seq.request_id)
                self._fail(item.seq)
            else:
                self._publish(alone, result)

    def _fail(self, seq: Sequence) -> None:
        self.scheduler.abort(seq.request_id, FinishReason.ERROR)
        self._send(seq.request_id, StepOutput([], FinishReason.ERROR))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.scheduler.add(payload)
            elif kind == "forward":
                payload.run(self.embedder)
            else:
                self.scheduler.abort(payload)
                self._streams.pop(payload, None)

    def _send(self, request_id: str, out: StepOutput) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if out.finish_reason is not None:
            del self._streams[request_id]
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:  # the caller's event loop has closed: nobody reads this stream
            self._streams.pop(request_id, None)
            if out.finish_reason is None:
                self._post("abort", request_id)

    # -- admission -----------------------------------------------------------------------------
    def num_unfinished(self) -> int:
        """Sequences queued or running that have not finished: the engine's load. Any thread."""
        return len(self._streams)

    def num_waiting(self) -> int:
        """Unfinished sequences beyond the ``max_num_seqs`` that can run at once: the ones that
        wait for a slot, posted or queued. Any thread (``len`` of a dict is atomic)."""
        return max(0, len(self._streams) - self.scheduler.max_num_seqs)

    def _admit(self, n: int) -> None:
        """Refuse ``n`` more sequences when no free queue could ever hold them (a ValueError) or
        this one cannot now (EngineOverloadedError). Call holding ``_admission``."""
        if not self.max_waiting:
            return
        room = self.scheduler.max_num_seqs + self.max_waiting
        if n > room:
            raise SamplingFieldError(
                "n",
                f"n={n} sequences can never be admitted: this server holds {room} at most "
                f"({self.scheduler.max_num_seqs} running, {self.max_waiting} waiting)",
            )
        if len(self._streams) + n > room:
            raise EngineOverloadedError(self.num_waiting(), self.max_waiting)


class _RequestStream:
    """One sequence's deltas as an async iterator; detokenizes incrementally.

    ``aclose()`` (or leaving an ``async for`` early, through the caller's cleanup) aborts the
    sequence if it has not finished, also when the stream was never iterated.
    """

    def __init__(self, engine: Engine, seq: Sequence, queue: asyncio.Queue[StepOutput]) -> None:
        self._engine = engine
        self._seq = seq
        self._queue = queue
        self._decoder = engine.tokenizer.incremental_decoder(seq.sampling.skip_special_tokens)
        self._text = OutputText(seq.sampling.stop)
        self._num_output = 0
        self._finished = False

    def __aiter__(self) -> _RequestStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        if self._finished:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        try:
            return self._delta(out)
        except Exception as exc:  # detokenizing or matching stop strings: this request alone
            await self.aclose()
            raise OutputError(
                f"request {self._seq.request_id}: its tokens could not be turned into text "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    def _delta(self, out: StepOutput) -> GenerationDelta:
        self._num_output += len(out.token_ids)
        reason = out.finish_reason
        # The EOS or stop token that ended the sequence counts as output but is not text (as in
        # vLLM), also with skip_special_tokens=False.
        shown = out.token_ids[:-1] if reason is FinishReason.STOP else out.token_ids
        text = self._decoder.push(shown)
        if reason is not None:
            text += self._decoder.flush()  # a trailing incomplete character, if any
        text, logprobs, final = self._text.delta(text, tuple(out.logprobs), reason)
        if final is not None and reason is None:  # a stop string: the sequence ends here
            self._engine._post("abort", self._seq.request_id)  # and its pages are freed at once
        reason = final
        self._finished = reason is not None
        return GenerationDelta(
            token_ids=tuple(out.token_ids),
            text=text,
            num_prompt_tokens=len(self._seq.prompt_ids),
            num_output_tokens=self._num_output,
            num_cached_tokens=self._seq.num_cached_tokens,
            finish_reason=reason,
            logprobs=logprobs,
        )

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine._post("abort", self._seq.request_id)
