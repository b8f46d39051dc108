"""Cache-free forward passes: pooled embeddings and prompt logprobs, through precompiled shapes.

An input of ``n`` tokens is padded to the smallest length bucket ``>= n`` (``[1, L]``, L growing
by 4x up to ``max_model_len``) and runs one jitted forward that reads no KV cache and writes none,
so it can run between engine steps without disturbing running sequences. The embedding call
returns both poolings (mean over the valid tokens, and the last valid token) as float32; the
scoring call returns every prompt token's log-probability given the tokens before it, with the
most likely alternatives (``echo`` with ``logprobs`` on completions).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.models.registry import ModelSpec
from jax_llm_runtime.runtime.engine.buckets import pick
from jax_llm_runtime.runtime.engine.compiled_shapes import CompiledShapes
from jax_llm_runtime.runtime.engine.request import MAX_TOP_LOGPROBS, TokenLogprobs
from jax_llm_runtime.runtime.parallel.sharding import host_inputs, placed, replicated_sharding

Pooling = Literal["mean", "last"]
POOLINGS: tuple[Pooling, ...] = ("mean", "last")


class EmbeddingRunner:
    """Runs the embedding forward over the weights a ``ModelRunner`` owns (shared, read-only)."""

    def __init__(self, spec: ModelSpec, config: Any, weights: Any, max_model_len: int) -> None:
        if spec.hidden_states is None:
            raise ValueError(f"{spec.hf_architecture} has no hidden_states forward for embeddings")
        self.weights = weights
        self.lengths = embedding_lengths(max_model_len)
        # On a mesh the outputs are replicated, so every process of a multi-node run reads them.
        replicated = replicated_sharding(weights)
        self.input_sharding = replicated
        out = {} if replicated is None else {"out_shardings": replicated}
        self._pool = jax.jit(functools.partial(_pool, spec.hidden_states, config), **out)
        self._score = None
        if spec.lm_head is not None:
            self._score = jax.jit(
                functools.partial(_score, spec.hidden_states, spec.lm_head, config), **out
            )
        self.compiled = CompiledShapes("cache-free forward", self._lower)
        # Multi-node (runtime.parallel.multihost): sees each forward before it runs, on process 0.
        self.mirror: Callable[..., None] | None = None

    def keys(self) -> list[tuple[str, int]]:
        """Every (function, length bucket) compiled: pooling, and prompt scoring when available."""
        kinds = ("pool", "score") if self._score is not None else ("pool",)
        return [(kind, length) for length in self.lengths for kind in kinds]

    def _lower(self, key: tuple[str, int]) -> Any:
        kind, length = key
        weights = placed(self.weights)
        tokens, n = host_inputs(
            (np.zeros((1, length), np.int32), np.zeros(1, np.int32)), self.input_sharding
        )
        return (self._pool if kind == "pool" else self._score).lower(weights, tokens, n)

    def embed(self, token_ids: list[int], pooling: Pooling) -> np.ndarray:  # [hidden] float32
        """The pooled, unnormalised embedding of one input (``1 <= len <= max_model_len``)."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        mean, last = self.forward("pool", token_ids)
        return np.asarray(mean if pooling == "mean" else last)[0]

    def prompt_logprobs(self, token_ids: list[int], top: int) -> list[TokenLogprobs | None]:
        """Each token's logprob given the tokens before it (None for the first, which has no
        context), with the ``top`` most likely alternatives; values are the plain log-softmax."""
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        chosen, top_ids, top_values = (np.asarray(a)[0] for a in self.forward("score", token_ids))
        out: list[TokenLogprobs | None] = [None]
        for i in range(1, len(token_ids)):  # row i - 1 predicts token i
            alternatives = tuple(
                (int(t), float(v))
                for t, v in zip(top_ids[i - 1, :top], top_values[i - 1, :top], strict=True)
            )
            out.append(TokenLogprobs(token_ids[i], float(chosen[i - 1]), alternatives))
        return out

    def forward(self, kind: str, token_ids: list[int]) -> Any:
        """Run the precompiled ``kind`` function on ``token_ids`` padded to their length bucket
        (``mirror`` sees the call first)."""
        if self.mirror is not None:
            self.mirror("forward", kind, token_ids)
        length = pick(self.lengths, len(token_ids))
        fn = self.compiled.get((kind, length))
        tokens = np.zeros((1, length), np.int32)
        tokens[0, : len(token_ids)] = token_ids
        return jax.block_until_ready(fn(self.weights, tokens, np.array([len(token_ids)], np.int32)))


def embedding_lengths(max_model_len: int) -> tuple[int, ...]:
    """The length buckets: 16, 64, 256, ... (4x), always ending with ``max_model_len``."""
    lengths, n = [], 16
    while n < max_model_len:
        lengths.append(n)
        n *= 4
    return (*lengths, max_model_len)


def _pool(
    hidden_states: Any,
    config: Any,
    weights: Any,
    tokens: jax.Array,  # [num_seqs, seq_len] int32
    lengths: jax.Array,  # [num_seqs] int32
) -> tuple[jax.Array, jax.Array]:  # mean, last: [num_seqs, hidden] float32
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    h = hidden_states(config, weights, tokens, positions, lengths)
    valid = (positions < lengths[:, None]).astype(jnp.float32)[..., None]
    mean = jnp.sum(h * valid, axis=1) / jnp.maximum(lengths, 1)[:, None].astype(jnp.float32)
    last = h[jnp.arange(h.shape[0]), jnp.maximum(lengths - 1, 0)]
    return mean, last


def _score(
    hidden_states: Any,
    lm_head: Any,
    config: Any,
    weights: Any,
    tokens: jax.Array,  # [1, seq_len] int32
    lengths: jax.Array,  # [1] int32
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row i: logprob of token i + 1 [1, seq_len], and the top ids/values [1, seq_len, K]."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logprobs = jax.nn.log_softmax(
        lm_head(config, weights, hidden_states(config, weights, tokens, positions, lengths)),
        axis=-1,
    )
    following = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    chosen = jnp.take_along_axis(logprobs, following[..., None], axis=-1)[..., 0]
    k = min(MAX_TOP_LOGPROBS, logprobs.shape[-1])
    top_values, top_ids = jax.lax.top_k(logprobs, k)
    return chosen, top_ids.astype(jnp.int32), top_values


class ForwardJob:
    """Work for the ``EmbeddingRunner`` done on the engine loop thread, answered on the caller's
    event loop.

    The loop thread calls ``run`` between steps (so the forward never races a step for the
    device); the result or the error is handed to ``future`` with ``call_soon_threadsafe``.
    """

    def __init__(self, work: Callable[[EmbeddingRunner], Any]) -> None:
        self.work = work
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[Any] = self.loop.create_future()

    def run(self, runner: EmbeddingRunner) -> None:
        """Do the work (loop thread); never raises, errors go to the future."""
        if self.future.cancelled():  # the caller left; skip the work
            return
        try:
            result = self.work(runner)
        except Exception as exc:  # the caller raises it; the engine loop carries on
            self.loop.call_soon_threadsafe(_resolve, self.future, None, exc)
            return
        self.loop.call_soon_threadsafe(_resolve, self.future, result, None)


def _resolve(future: asyncio.Future[Any], result: Any, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
