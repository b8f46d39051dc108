"""A deterministic engine without a model, so the HTTP layer can be tested without weights.

1. ``MockTokenizer`` is byte-level: every UTF-8 byte is one token id (0..255), plus a BOS and an EOS
   id; its chat template is ChatML-like.
2. ``MockEngine.generate`` replies with the next of its scripted ``replies`` (one per request, in
   order), else with a fixed ``reply`` text, or by default with the prompt's text reversed (for a
   rendered chat, the last user message reversed), one token per delta with a short
   ``asyncio.sleep`` between them, then EOS.
3. It honours ``max_tokens``, ``max_model_len``, ``stop_token_ids``, ``stop`` and ``ignore_eos`` like the real
   engine, and records every request and every abort (a consumer that stops iterating early) so
   tests can assert on them from any thread.
4. It admits like the real engine: at most ``max_num_seqs`` streams produce tokens at once, the
   others wait for a slot in arrival order, and past ``max_waiting`` waiting sequences
   ``generate_n`` raises ``EngineOverloadedError``.
"""

from __future__ import annotations

import asyncio
import codecs
import threading
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jax_llm_runtime.runtime.engine.interface import EngineOverloadedError
from jax_llm_runtime.runtime.engine.request import (
    FinishReason,
    GenerationDelta,
    SamplingFieldError,
    SamplingParams,
    TokenLogprobs,
    check_context,
)
from jax_llm_runtime.runtime.engine.stats import EngineStats
from jax_llm_runtime.runtime.text.stop_strings import OutputText

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258
EMBED_DIM = 8
_SPECIAL_TEXT = {BOS_ID: "<s>", EOS_ID: "</s>"}
_USER_TURN = "<|im_start|>user\n"
_END_TURN = "<|im_end|>"


