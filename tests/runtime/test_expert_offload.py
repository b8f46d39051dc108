"""``--num-experts-offload-per-rank``: a MoE model with half its routed experts in pinned host
memory gives the same greedy tokens as with all of them on the device, on one device and with
expert parallelism over 2 and 4 fake CPU devices, float and packed; the offloaded stacks really
live in ``pinned_host`` memory and the device holds that much less. Bad values fail at startup.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.models.layers.expert_offload import ExpertOffload
from jax_llm_runtime.models.layers.moe import MoEConfig
from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.parallel.expert_offload_plan import (
    log_expert_offload,
    with_expert_offload,
)
from tests.models.harness import save_random_model
from tests.models.tiny_tokenizer import save_byte_tokenizer
from tests.runtime.test_tensor_parallel import BASE, REPO, run_sharded

NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("qwen2_moe")
    config = transformers.Qwen2MoeConfig(
        **{**BASE, "num_attention_heads": 8, "num_key_value_heads": 4},
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )
    save_random_model(config, folder)
    save_byte_tokenizer(folder)
    return folder


def _half(size: int, **extra: object) -> dict:
    """A run of ``size`` devices with expert parallelism and half of each rank's experts offloaded."""
    per_rank = NUM_EXPERTS // size // 2
    parallel = {"expert_parallel": True} if size > 1 else {}
    return {"size": size, **parallel, "num_experts_offload_per_rank": per_rank, **extra}


@pytest.mark.slow
def test_half_the_experts_offloaded_give_the_same_tokens(moe_folder: Path) -> None:
    runs = [
        {"size": 1},
        _half(1),
        _half(2),
        _half(4),
        {"size": 1, "isq": "q4_0"},
        _half(2, isq="q4_0"),
    ]
    float_, one, two, four, packed_float, packed_two = run_sharded(moe_folder, json.dumps(runs))
    # Prompts of 3 to 35 tokens: prefill runs the grouped expert path, decode the gathered one.
    for result in (one, two, four):
        assert result["tokens"] == float_["tokens"]
    assert packed_two["tokens"] == packed_float["tokens"]

    for result, size in ((one, 1), (two, 2), (four, 4), (packed_two, 2)):
        assert result["host_memory_kinds"] == ["pinned_host"]
        # Every device keeps half its share of the experts and holds the other half in host
        # memory; its weights shrink by exactly that.
        baseline = packed_float if result is packed_two else float_
        share = baseline["expert_bytes"][0] // size
        assert len(result["expert_bytes"]) == size
        assert set(result["expert_bytes"]) == {share // 2}
        assert set(result["expert_host_bytes"]) == {share // 2}
    assert float_["expert_host_bytes"] == [] and float_["host_memory_kinds"] == []
    assert one["weight_bytes"][0] == float_["weight_bytes"][0] - float_["expert_bytes"][0] // 2


def _moe_config(num_experts: int = NUM_EXPERTS) -> object:
    moe = MoEConfig(num_experts=num_experts, top_k=2, expert_intermediate_size=32)
    return dataclasses.make_dataclass("Config", [("moe", object)], frozen=True)(moe)


@pytest.mark.parametrize(
    ("fields", "offload"),
    [
        ({"num_experts_offload_per_rank": 4}, ExpertOffload(4, 1)),
        ({"num_experts_offload_per_rank": 7}, ExpertOffload(7, 1)),
        # Without expert parallelism every device holds all experts: one rank's worth.
        ({"num_experts_offload_per_rank": 7, "tensor_parallel_size": 2}, ExpertOffload(7, 1)),
        (
            {"num_experts_offload_per_rank": 1, "tensor_parallel_size": 4, "expert_parallel": True},
            ExpertOffload(1, 4),
        ),
    ],
)
def test_the_flag_sets_the_experts_per_rank(fields: dict, offload: ExpertOffload) -> None:
    config = with_expert_offload(_moe_config(), EngineConfig(**fields))
    assert config.moe.offload == offload


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_experts_offload_per_rank": 8}, "each of the 1 rank.* holds 8 of the 8"),
        (
            {"num_experts_offload_per_rank": 2, "tensor_parallel_size": 4, "expert_parallel": True},
            "each of the 4 rank.* holds 2 of the 8",
        ),
    ],
)
def test_too_many_offloaded_experts_is_an_error(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"--num-experts-offload-per-rank .*{message}"):
        with_expert_offload(_moe_config(), EngineConfig(**fields))


def test_experts_that_do_not_divide_over_the_ranks_are_an_error() -> None:
    fields = {"num_experts_offload_per_rank": 1, "tensor_parallel_size": 3, "expert_parallel": True}
    with pytest.raises(ValueError, match="8 routed experts do not divide over 3 ranks"):
        with_expert_offload(_moe_config(), EngineConfig(**fields))


def test_a_dense_model_is_an_error_and_zero_changes_nothing() -> None:
    dense = dataclasses.make_dataclass("Dense", [("moe", object)], frozen=True)(None)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        with_expert_offload(dense, EngineConfig(num_experts_offload_per_rank=1))
    assert with_expert_offload(dense, EngineConfig()) is dense
    with pytest.raises(ValueError, match="num_experts_offload_per_rank must be >= 0"):
        EngineConfig(num_experts_offload_per_rank=-1)


def test_startup_logs_the_device_bytes_saved(caplog: pytest.LogCaptureFixture) -> None:
    import jax

    config = _moe_config()
    config = dataclasses.replace(
        config, moe=dataclasses.replace(config.moe, offload=ExpertOffload(4))
    )
    weights = {
        "e_gate": jnp.zeros((2, 4, 64, 32)),  # 64 KiB
        "e_gate_host": jax.device_put(np.zeros((2, 4, 64, 32), np.float32), jax.memory.Space.Host),
    }
    with caplog.at_level(
        logging.INFO, logger="jax_llm_runtime.runtime.parallel.expert_offload_plan"
    ):
        log_expert_offload(config, weights)
    assert "4 of the 8 routed experts per rank in pinned host memory" in caplog.text
    assert "holds 0.1 MB of weights, 0.1 MB less than without offload" in caplog.text


def test_cli_refuses_offload_for_a_dense_model_in_one_line(tmp_path: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        **{**BASE, "num_attention_heads": 8, "num_key_value_heads": 4}
    )
    save_random_model(config, tmp_path)
    save_byte_tokenizer(tmp_path)
    args = [
        "--model-id",
        str(tmp_path),
        "--num-experts-offload-per-rank",
        "1",
        "--log",
        "/dev/null",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "jax_llm_runtime.api.cli.serve", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("runtime-serve: error: --num-experts-offload-per-rank needs a mixture")
