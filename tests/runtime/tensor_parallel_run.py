"""Run in a fresh process with fake CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``):
build the engine on a saved model once per tensor-parallel size and print, as one JSON line, each
size's greedy tokens and the bytes each device holds of the weights and of the KV cache (and of the
experts offloaded to its pinned host memory).

``tensor_parallel_run.py FOLDER 1,2,4 [EXTRA]`` runs each size with the ``EngineConfig`` fields of
the JSON object EXTRA; ``tensor_parallel_run.py FOLDER '[{"size": 2, ...}, ...]'`` runs each object
of the list (its size and fields) and prints a list."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import jax

from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.engine.request import SamplingParams
from jax_llm_runtime.runtime.loading.builder import build_engine
from jax_llm_runtime.runtime.parallel.sharding import device_bytes

PROMPTS = [[1, 5, 9, 13, 200], [7, 7, 7], list(range(40, 75))]


def greedy_tokens(engine: Any, prompts: list[list[int]], tag: str) -> list[list[int]]:
    """12 greedy tokens (EOS ignored) for each prompt, all submitted at once so they batch."""

    async def one(i: int, ids: list[int]) -> list[int]:
        out: list[int] = []
        sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        async for delta in engine.generate(ids, sampling, f"{tag}-{i}"):
            out += delta.token_ids
        return out

    async def every() -> list[list[int]]:
        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))

    return asyncio.run(every())


def run(folder: str, size: int, extra: dict) -> dict:
    engine = build_engine(
        EngineConfig(
            model_id=folder,
            max_num_seqs=4,
            max_model_len=128,
            kvcache_mem_mb=4,
            dtype="float32",
            tensor_parallel_size=size,
            precompile="none",  # the few shapes these requests run, when they first run
            # One device would take int8 activations on CPUs with integer dots (auto), a mesh
            # the model dtype: every size computes with the same numbers.
            **{"matmul_dtype": "model", **extra},
        )
    )
    engine.start()
    try:
        tokens = greedy_tokens(engine, PROMPTS, f"tp{size}")
        weights = device_bytes(engine.runner.weights)
        layers = device_bytes(engine.runner.weights["segments"])
        expert_stacks = [
            seg[k] for seg in engine.runner.weights["segments"] for k in seg if k.startswith("e_")
        ]
        experts = device_bytes(expert_stacks)
        host_experts = device_bytes(expert_stacks, "pinned_host")
        host_kinds = {
            leaf.sharding.memory_kind
            for seg in engine.runner.weights["segments"]
            for k in seg
            if k.endswith("_host")
            for leaf in jax.tree.leaves(seg[k])
        }
        cache = device_bytes(engine.runner.cache)
        # What each device holds of every per-layer weight field, over all segments.
        segments = engine.runner.weights["segments"]
        fields = {
            name: device_bytes([seg[name] for seg in segments if name in seg])
            for name in {name for seg in segments for name in seg}
        }
    finally:
        engine.shutdown()
    return {
        "tokens": tokens,
        "weight_bytes": sorted(weights.values()),
        "layer_bytes": sorted(layers.values()),
        "expert_bytes": sorted(experts.values()),
        "expert_host_bytes": sorted(host_experts.values()),
        "host_memory_kinds": sorted(host_kinds),
        "cache_bytes": sorted(cache.values()),
        "cache_tokens": engine.scheduler.allocator.num_pages * engine.scheduler.page_size,
        "field_bytes": {name: sorted(held.values()) for name, held in fields.items()},
    }


if __name__ == "__main__":
    folder = sys.argv[1]
    if sys.argv[2].startswith("["):
        runs = json.loads(sys.argv[2])
        print(json.dumps([run(folder, r.pop("size"), r) for r in runs]))
    else:
        sizes = [int(s) for s in sys.argv[2].split(",")]
        extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
        print(json.dumps({size: run(folder, size, extra) for size in sizes}))
