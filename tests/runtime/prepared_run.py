"""Run in a fresh process with 4 fake CPU devices (``tests/runtime/test_prepared.py``): prepare a
saved model with tensor parallelism 4 and ``--isq q4_0``, restore it, and print as one JSON line
the restored arrays whose sharding differs from what loading the source and placing it on the
mesh gives, how many arrays are split, and both engines' greedy tokens.

``prepared_run.py SOURCE_FOLDER TARGET_FOLDER``"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.loading.builder import build_engine, load_model, place_on_mesh
from jax_llm_runtime.runtime.loading.prepared import save_prepared
from jax_llm_runtime.runtime.parallel.sharding import build_mesh
from tests.runtime.tensor_parallel_run import PROMPTS, greedy_tokens

FIELDS = dict(
    max_num_seqs=4,
    max_model_len=128,
    kvcache_mem_mb=4,
    dtype="float32",
    tensor_parallel_size=4,
    precompile="none",  # the few shapes these requests run, when they first run
)


def tokens(model_id: str, **fields) -> list[list[int]]:
    engine = build_engine(EngineConfig(model_id=model_id, **FIELDS, **fields))
    engine.start()
    try:
        return greedy_tokens(engine, PROMPTS, model_id)
    finally:
        engine.shutdown()


def main(source: str, target: str) -> dict:
    config = EngineConfig(model_id=source, isq="q4_0", **FIELDS)
    save_prepared(config, target)
    loaded = load_model(config)
    _, expected = place_on_mesh(build_mesh(None, 4), loaded.config, loaded.weights, False)
    restored = load_model(EngineConfig(model_id=target, **FIELDS)).weights
    mismatched, split = [], 0
    paths = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, want), got in zip(paths, jax.tree.leaves(restored), strict=True):
        same = got.sharding.is_equivalent_to(want.sharding, want.ndim)
        if not same or not np.array_equal(np.asarray(got), np.asarray(want)):
            mismatched.append(jax.tree_util.keystr(path))
        split += any(p is not None for p in got.sharding.spec)
    return {
        "mismatched": mismatched,
        "split": split,
        "loaded_tokens": tokens(source, isq="q4_0"),
        "restored_tokens": tokens(target),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
