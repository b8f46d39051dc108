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

from jax_llm_runtime.runtime.parallel.kv_heads import kv_replicas
from jax_llm_runtime.runtime.parallel.sharding import ShardingError, build_mesh, check_divisible
from tests.models.harness import TINY, save_random_model
from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer

REPO = Path(__file__).resolve().parents[2]
BASE = {**TINY, "vocab_size": VOCAB_SIZE, "pad_token_id": 0, "bos_token_id": 256}
BASE["eos_token_id"] = None  # random weights: every run takes the whole budget


def run_on_four_devices(script: str, *args: str) -> dict[str, dict]:
    """Run ``tests/runtime/<script>`` with ``args`` in a fresh process that sees 4 fake CPU
    devices; its last line of output, as JSON."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    # The checkout under test first, then whatever the caller put on the path.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, str(REPO / "tests/runtime" / script), *args]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_sharded(folder: Path, sizes: str, extra: dict | None = None) -> dict[str, dict]:
    return run_on_four_devices(
        "tensor_parallel_run.py", str(folder), sizes, json.dumps(extra or {})
    )


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
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
def test_a_cache_in_integer_storage_splits_over_2_devices(tmp_path: Path, kv_cache_dtype) -> None:
    """On CPU a bfloat16 or float8 cache is stored as integers (``storage_dtype``); sharded by
    KV heads it still decodes the one-device tokens."""
    import transformers

    config = transformers.LlamaConfig(
        **{**BASE, "num_attention_heads": 8, "num_key_value_heads": 4}
    )
    save_random_model(config, tmp_path)
    save_byte_tokenizer(tmp_path)
    check_split(run_sharded(tmp_path, "1,2", {"kv_cache_dtype": kv_cache_dtype}))


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


def save_deepseek_v2(folder: Path, q_lora_rank: int | None) -> None:
    """A tiny DeepSeek-V2: multi-head latent attention over 4 heads, MoE in every layer."""
    import transformers

    config = transformers.DeepseekV2Config(
        **{**BASE, "num_key_value_heads": 4},
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=0,  # one segment of layers: one scan to compile
    )
    save_random_model(config, folder)
    save_byte_tokenizer(folder)


def check_mla_split(single: dict, results: dict[str, dict], per_head: tuple[str, ...]) -> None:
    """Same tokens as on one device; the per-head projections split 1/N, the low-rank parts
    and the latent cache whole on every device."""
    for size, result in results.items():
        n, fields = int(size), result["field_bytes"]
        assert result["tokens"] == single["tokens"], f"tensor parallel {n} changed the tokens"
        assert result["cache_bytes"] == single["cache_bytes"] * n, "the latent cache is replicated"
        for name in per_head:
            assert fields[name] == [single["field_bytes"][name][0] // n] * n, name
        for name in ("wkv_a", "kv_a_norm", *(("wq_a", "q_a_norm") if "wq_b" in fields else ())):
            assert fields[name] == single["field_bytes"][name] * n, name


@pytest.mark.slow
def test_deepseek_mla_splits_by_heads(tmp_path: Path) -> None:
    save_deepseek_v2(tmp_path, q_lora_rank=32)
    # A 35-token prompt takes two chunks, so decode reads latents of earlier steps.
    short = {"prefill_chunk_size": 32}  # fewer prefill buckets to compile
    results = run_sharded(tmp_path, "1,2,4", short)
    single = results["1"]
    check_mla_split(single, results, ("wq_b", "wkv_b", "wo"))
    assert set(results["4"]["expert_bytes"]) == set(single["expert_bytes"]), "experts replicated"
    # With expert parallelism the routed experts split too; attention splits as before.
    expert_parallel = run_sharded(tmp_path, "2,4", {**short, "expert_parallel": True})
    check_mla_split(single, expert_parallel, ("wq_b", "wkv_b", "wo"))
    for size, result in expert_parallel.items():
        assert set(result["expert_bytes"]) == {single["expert_bytes"][0] // int(size)}


@pytest.mark.slow
def test_deepseek_mla_without_q_lora_packed_over_4_devices(tmp_path: Path) -> None:
    save_deepseek_v2(tmp_path, q_lora_rank=None)
    extra = {"prefill_chunk_size": 32, "expert_parallel": True, "isq": "q4_0"}
    results = run_sharded(tmp_path, "1,4", extra)
    # The packed query projection splits its codes and group scales by heads; kv_b stays
    # float. (wo's group scales are too few rows to split on this tiny model.)
    check_mla_split(results["1"], results, ("wq", "wkv_b"))
    wo = results["4"]["field_bytes"]["wo"]
    assert max(wo) < results["1"]["field_bytes"]["wo"][0] / 2


@pytest.mark.slow
def test_kv_heads_fewer_than_the_devices_are_repeated(tmp_path: Path) -> None:
    """2 KV heads over 4 devices: each KV head is repeated on 2 devices (its projections'
    columns, plain and packed), every device holds one head of the cache, and the greedy tokens
    are the one-device tokens."""
    import transformers

    config = transformers.Qwen2Config(
        **{**BASE, "num_attention_heads": 8, "num_key_value_heads": 2}
    )
    save_random_model(config, tmp_path)
    save_byte_tokenizer(tmp_path)
    for extra, sizes in (({}, "1,2,4"), ({"isq": "q4_0"}, "1,4")):
        results = run_sharded(tmp_path, sizes, extra)
        for size in sizes.split(",")[1:]:
            assert results[size]["tokens"] == results["1"]["tokens"], (extra, size)
            assert len(set(results[size]["cache_bytes"])) == 1
        # One device: 2 heads of 64 values per cached token; two or four: 1 head each.
        per_token = {n: results[n]["cache_bytes"][0] / results[n]["cache_tokens"] for n in results}
        assert all(per_token[n] == per_token["1"] / 2 for n in results if n != "1")


def test_heads_that_do_not_divide_are_a_clear_error() -> None:
    with pytest.raises(ShardingError, match="3 KV heads do not divide by --tensor-parallel-size 2"):
        check_divisible(6, 3, 2, is_mla=False)
    with pytest.raises(
        ShardingError, match=r"3 KV heads do not divide by --tensor-parallel-size 4 \(nor divide it"
    ):
        check_divisible(12, 3, 4, is_mla=False)
    check_divisible(8, 4, 4, is_mla=False)
    assert [kv_replicas(16, kv, 16, False) for kv in (16, 8, 2, 1)] == [1, 2, 8, 16]
    assert kv_replicas(8, 4, 2, False) == 1 and kv_replicas(8, 1, 4, True) == 1
    # MLA splits its query heads; its one latent KV "head" is replicated, never split.
    check_divisible(8, 1, 4, is_mla=True)
    with pytest.raises(ShardingError, match="6 attention heads do not divide by --tensor-para"):
        check_divisible(6, 1, 4, is_mla=True)


def test_a_mesh_needs_devices_that_exist() -> None:
    assert build_mesh(None, 1) is None  # one device: nothing is sharded
    with pytest.raises(ShardingError, match="device 7 does not exist"):
        build_mesh([7], 1)
    with pytest.raises(ShardingError, match="lists 2 devices"):
        build_mesh([0, 1], 4)


@pytest.mark.slow
def test_every_step_bucket_takes_the_inputs_the_runner_passes(tmp_path: Path) -> None:
    """Each compiled bucket's batch and sampling inputs are placed as the runner passes them
    (replicated on the mesh), and every bucket runs, with the grammar mask kept on the device
    (no constrained sequence) or sent from the host, at tensor-parallel sizes 1, 2 and 3 (the
    tiny vocabulary's mask of 9 words splits over 3)."""
    import transformers

    config = transformers.LlamaConfig(
        **{**BASE, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 6}
    )
    save_random_model(config, tmp_path)
    save_byte_tokenizer(tmp_path)
    results = run_on_four_devices("step_shardings_run.py", str(tmp_path), "1,2,3")
    for size, result in results.items():
        assert result["buckets"] > 4, size
        assert result["mismatches"] == [], f"tp {size}"
        assert result["failures"] == [], f"tp {size}"