class MockTokenizer:
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, 256 is BOS, 257 is EOS."""

    eos_token_ids: frozenset[int] = frozenset({EOS_ID})
    # Set to e.g. ("<think>", "</think>") to test a reasoning model's replies.
    reasoning_markers: tuple[str, str] | None = None

    def __init__(self) -> None:
        self.template_kwargs: list[dict[str, Any]] = []  # extra variables of each render

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text to token ids; a BOS id is prepended when ``add_special_tokens``."""
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text; invalid UTF-8 becomes U+FFFD. Raises ValueError on ids out of range."""
        out: list[str] = []
        buf = bytearray()
        for token_id in token_ids:
            if not 0 <= token_id < VOCAB_SIZE:
                raise ValueError(f"token id {token_id} is outside the vocabulary [0, {VOCAB_SIZE})")
            if token_id < 256:
                buf.append(token_id)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if not skip_special_tokens:
                out.append(_SPECIAL_TEXT[token_id])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message."""
        self.template_kwargs.append(dict(kwargs))
        parts = []
        for message in messages:
            if not isinstance(message.get("content"), str):
                raise ValueError("mock chat template: every message needs string content")
            parts.append(f"<|im_start|>{message['role']}\n{message['content']}{_END_TURN}\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


@dataclass(frozen=True)
class MockRequestRecord:
    """What ``MockEngine.generate`` was called with."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams


class MockEngine:
    """An ``EngineClient`` that answers deterministically; see the module docstring.

    ``reply``: the text every request generates (before EOS); ``None`` echoes the prompt's text
    (a chat's last user message) reversed. ``replies``: texts the next requests generate, one
    each and in order, before ``reply`` applies (tests append to it, e.g. for tool-call turns).
    ``token_delay_s``: the pause before each delta, so streams interleave and can be interrupted. ``max_num_seqs`` and ``max_waiting`` (0: no bound)
    as in ``runtime.config.EngineConfig``.
    """

    def __init__(
        self,
        model_name: str = "mock-model",
        max_model_len: int = 2048,
        reply: str | None = None,
        token_delay_s: float = 0.001,
        max_num_seqs: int = 16,
        max_waiting: int = 0,
        replies: Sequence[str] = (),
    ) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if token_delay_s < 0:
            raise ValueError(f"token_delay_s must be >= 0, got {token_delay_s}")
        if max_num_seqs < 1 or max_waiting < 0:
            raise ValueError(
                f"max_num_seqs must be >= 1 and max_waiting >= 0, got {max_num_seqs}, {max_waiting}"
            )
        self.model_name = model_name
        self.kernel_choices: dict[str, str] = {}  # no kernels run
        self.max_model_len = max_model_len
        self.tokenizer = MockTokenizer()
        self.reply = reply
        self.replies: deque[str] = deque(replies)
        self.token_delay_s = token_delay_s
        self.started = False
        self.requests: list[MockRequestRecord] = []
        self.aborted: list[str] = []
        self._unhealthy = False
        self._stopping = False
        self._changed = threading.Condition()
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.num_running = 0  # streams holding one of the max_num_seqs slots
        self._num_admitted = 0  # streams handed out and not yet finished or closed
        self._queue: deque[object] = deque()  # streams iterated and waiting for a slot, in order

    def start(self) -> None:
        """Mark the engine as serving."""
        self.started = True
        self._stopping = False

    def shutdown(self) -> None:
        """Stop serving; streams still running end with finish_reason ``abort``."""
        self._stopping = True
        self.started = False

    def healthy(self) -> bool:
        """True between ``start`` and ``shutdown`` unless ``mark_unhealthy`` was called."""
        return self.started and not self._unhealthy

    def stats(self) -> EngineStats:
        """Running and waiting streams; the mock has no KV cache, so those counts are 0."""
        return EngineStats(self.num_running, self.num_waiting(), 0, 0, 0)

    def num_waiting(self) -> int:
        """Unfinished streams beyond the ``max_num_seqs`` that can run at once."""
        return max(0, self._num_admitted - self.max_num_seqs)

    def mark_unhealthy(self) -> None:
        """Make ``healthy()`` return False (to test the health route)."""
        self._unhealthy = True

    def wait_for_aborts(self, count: int, timeout_s: float = 5.0) -> bool:
        """Block until at least ``count`` requests were aborted; False on timeout. Thread-safe."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self.aborted) >= count, timeout_s)

    def _reply_ids(self, prompt_token_ids: list[int]) -> list[int]:
        if self.replies:
            return self.tokenizer.encode(self.replies.popleft(), add_special_tokens=False)
        if self.reply is not None:
            return self.tokenizer.encode(self.reply, add_special_tokens=False)
        prompt_text = self.tokenizer.decode(prompt_token_ids)
        if _USER_TURN in prompt_text:  # a rendered chat: answer its last user message
            prompt_text = prompt_text.rsplit(_USER_TURN, 1)[1].split(_END_TURN, 1)[0]
        return self.tokenizer.encode(prompt_text[::-1], add_special_tokens=False)

    def _validate(self, prompt_token_ids: list[int]) -> None:
        if not self.started:
            raise RuntimeError("MockEngine.generate called before start()")
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {VOCAB_SIZE})")

    def generate(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> AsyncIterator[GenerationDelta]:
        """Yield one delta per generated token; see ``EngineClient.generate``.

        Raises ValueError when the prompt is empty, too long or holds ids outside the vocabulary,
        EngineOverloadedError when the waiting queue is full. Leaving the iteration early records
        ``request_id`` in ``aborted``.
        """
        return self.generate_n(prompt_token_ids, sampling, request_id, 1)[0]

    async def _run(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> AsyncGenerator[GenerationDelta, None]:
        bad_bias = [t for t, _ in sampling.logit_bias if t >= VOCAB_SIZE]
        if bad_bias:
            raise SamplingFieldError(
                "logit_bias", f"logit_bias token id {bad_bias[0]} is outside [0, {VOCAB_SIZE})"
            )
        self.requests.append(MockRequestRecord(request_id, tuple(prompt_token_ids), sampling))
        num_prompt = len(prompt_token_ids)
        reply = self._reply_ids(prompt_token_ids)
        limit = min(sampling.max_tokens, self.max_model_len - num_prompt)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        output = OutputText(sampling.stop)  # stop strings, as the engine applies them
        finished = running = False
        try:
            running = await self._wait_for_slot()
            if not running:  # shut down while waiting
                finished = True
                yield GenerationDelta((), "", num_prompt, 0, FinishReason.ABORT)
                return
            for step in range(limit):
                await asyncio.sleep(self.token_delay_s)
                if self._stopping:
                    finished = True
                    yield GenerationDelta((), "", num_prompt, step, FinishReason.ABORT)
                    return
                token = _next_token(reply, step, sampling)
                stops = token == EOS_ID or token in sampling.stop_token_ids
                text = "" if stops else decoder.decode(bytes([token]))
                reason = FinishReason.STOP if stops else None
                if reason is None and step + 1 == limit:
                    reason = FinishReason.LENGTH
                logprobs = _mock_logprobs(token, sampling.logprobs)
                text, logprobs, final = output.delta(text, logprobs, reason)
                if (
                    final is not None and reason is None
                ):  # a stop string, aborted as the engine does
                    self._record_abort(request_id)
                reason = final
                finished = reason is not None
                yield GenerationDelta((token,), text, num_prompt, step + 1, reason, logprobs)
                if finished:
                    return
        finally:
            if running:
                self.num_running -= 1
            if not finished:
                self._record_abort(request_id)

    def generate_n(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str, n: int
    ) -> list[AsyncIterator[GenerationDelta]]:
        """``n`` streams as ``EngineClient.generate_n`` names them (the mock's replies are equal)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self._validate(prompt_token_ids)
        check_context(self.max_model_len, len(prompt_token_ids), sampling.max_tokens)
        if sampling.grammar is not None:  # its echo could not follow one
            raise SamplingFieldError("response_format", "the mock engine cannot constrain output")
        room = self.max_num_seqs + self.max_waiting
        if self.max_waiting and n > room:
            raise SamplingFieldError("n", f"n={n} sequences can never be admitted: {room} at most")
        if self.max_waiting and self._num_admitted + n > room:
            raise EngineOverloadedError(self.num_waiting(), self.max_waiting)
        ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        self._num_admitted += n
        return [_Admitted(self, self._run(prompt_token_ids, sampling, rid)) for rid in ids]

    async def _wait_for_slot(self) -> bool:
        """Take a running slot once the streams iterated earlier have theirs; False when the
        engine shuts down first."""
        ticket = object()
        self._queue.append(ticket)
        try:
            while self._queue[0] is not ticket or self.num_running >= self.max_num_seqs:
                if self._stopping:
                    return False
                await asyncio.sleep(max(self.token_delay_s, 0.001))
        finally:
            self._queue.remove(ticket)
        self.num_running += 1
        return True

    def _release(self) -> None:
        self._num_admitted -= 1

    async def prompt_logprobs(
        self, prompt_token_ids: list[int], top: int
    ) -> list[TokenLogprobs | None]:
        """A fixed fake score per token (-1.0, alternatives -2.0, -3.0, ...), None for the first."""
        self._validate(prompt_token_ids)
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"the prompt must have 1 to {self.max_model_len} tokens")
        alternatives = tuple((t, -2.0 - i) for i, t in enumerate(range(top)))
        return [None] + [TokenLogprobs(t, -1.0, alternatives) for t in prompt_token_ids[1:]]

    async def embed(self, inputs: list[list[int]], pooling: str) -> list[np.ndarray]:
        """Deterministic ``[EMBED_DIM]`` vectors: the mean (or last) of a fixed random vector per
        token id. Raises ValueError like ``EngineClient.embed``."""
        if not self.started:
            raise RuntimeError("MockEngine.embed called before start()")
        if pooling not in ("mean", "last"):
            raise ValueError(f"pooling must be mean or last, got {pooling!r}")
        for ids in inputs:
            if not 1 <= len(ids) <= self.max_model_len:
                raise ValueError(
                    f"an input has {len(ids)} tokens; embeddings take 1 to {self.max_model_len}"
                )
            if any(not 0 <= t < VOCAB_SIZE for t in ids):
                raise ValueError(f"token ids must be in [0, {VOCAB_SIZE})")
        table = np.random.default_rng(0).standard_normal((VOCAB_SIZE, EMBED_DIM)).astype(np.float32)
        await asyncio.sleep(0)
        return [table[ids].mean(axis=0) if pooling == "mean" else table[ids[-1]] for ids in inputs]

    def _record_abort(self, request_id: str) -> None:
        with self._changed:
            self.aborted.append(request_id)
            self._changed.notify_all()


class _Admitted:
    """A stream that holds its place in the mock's admission count until its last delta, its
    end, or ``aclose`` (also when it was never iterated)."""

    def __init__(self, engine: MockEngine, deltas: AsyncGenerator[GenerationDelta, None]) -> None:
        self._engine = engine
        self._deltas = deltas
        self._held = True

    def __aiter__(self) -> _Admitted:
        return self

    async def __anext__(self) -> GenerationDelta:
        try:
            delta = await anext(self._deltas)
        except BaseException:
            self._release()
            raise
        if delta.finish_reason is not None:
            self._release()
        return delta

    async def aclose(self) -> None:
        try:
            await self._deltas.aclose()
        finally:
            self._release()

    def _release(self) -> None:
        if self._held:
            self._held = False
            self._engine._release()


def _next_token(reply: list[int], step: int, sampling: SamplingParams) -> int:
    """The reply's ``step``-th token, EOS after it; with ignore_eos the reply repeats instead."""
    if step < len(reply):
        return reply[step]
    if sampling.ignore_eos and reply:
        return reply[step % len(reply)]
    return EOS_ID


def _mock_logprobs(token: int, k: int | None) -> tuple[TokenLogprobs, ...]:
    """Fixed logprobs when asked: the token at -0.5, alternatives token+1, token+2, ... lower."""
    if k is None:
        return ()
    top = tuple(((token + i) % VOCAB_SIZE, -0.5 - i) for i in range(k))
    return (TokenLogprobs(token, -0.5, top),)
