"""Run in a fresh process with fake CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``):
build the engine on a saved model once per (data-parallel, tensor-parallel) size and print, as one
JSON line, each one's greedy tokens and, per replica, the steps it ran and its cache's devices."""

from __future__ import annotations

import json
import sys

from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.loading.builder import build_engine
from jax_llm_runtime.runtime.parallel.data_parallel import DataParallelEngine
from jax_llm_runtime.runtime.parallel.sharding import device_bytes
from tests.runtime.tensor_parallel_run import greedy_tokens

PROMPTS = [[1, 5, 9, 13, 200], [7, 7, 7], list(range(40, 75)), [3, 1, 4, 1, 5, 9, 2, 6]]


def run(folder: str, dp: int, tp: int) -> dict:
    config = EngineConfig(
        model_id=folder,
        max_num_seqs=4,
        max_model_len=128,
        kvcache_mem_mb=4,
        dtype="float32",
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        precompile="none",  # the few shapes these requests run, when they first run
    )
    engine = build_engine(config)
    engine.start()
    try:
        tokens = greedy_tokens(engine, PROMPTS, f"dp{dp}")
        replicas = engine.replicas if isinstance(engine, DataParallelEngine) else [engine]
        steps = [replica.num_steps for replica in replicas]
        devices = [sorted(d.id for d in device_bytes(r.runner.cache)) for r in replicas]
    finally:
        engine.shutdown()
    return {"tokens": tokens, "steps": steps, "cache_devices": devices}


if __name__ == "__main__":
    folder = sys.argv[1]
    runs = [tuple(int(n) for n in pair.split("x")) for pair in sys.argv[2].split(",")]
    print(json.dumps({f"{dp}x{tp}": run(folder, dp, tp) for dp, tp in runs}))
