"""The engine interface the HTTP layer (and library users) program against.

1. A caller tokenizes (``engine.tokenizer``) and calls ``engine.generate(prompt_ids, sampling, id)``.
2. The engine queues the request; its loop thread batches it with the others, step by step.
3. The returned async iterator yields ``GenerationDelta``s on the caller's event loop; the last one
   carries a ``finish_reason``. Leaving the iterator early (client gone) aborts the request and
   frees its pages.
4. An engine bounds its queue: past ``max_num_seqs`` running and ``max_waiting`` waiting sequences,
   ``generate`` raises ``EngineOverloadedError`` at once instead of queueing (HTTP 503).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import numpy as np

from jax_llm_runtime.runtime.engine.embedder import Pooling
from jax_llm_runtime.runtime.engine.request import GenerationDelta, SamplingParams, TokenLogprobs
from jax_llm_runtime.runtime.engine.stats import EngineStats


class EngineOverloadedError(RuntimeError):
    """The engine's waiting queue is full, so the request was not queued; retry later."""

    def __init__(self, num_waiting: int, max_waiting: int) -> None:
        super().__init__(
            f"The server is overloaded: {num_waiting} sequences already wait for a slot "
            f"(max_waiting={max_waiting}). Retry later."
        )
        self.num_waiting = num_waiting
        self.max_waiting = max_waiting


class TokenizerLike(Protocol):
    """The subset of ``runtime.text.tokenizer.Tokenizer`` that callers of an engine rely on."""

    eos_token_ids: frozenset[int]
    # (start, end) markers around a reasoning model's thinking, e.g. ("<think>", "</think>");
    # None when the model has none.
    reasoning_markers: tuple[str, str] | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text to token ids."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a chat (list of {role, content}) with the model's template, in a sandbox."""
        ...


class EngineClient(Protocol):
    """What the API layer needs from an engine: identity, a tokenizer, and a token stream."""

    model_name: str
    max_model_len: int
    tokenizer: TokenizerLike

    def start(self) -> None:
        """Start the loop thread (compiles, warms up). Returns when ready to serve."""
        ...

    def shutdown(self) -> None:
        """Stop the loop thread; unfinished requests end with finish_reason ``abort``."""
        ...

    def healthy(self) -> bool:
        """True while the loop thread is alive and serving."""
        ...

    def stats(self) -> EngineStats:
        """A snapshot of running/waiting sequences, KV pages and preemptions. Read-only; safe to
        call from any thread (it only reads ints and container lengths)."""
        ...

    def generate(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> AsyncIterator[GenerationDelta]:
        """Submit a request; yield its deltas on the running event loop until it finishes.

        Raises ``ValueError`` (before yielding anything) when the prompt cannot be served, e.g.
        it is empty or longer than ``max_model_len``, and ``EngineOverloadedError`` when the
        waiting queue is full.
        """
        ...

    def generate_n(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str, n: int
    ) -> list[AsyncIterator[GenerationDelta]]:
        """``n`` independent completions of one prompt (OpenAI's ``n``), one stream each.

        The engine computes the prompt once and shares its pages among the ``n`` sequences.
        Stream ``i`` has request id ``f"{request_id}-{i}"`` when ``n > 1``; each finishes (or is
        aborted by closing it) on its own. Raises like ``generate``; ``n`` sequences more than
        ``max_num_seqs`` plus ``max_waiting`` could ever hold is a ``ValueError``.

        A vision-language engine (one with an ``image_processor`` attribute that is not None:
        ``runtime.multimodal.processor.ImageProcessor``) also takes ``images``, a fifth
        argument: the prompt's images preprocessed by it, for the prompt's runs of image tokens
        in order. Engines without one are never passed images.
        """
        ...

    async def embed(self, inputs: list[list[int]], pooling: Pooling) -> list[np.ndarray]:
        """One pooled float32 embedding ``[hidden]`` per input, not normalised.

        ``pooling`` is ``"mean"`` (over the input's tokens) or ``"last"`` (its last token), both
        over the model's final-normed hidden states. The forward reads and writes no KV cache and
        runs on the engine's loop thread between steps, never on the caller's event loop. Raises
        ``ValueError`` when an input is empty or longer than ``max_model_len``, or the model
        cannot embed.
        """
        ...

    async def prompt_logprobs(
        self, prompt_token_ids: list[int], top: int
    ) -> list[TokenLogprobs | None]:
        """Each prompt token's log-probability given the tokens before it (``None`` for the
        first), with the ``top`` most likely alternatives: the plain log-softmax of the model's
        logits, from a forward that reads and writes no KV cache (``echo`` with ``logprobs``)."""
        ...
