"""Run in a fresh process with fake CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``):
for each tensor-parallel size, build the engine on a saved model, compile every step bucket, and
print as one JSON line what disagrees between the shardings each bucket was compiled for and the
inputs the runner passes it, and which buckets failed to run.

``step_shardings_run.py FOLDER 1,2,3``. Each bucket runs twice on all-padding inputs (they write
nothing): once as a batch with no grammar (the all-ones mask the runner keeps on the device) and
once with a grammar mask from the host, as the runner passes them.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.engine.model_runner import SAMPLER, _empty_inputs
from jax_llm_runtime.runtime.loading.builder import build_engine
from jax_llm_runtime.runtime.parallel.sharding import replicated_sharding


def check(folder: str, size: int) -> dict:
    engine = build_engine(
        EngineConfig(
            model_id=folder,
            max_num_seqs=4,
            max_model_len=64,
            kvcache_mem_mb=2,
            dtype="float32",
            tensor_parallel_size=size,
            decode_steps=2,
        )
    )
    runner = engine.runner
    first, rest = runner.startup_shapes()
    keys = [*first, *rest]
    runner.compiled.compile_now(keys)
    # Every process of a multi-node run passes the whole batch: replicated over the mesh.
    expected = replicated_sharding(runner.cache)
    mismatches, failures = [], []
    for key in keys:
        compiled = runner.compiled.get(key)
        # The compiled arguments are (weights, cache, batch, meta) of a multi-step call,
        # (weights, cache, batch) of a step and (logits, meta) of the sampler, less the leaves
        # each never reads; a multi-step call's count of steps is static and not among them.
        args, _ = compiled.input_shardings
        if key[0] == SAMPLER:
            inputs = {"logits": args[0], "meta": args[1]}
        else:
            inputs = dict(zip(("batch", "meta"), args[2:], strict=False))
        for where, want in inputs.items():
            for path, sharding in jax.tree_util.tree_leaves_with_path(want):
                if expected is None:
                    continue  # one device: every input goes to it
                if not sharding.is_fully_replicated or sharding.device_set != expected.device_set:
                    mismatches.append(f"{key} {where}{jax.tree_util.keystr(path)}: {sharding}")
        if key[0] == SAMPLER:
            continue  # every step below runs the sampler of its rows
        batch, meta = _empty_inputs(*key[:3], runner.vocab_size)
        for allowed in (None, np.full(meta.allowed.shape, -1, np.int32)):
            try:
                runner.execute(batch, meta.replace(allowed=allowed), key[3])
            except ValueError as error:
                failures.append(
                    f"{key} allowed={'host' if allowed is not None else 'device'}: "
                    f"{str(error).splitlines()[0]}"
                )
    engine.shutdown()
    return {"buckets": len(keys), "mismatches": mismatches, "failures": failures}


if __name__ == "__main__":
    sizes = [int(s) for s in sys.argv[2].split(",")]
    print(json.dumps({size: check(sys.argv[1], size) for size in sizes}))
