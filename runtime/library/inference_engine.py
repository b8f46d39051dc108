"""``InferenceEngine``: the serving engine as a Python library, with no HTTP in between.

1. ``InferenceEngine(model_id, **EngineConfig fields)`` or ``InferenceEngine.builder()...build()``
   picks the JAX platform (``device``), builds the same ``Engine`` that ``runtime-serve`` builds
   (``runtime.loading.builder.build_engine``) and starts it.
2. ``generate``/``chat`` tokenize the prompt (a chat through the model's chat template, rendered
   and encoded as the chat route does it), submit it, and read the engine's delta stream, whose
   text has ``stop`` strings applied by the engine, as the server's has.
3. The ``a``-prefixed methods are coroutines on the caller's event loop; the plain ones run the same
   coroutines on a private event-loop thread (``runtime.library.loop_thread``), so they work from a script
   and from inside a running loop such as Jupyter's.
4. ``close()`` (or leaving a ``with`` block) stops the engine; unfinished requests are aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jax_llm_runtime.runtime.config import DEFAULT_MODEL_ID, EngineConfig
from jax_llm_runtime.runtime.engine.request import FinishReason, GenerationDelta, SamplingParams
from jax_llm_runtime.runtime.library.builder import EngineBuilder, engine_config
from jax_llm_runtime.runtime.library.loop_thread import LoopThread
from jax_llm_runtime.runtime.platform import select_platform

if TYPE_CHECKING:
    from jax_llm_runtime.runtime.engine.interface import EngineClient

_POOLINGS = ("mean", "last")
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class GenerationError(RuntimeError):
    """The engine ended a request without finishing it (it stopped, or the request's step failed)."""


@dataclass(frozen=True)
class Completion:
    """One finished generation.

    ``text`` ends before a matched stop string; ``token_ids`` are every generated token (those of
    a matched stop string, and the EOS or stop token that ended the sequence, included).
    ``finish_reason`` is "stop" (EOS, a stop token or a stop string) or "length" (max_tokens or
    the context). ``cached_tokens`` counts prompt tokens whose K/V came from the prefix cache.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def sampling_from_options(options: Mapping[str, Any]) -> SamplingParams:
    """``SamplingParams`` from keyword options, one per field; ``stop`` may be a string or a list
    of strings, ``stop_token_ids`` a list, ``logit_bias`` a ``{token_id: bias}`` dict. Unknown
    names are a TypeError."""
    options = dict(options)
    unknown = sorted(set(options) - _SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown sampling option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(sorted(_SAMPLING_FIELDS))}"
        )
    if "stop_token_ids" in options:
        options["stop_token_ids"] = tuple(options["stop_token_ids"])
    bias = options.get("logit_bias")
    if isinstance(bias, Mapping):
        options["logit_bias"] = tuple((int(k), float(v)) for k, v in bias.items())
    elif bias is not None:
        options["logit_bias"] = tuple((int(k), float(v)) for k, v in bias)
    stop = options.get("stop")
    if stop is None:
        options.pop("stop", None)
    else:
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        options["stop"] = stops
    return SamplingParams(**options)


class InferenceEngine:
    """A started engine on one model; see the module docstring and LIBRARY_API.md.

    ``config`` is the ``EngineConfig`` it was built from (None when wrapped by ``from_engine``).

    ``device`` ("cpu", "gpu", "tpu", "metal"; None: JAX's default) picks the JAX platform before
    anything is loaded. The other keyword arguments are ``runtime.config.EngineConfig`` fields
    (``kvcache_mem_mb``, ``max_model_len``, ``dtype``, ``isq``, ...). Raises ValueError for bad
    values, TypeError for unknown names, ``DeviceUnavailableError`` for a platform that cannot be
    used, and ``ModelSourceError`` when the model cannot be found.
    """

    def __init__(
        self, model_id: str = DEFAULT_MODEL_ID, *, device: str | None = None, **config: Any
    ) -> None:
        self.config: EngineConfig | None = engine_config(model_id=model_id, **config)
        self.device = select_platform(device) if device is not None else None
        # The loaders and model registry load on the first build, not with ``import runtime``.
        from jax_llm_runtime.runtime.loading.builder import build_engine

        self._attach(build_engine(self.config))

    def _attach(self, engine: EngineClient) -> None:
        engine.start()
        self._engine = engine
        self._loop = LoopThread()
        self._request_ids = itertools.count()

    @staticmethod
    def builder() -> EngineBuilder[InferenceEngine]:
        """A fluent builder: ``InferenceEngine.builder().model_id(...).device(...).build()``."""
        return EngineBuilder(InferenceEngine)

    @classmethod
    def from_config(cls, config: EngineConfig, device: str | None = None) -> InferenceEngine:
        """An engine for an existing ``EngineConfig``."""
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return cls(device=device, **fields)

    @classmethod
    def from_engine(cls, engine: EngineClient) -> InferenceEngine:
        """Wrap an engine that is already built (``runtime.loading.builder.build_engine``, or
        ``runtime.engine.mock.MockEngine`` to test an application without a model); it is
        started now and shut down by ``close()``."""
        wrapper = cls.__new__(cls)
        wrapper.config = None
        wrapper.device = None
        wrapper._attach(engine)
        return wrapper

    # -- identity and tokens -------------------------------------------------------------------
    @property
    def engine(self) -> EngineClient:
        """The underlying engine (``runtime.engine.core.Engine`` unless wrapped by ``from_engine``):
        its async API, ``stats()``, tokenizer."""
        return self._engine

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt and completion) one sequence may hold."""
        return self._engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's BOS, if it has one."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids`` (ValueError for ids outside the vocabulary)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def chat_prompt_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """A chat rendered with the model's template (generation prompt added) and encoded
        without added special tokens, the template supplying them: what the chat route sends."""
        rendered = [_template_message(m) for m in messages]
        text = self.tokenizer.apply_chat_template(
            rendered, add_generation_prompt=True, **dict(chat_template_kwargs or {})
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt must not be empty")
            return self.tokenize(prompt)
        return [int(t) for t in prompt]

    # -- async API -----------------------------------------------------------------------------
    async def agenerate(self, prompt: str | Sequence[int], **sampling: Any) -> Completion:
        """Complete ``prompt`` (text, encoded with BOS, or token ids used as they are).

        ``sampling``: ``SamplingParams`` fields (``max_tokens`` 16 and ``temperature`` 1.0 unless
        given) and ``stop``. Raises ValueError when the engine cannot serve the prompt (empty,
        too long for ``max_model_len``, ids outside the vocabulary).
        """
        ids = await asyncio.to_thread(self._prompt_ids, prompt)
        return await self._collect(ids, sampling)

    async def agenerate_stream(
        self, prompt: str | Sequence[int], **sampling: Any
    ) -> AsyncIterator[str]:
        """``agenerate``, yielding text as it is generated. Leaving early aborts the request."""
        ids = await asyncio.to_thread(self._prompt_ids, prompt)
        async for text in self._texts(ids, sampling):
            yield text

    async def achat(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **sampling: Any,
    ) -> Completion:
        """The assistant's reply to ``messages`` (``{"role", "content"}`` dicts), rendered with
        the model's chat template like the server's /v1/chat/completions."""
        ids = await asyncio.to_thread(self.chat_prompt_ids, messages, chat_template_kwargs)
        return await self._collect(ids, sampling)

    async def achat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[str]:
        """``achat``, yielding the reply's text as it is generated."""
        ids = await asyncio.to_thread(self.chat_prompt_ids, messages, chat_template_kwargs)
        async for text in self._texts(ids, sampling):
            yield text

    async def aembed(
        self, texts: str | Sequence[str], pooling: str = "mean", normalize: bool = True
    ) -> np.ndarray:
        """One float32 embedding per text, ``[len(texts), hidden]``, like /v1/embeddings: the
        ``"mean"`` or ``"last"`` token's final-normed hidden state, unit length unless
        ``normalize`` is False. ValueError when the model cannot embed or a text is empty."""
        if pooling not in _POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(_POOLINGS)}, got {pooling!r}")
        items = [texts] if isinstance(texts, str) else list(texts)
        if not items or any(not t for t in items):
            raise ValueError("embed needs one or more non-empty texts")
        ids = await asyncio.to_thread(lambda: [self.tokenize(t) for t in items])
        vectors = np.stack(await self._engine.embed(ids, pooling)).astype(np.float32)  # type: ignore[arg-type]
        if normalize:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)
        return vectors

    # -- sync API (the async one on the private loop thread) -----------------------------------
    def generate(self, prompt: str | Sequence[int], **sampling: Any) -> Completion:
        """``agenerate``, blocking."""
        return self._loop.run(self.agenerate(prompt, **sampling))

    def generate_stream(self, prompt: str | Sequence[int], **sampling: Any) -> Iterator[str]:
        """``agenerate_stream`` as a plain iterator of text pieces."""
        return self._loop.iterate(self.agenerate_stream(prompt, **sampling))

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **sampling: Any,
    ) -> Completion:
        """``achat``, blocking."""
        return self._loop.run(self.achat(messages, chat_template_kwargs, **sampling))

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **sampling: Any,
    ) -> Iterator[str]:
        """``achat_stream`` as a plain iterator of text pieces."""
        return self._loop.iterate(self.achat_stream(messages, chat_template_kwargs, **sampling))

    def embed(
        self, texts: str | Sequence[str], pooling: str = "mean", normalize: bool = True
    ) -> np.ndarray:
        """``aembed``, blocking."""
        return self._loop.run(self.aembed(texts, pooling, normalize))

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine (unfinished requests are aborted) and its loop thread. Idempotent."""
        if self._loop.closed:
            return
        self._engine.shutdown()
        self._loop.close()

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- one request's stream ------------------------------------------------------------------
    async def _collect(self, ids: list[int], options: Mapping[str, Any]) -> Completion:
        parts: list[str] = []
        token_ids: list[int] = []
        async for delta in self._deltas(ids, options):
            parts.append(delta.text)
            token_ids += delta.token_ids
            if delta.finish_reason is not None:
                return Completion(
                    "".join(parts),
                    tuple(token_ids),
                    delta.finish_reason.value,
                    delta.num_prompt_tokens,
                    delta.num_output_tokens,
                    delta.num_cached_tokens,
                )
        raise GenerationError("the engine stream ended without a finish reason")

    async def _texts(self, ids: list[int], options: Mapping[str, Any]) -> AsyncIterator[str]:
        async for delta in self._deltas(ids, options):
            if delta.text:
                yield delta.text

    async def _deltas(
        self, ids: list[int], options: Mapping[str, Any]
    ) -> AsyncIterator[GenerationDelta]:
        """The request's deltas (stop strings applied by the engine), up to the one with a finish
        reason. However iteration ends, the engine stream is closed (aborting an unfinished
        sequence)."""
        sampling = sampling_from_options(options)
        stream = self._engine.generate(ids, sampling, f"lib-{next(self._request_ids)}")
        try:
            async for delta in stream:
                if delta.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                    raise GenerationError(_ENDED[delta.finish_reason])
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


_ENDED = {
    FinishReason.ABORT: "the request was aborted because the engine stopped",
    FinishReason.ERROR: "the engine failed while processing the request",
}


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message as the template sees it; "developer" is "system", as in the chat route."""
    out = dict(message)
    if out.get("role") == "developer":
        out["role"] = "system"
    return out
