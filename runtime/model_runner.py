"""Turns a scheduled batch into one call of the jitted step, padded to a compiled bucket.

The step (model forward + on-device sampling) is one ``jax.jit`` function; the KV cache is donated
to it and comes back updated in place. Every bucket shape is compiled in ``warmup`` so serving
never compiles.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from models.batch import StepBatch
from models.registry import ModelSpec
from pallas_kernels.paged_attention import KVCache
from runtime.buckets import BucketPlan, pick
from runtime.sampler import SamplingMetadata, sample
from runtime.scheduler import ScheduledBatch, StepKind


class ModelRunner:
    """Owns the weights and the KV cache on device and runs steps."""

    def __init__(
        self, spec: ModelSpec, config: Any, weights: Any, cache: KVCache, plan: BucketPlan
    ) -> None:
        self.config = config
        self.weights = weights
        self.cache = cache
        self.plan = plan
        self._step = jax.jit(functools.partial(_step, spec.forward, config), donate_argnums=(1,))
        self._compiled: dict[tuple[int, int, int], Any] = {}

    def warmup(self) -> float:
        """Compile every bucket ahead of time (progress bar on stderr); returns the seconds taken.

        Shapes are lowered from abstract values, so nothing runs: a bucket of 8192 prompt tokens
        costs its compile time only.
        """
        t0 = time.perf_counter()
        abstract = functools.partial(jax.tree.map, lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
        weights, cache = abstract(self.weights), abstract(self.cache)
        for shape in tqdm(self.plan.shapes(), desc="Compiling", unit="shape"):
            batch, meta = abstract(_empty_inputs(*shape))
            self._compiled[shape] = self._step.lower(weights, cache, batch, meta).compile()
        return time.perf_counter() - t0

    def run(self, batch: ScheduledBatch) -> list[int]:
        """Run one step; return the sampled token of every scheduled sequence, in order."""
        step_batch, meta = self._prepare(batch)
        shape = (*step_batch.tokens.shape, step_batch.page_indices.shape[1])
        step = self._compiled.get(shape)
        if step is None:
            raise RuntimeError(f"step shape {shape} was not compiled at warmup")
        tokens, self.cache = step(self.weights, self.cache, step_batch, meta)
        return np.asarray(tokens)[: len(batch.items)].tolist()

    def _prepare(self, batch: ScheduledBatch) -> tuple[StepBatch, SamplingMetadata]:
        items = batch.items
        ps = self.plan.page_size
        if batch.kind is StepKind.DECODE:
            num_seqs, q_len = pick(self.plan.decode_seqs, len(items)), 1
        else:
            num_seqs, q_len = 1, pick(self.plan.prefill_lens, items[0].length)
        pages = pick(self.plan.pages, max(-(-(i.start + i.length) // ps) for i in items))
        tokens = np.zeros((num_seqs, q_len), np.int32)
        positions = np.zeros((num_seqs, q_len), np.int32)
        q_lens = np.zeros(num_seqs, np.int32)
        kv_lens = np.zeros(num_seqs, np.int32)
        page_indices = np.zeros((num_seqs, pages), np.int32)
        temperature = np.zeros(num_seqs, np.float32)
        top_k = np.zeros(num_seqs, np.int32)
        top_p = np.ones(num_seqs, np.float32)
        seeds = np.zeros(num_seqs, np.uint32)
        output_index = np.zeros(num_seqs, np.int32)
        for row, item in enumerate(items):
            seq, end = item.seq, item.start + item.length
            tokens[row, : item.length] = seq.token_slice(item.start, end)
            positions[row, : item.length] = np.arange(item.start, end)
            q_lens[row], kv_lens[row] = item.length, end
            page_indices[row, : len(seq.pages)] = seq.pages
            sp = seq.sampling
            temperature[row], top_k[row], top_p[row] = sp.temperature, sp.top_k, sp.top_p
            seeds[row], output_index[row] = seq.seed, len(seq.output_ids)
        # Host arrays go straight into the jitted call: one transfer each, nothing to compile.
        step_batch = StepBatch(tokens, positions, q_lens, kv_lens, page_indices)
        meta = SamplingMetadata(temperature, top_k, top_p, seeds, output_index)
        return step_batch, meta


def _step(
    forward: Any,
    config: Any,
    weights: Any,
    cache: KVCache,
    batch: StepBatch,
    meta: SamplingMetadata,
) -> tuple[jax.Array, KVCache]:
    logits, cache = forward(config, weights, cache, batch)
    return sample(logits, meta), cache


def _empty_inputs(num_seqs: int, q_len: int, pages: int) -> tuple[StepBatch, SamplingMetadata]:
    """All-padding inputs of a bucket's shape: they compile the step and write nothing."""
    zeros = functools.partial(np.zeros, dtype=np.int32)
    batch = StepBatch(
        zeros((num_seqs, q_len)),
        zeros((num_seqs, q_len)),
        zeros(num_seqs),
        zeros(num_seqs),
        zeros((num_seqs, pages)),
    )
    meta = SamplingMetadata(
        np.zeros(num_seqs, np.float32),
        zeros(num_seqs),
        np.ones(num_seqs, np.float32),
        np.zeros(num_seqs, np.uint32),
        zeros(num_seqs),
    )
    return batch, meta
