"""Run in a fresh process with fake CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``):
build the engine on a saved linear-attention model (Qwen3-Next, Qwen3.5) once per tensor-parallel
size and print, as one JSON line, per size:

- ``logits``: the last-position logits of whole prompts in one ragged step on the engine's
  (placed) weights (``tests.models.harness.PagedRunner``);
- ``tokens``: greedy tokens of the prompts run side by side through the engine's scheduler and
  runner (chunked prefill, decode of several sequences, their state slots), with one more
  sequence forked from the second prompt (``n = 2``: a copy of the parent's state);
- ``preempted``: the same prompts on a KV cache of few pages, so that sequences are preempted
  and recomputed, and ``preemptions``, how many times;
- ``state_bytes`` and ``field_bytes``: what each device holds of the state slots and of each
  linear-attention weight field.

``hybrid_tensor_parallel_run.py FOLDER 1,4 [EXTRA]`` runs each size with the ``EngineConfig``
fields of the JSON object EXTRA.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from jax_llm_runtime.models.registry import get_model_spec
from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.engine.page_allocator import PageAllocator
from jax_llm_runtime.runtime.engine.request import SamplingParams
from jax_llm_runtime.runtime.engine.sequence import Sequence
from jax_llm_runtime.runtime.loading.builder import build_engine
from jax_llm_runtime.runtime.parallel.sharding import device_bytes
from tests.models.harness import Loaded, PagedRunner

PROMPT_LENS = (5, 13, 22)
NEW_TOKENS = 10
PAGE_SIZE = 4
FEW_PAGES = 14  # too few for the three prompts' sequences at once: the newest is preempted


def prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab_size, n).tolist() for n in PROMPT_LENS]


def _sequence(request_id: str, prompt: list[int], arrival: int) -> Sequence:
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return Sequence(request_id, list(prompt), sampling, seed=0, arrival=arrival)


def drive(engine: Any, seqs: list[Sequence]) -> None:
    """Steps of the (not started) engine's scheduler and runner until every sequence finished;
    every state slot is free again at the end."""
    scheduler = engine.scheduler
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(1000):
        batch = scheduler.schedule()
        if batch is None:
            break
        scheduler.update(batch, engine.runner.run(batch).token_ids)
    if scheduler.has_work() or scheduler.state_slots.num_used:
        raise RuntimeError("the sequences did not finish, or left a state slot taken")


def run(folder: str, size: int, extra: dict) -> dict:
    engine = build_engine(
        EngineConfig(
            model_id=folder,
            max_num_seqs=4,
            max_model_len=64,
            kvcache_mem_mb=2,
            page_size=PAGE_SIZE,
            prefill_chunk_size=8,
            dtype="float32",
            tensor_parallel_size=size,
            **{"matmul_dtype": "model", **extra},
        )
    )
    runner = engine.runner
    ids = prompts(runner.config.vocab_size)
    architecture = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    model = Loaded(get_model_spec(architecture), runner.config, runner.weights)
    logits = PagedRunner(model, max(PROMPT_LENS), len(ids)).step(ids)
    seqs = [_sequence(f"tp{size}-{i}", p, i) for i, p in enumerate(ids)]
    parent, fork = (_sequence(f"tp{size}-n2-{i}", ids[1], 3 + i) for i in range(2))
    parent.forks = [fork]
    drive(engine, [*seqs, parent])
    engine.scheduler.allocator = PageAllocator(FEW_PAGES, PAGE_SIZE)
    again = [_sequence(f"tp{size}-few-{i}", p, i) for i, p in enumerate(ids)]
    drive(engine, again)
    segments = runner.weights["segments"]
    names = {name for seg in segments for name in seg if name.startswith("la_")}
    return {
        "logits": np.asarray(logits).tolist(),
        "tokens": [s.output_ids for s in (*seqs, parent, fork)],
        "preempted": [s.output_ids for s in again],
        "preemptions": engine.scheduler.num_preemptions,
        "state_bytes": {
            "conv": sorted(device_bytes(runner.cache.conv).values()),
            "recurrent": sorted(device_bytes(runner.cache.recurrent).values()),
        },
        "field_bytes": {
            name: sorted(device_bytes([seg[name] for seg in segments if name in seg]).values())
            for name in names
        },
    }


if __name__ == "__main__":
    folder, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    print(json.dumps({size: run(folder, size, extra) for size in sizes}))
