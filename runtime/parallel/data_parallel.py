"""Data parallelism: several replicas of one model, each with its own devices, KV cache and loop.

``--data-parallel-size D`` splits the chosen devices into D groups of ``--tensor-parallel-size``;
``runtime.loading.builder`` builds one engine per group (the weights are read from disk once and placed
on each group). This engine is their front: each new request goes to the replica with the fewest
unfinished sequences, all ``n`` sequences of a request to the same one (they share its prompt
pages), and a replica whose queue is full passes the request to the next least loaded. Replicas
never talk to each other, so the aggregate throughput grows with D while each request's latency is
that of one replica.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jax_llm_runtime.runtime.engine.core import Engine
from jax_llm_runtime.runtime.engine.embedder import Pooling
from jax_llm_runtime.runtime.engine.interface import EngineOverloadedError
from jax_llm_runtime.runtime.engine.request import GenerationDelta, SamplingParams, TokenLogprobs
from jax_llm_runtime.runtime.engine.stats import EngineStats
from jax_llm_runtime.runtime.multimodal.inputs import ImageInput


class DataParallelEngine:
    """Implements ``runtime.engine.interface.EngineClient`` over replicas of one model."""

    def __init__(self, replicas: list[Engine]) -> None:
        if not replicas:
            raise ValueError("data parallelism needs at least one replica")
        self.replicas = replicas
        first = replicas[0]
        self.model_name = first.model_name
        # Every replica chose on the same kind of device (none is reported for a replica
        # without kernels).
        self.kernel_choices = dict(getattr(first, "kernel_choices", {}))
        self.max_model_len = first.max_model_len
        self.tokenizer = first.tokenizer
        # A vision-language model's (None otherwise): see EngineClient.generate_n.
        self.image_processor = getattr(first, "image_processor", None)
        self.compile_done = threading.Event()
        self._picking = threading.Lock()

    def start(self, compile_all: bool = False) -> None:
        """Start every replica (their compilations run side by side)."""
        with ThreadPoolExecutor(len(self.replicas), thread_name_prefix="replica-start") as pool:
            list(pool.map(lambda engine: engine.start(compile_all), self.replicas))
        threading.Thread(target=self._await_compiles, name="replica-compiles", daemon=True).start()

    def _await_compiles(self) -> None:
        for engine in self.replicas:
            engine.compile_done.wait()
        self.compile_done.set()

    def shutdown(self) -> None:
        for engine in self.replicas:
            engine.shutdown()

    def healthy(self) -> bool:
        return all(engine.healthy() for engine in self.replicas)

    def stats(self) -> EngineStats:
        """The replicas' counts summed."""
        each = [engine.stats() for engine in self.replicas]
        return EngineStats(
            **{name: sum(getattr(s, name) for s in each) for name in EngineStats.__annotations__}
        )

    def _by_load(self) -> list[Engine]:
        """The replicas, least loaded first (ties: the lower index)."""
        order = sorted(range(len(self.replicas)), key=lambda i: self.replicas[i].num_unfinished())
        return [self.replicas[i] for i in order]

    def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        images: tuple[ImageInput, ...] = (),
    ) -> AsyncIterator[GenerationDelta]:
        return self.generate_n(prompt_token_ids, sampling, request_id, 1, images)[0]

    def generate_n(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        n: int,
        images: tuple[ImageInput, ...] = (),
    ) -> list[AsyncIterator[GenerationDelta]]:
        """Queue the request on the least loaded replica that has room; EngineOverloadedError
        when none has."""
        overloaded: EngineOverloadedError | None = None
        with self._picking:  # two requests at once would both pick the same idle replica
            for engine in self._by_load():
                try:
                    extra = (images,) if images else ()  # only a vision engine takes images
                    return engine.generate_n(prompt_token_ids, sampling, request_id, n, *extra)
                except EngineOverloadedError as exc:
                    overloaded = exc
        assert overloaded is not None
        raise overloaded

    async def embed(self, inputs: list[list[int]], pooling: Pooling) -> list[np.ndarray]:
        return await self._by_load()[0].embed(inputs, pooling)

    async def prompt_logprobs(
        self, prompt_token_ids: list[int], top: int
    ) -> list[TokenLogprobs | None]:
        return await self._by_load()[0].prompt_logprobs(prompt_token_ids, top)
