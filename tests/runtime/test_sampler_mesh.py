"""The sampler on a mesh with the vocabulary split over 3 fake CPU devices (tensor parallelism
splits the LM head's columns, so the logits arrive split): seeded draws land in the vocabulary
and equal one device's draws on the same logits.

JAX fixes its device count when it starts, so the check runs in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax_llm_runtime.runtime.engine.sampler import empty_sampling_metadata, sample

vocab, rows = 49152, 4  # SmolLM2's vocabulary: 16384 columns per device
mesh = Mesh(np.array(jax.devices()[:3]), ("tp",))
replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "tp"))
on_mesh = jax.jit(lambda l, m: jax.lax.with_sharding_constraint(sample(l, m), replicated))
alone = jax.jit(sample)
rng = np.random.default_rng(0)
out = {"mesh": [], "alone": []}
for trial in range(16):
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    meta = empty_sampling_metadata(rows, vocab)
    meta.temperature[:] = 0.8
    meta.seeds[:] = np.arange(rows) + trial
    meta.top_k[:] = [0, 40, 0, 0]
    meta.top_p[:] = [1.0, 1.0, 0.9, 1.0]
    meta.min_p[:] = [0.0, 0.0, 0.0, 0.05]
    sharded = jax.device_put(logits, split), jax.device_put(meta, replicated)
    out["mesh"] += np.asarray(on_mesh(*sharded).token_ids).tolist()
    out["alone"] += np.asarray(alone(jnp.asarray(logits), meta).token_ids).tolist()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_seeded_draws_on_a_vocabulary_split_mesh() -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(0 <= t < 49152 for t in out["mesh"]), "a draw fell outside the vocabulary"
    assert out["mesh"] == out["alone"]
