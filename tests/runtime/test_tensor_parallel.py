"""Tensor parallelism on fake CPU devices: greedy tokens do not change with the tensor-parallel
size, and each device really holds only its share of the layers and of the KV cache.

JAX fixes its device count when it starts, so the sharded engines run in a fresh process
(``tensor_parallel_run.py``) with ``--xla_force_host_platform_device_count=4``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.sharding import ShardingError, build_mesh, check_divisible
from tests.models.harness import TINY, save_random_model
from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer

REPO = Path(__file__).resolve().parents[2]
BASE = {**TINY, "vocab_size": VOCAB_SIZE, "pad_token_id": 0, "bos_token_id": 256}
BASE["eos_token_id"] = None  # random weights: every run takes the whole budget


def run_sharded(folder: Path, sizes: str, extra: dict | None = None) -> dict[str, dict]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env["PYTHONPATH"] = str(REPO)
    args = [sys.executable, str(REPO / "tests/runtime/tensor_parallel_run.py"), str(folder), sizes]
    out = subprocess.run(
        [*args, json.dumps(extra or {})], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_split(results: dict[str, dict]) -> None:
    single = results["1"]
    for size, result in results.items():
        n = int(size)
        assert result["tokens"] == single["tokens"], f"tensor parallel {n} changed the tokens"
        assert len(result["cache_bytes"]) == n
        assert set(result["cache_bytes"]) == {single["cache_bytes"][0] // n}
        # The projections split; norms and the group scales of rows too short to split (tiny
        # model) are replicated.
        assert max(result["layer_bytes"]) <= single["layer_bytes"][0] / n * 1.15


@pytest.mark.slow
def test_dense_llama_over_2_and_4_devices(tmp_path: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        **{**BASE, "num_attention_heads": 8, "num_key_value_heads": 4}
    )
    save_random_model(config, tmp_path)
    save_byte_tokenizer(tmp_path)
    check_split(run_sharded(tmp_path, "1,2,4"))
    # Packed 4-bit weights split their codes and group scales together.
    check_split(run_sharded(tmp_path, "1,4", {"isq": "q4_0"}))


@pytest.mark.slow
def test_moe_model_with_replicated_or_split_experts(tmp_path: Path) -> None:
    import transformers

    config = transformers.Qwen2MoeConfig(
        **{**BASE, "num_attention_heads": 8, "num_key_value_heads": 4},
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )
    save_random_model(config, tmp_path)
    save_byte_tokenizer(tmp_path)
    # Tensor parallelism alone: attention and the shared expert split, the routed experts
    # replicated on every device.
    replicated = run_sharded(tmp_path, "1,2")
    assert replicated["2"]["tokens"] == replicated["1"]["tokens"]
    assert set(replicated["2"]["expert_bytes"]) == set(replicated["1"]["expert_bytes"])
    # With expert parallelism the experts split too.
    results = run_sharded(tmp_path, "1,2,4", {"expert_parallel": True})
    check_split(results)
    # Decode gathers the routed experts' weights, prefill runs them grouped: both paths ran.
    packed = run_sharded(tmp_path, "1,4", {"expert_parallel": True, "isq": "q4_0"})
    assert packed["4"]["tokens"] == packed["1"]["tokens"]
    for results_ in (results, packed):
        single = results_["1"]["expert_bytes"][0]
        for size, result in results_.items():
            assert set(result["expert_bytes"]) == {single // int(size)}, "each device: 1/N experts"


def test_heads_that_do_not_divide_are_a_clear_error() -> None:
    with pytest.raises(ShardingError, match="3 KV heads do not divide by --tensor-parallel-size 2"):
        check_divisible(6, 3, 2, is_mla=False)
    with pytest.raises(ShardingError, match="latent attention"):
        check_divisible(8, 1, 2, is_mla=True)
    check_divisible(8, 4, 4, is_mla=False)


def test_a_mesh_needs_devices_that_exist() -> None:
    assert build_mesh(None, 1) is None  # one device: nothing is sharded
    with pytest.raises(ShardingError, match="device 7 does not exist"):
        build_mesh([7], 1)
    with pytest.raises(ShardingError, match="lists 2 devices"):
        build_mesh([0, 1], 4)
