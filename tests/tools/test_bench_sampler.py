"""tools/bench_sampler.py: its sort-based peer draws from the same filtered distribution as the
sampler (so the timing compares like with like), and the tool runs end to end on a small row."""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.runtime.engine.sampler import empty_sampling_metadata, sample
from tests.tools import load_tool


def test_peer_and_sampler_keep_the_same_tokens():
    tool = load_tool("bench_sampler.py")
    rows = 2000
    logits = jnp.asarray(
        np.tile(np.log([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]), (rows, 1)), jnp.float32
    )
    meta = empty_sampling_metadata(rows)
    meta.seeds[:], meta.temperature[:], meta.top_p[:], meta.top_k[:] = np.arange(rows), 1.0, 0.7, 4
    ours = np.asarray(sample(logits, meta).token_ids)
    peer = np.asarray(tool.sorted_sample(logits, meta))
    # top_k 4 keeps 0.9 of the mass; top_p 0.7 of that is reached by 0.4 + 0.25 (0.72 of it).
    assert set(ours) == set(peer) == {0, 1}
    np.testing.assert_allclose(
        np.bincount(ours, minlength=6) / rows, np.bincount(peer, minlength=6) / rows, atol=0.05
    )


def test_the_tool_prints_a_row_per_setting(capsys, monkeypatch):
    tool = load_tool("bench_sampler.py")
    monkeypatch.setattr(
        sys, "argv", ["bench_sampler.py", "--rows", "2", "--vocab", "64", "--rounds", "1"]
    )
    assert tool.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if line.split()[:1] == ["2"]]) == len(tool.SETTINGS)
