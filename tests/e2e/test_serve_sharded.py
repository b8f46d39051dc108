"""Tensor- and data-parallel servers over HTTP on fake CPU devices answer every kind of request
(``sharded_requests.exercise``) with the greedy answers of one device: the real SmolLM2 split 3
ways (its 9 query and 3 KV heads divide by 3), and a tiny Qwen3 split 2 ways and served by 2
replicas."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.sharded_requests import exercise
from tests.models.harness import TINY, save_random_model
from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer
from tests.serve_process import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENGINE = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "256", "--mem", "16"]
# Each server runs a few requests and stops: it compiles the shapes they run, when they first run.
ENGINE += ["--precompile", "none"]


@pytest.fixture(autouse=True)
def four_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    # The servers are subprocesses: they read the flag when JAX starts.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")


def answers(args: list[str], log: Path) -> dict:
    with running_server([*ENGINE, *args], log) as server:
        return exercise(server.url, server.model)


def test_smollm2_split_over_three_devices(smollm2_gguf: Path, tmp_path: Path) -> None:
    # One device would take int8 activations on CPUs with integer dots (--matmul-dtype auto),
    # a mesh the model dtype: compare the same numbers.
    model = ["--model-id", str(smollm2_gguf), "--matmul-dtype", "model"]
    alone = answers(model, tmp_path / "one.log")
    split = answers(
        [*model, "--devices", "0,1,2", "--tensor-parallel-size", "3"], tmp_path / "tp3.log"
    )
    assert split["texts"] == alone["texts"]
    assert split["json"] == alone["json"]
    assert split["completion"] == alone["completion"]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    fields = {**TINY, "vocab_size": VOCAB_SIZE, "pad_token_id": 0, "bos_token_id": 256}
    config = transformers.Qwen3Config(**fields, eos_token_id=None, head_dim=16)
    save_random_model(config, folder)
    save_byte_tokenizer(folder)
    return folder


def test_tiny_qwen3_split_two_ways_and_two_replicas(tiny_qwen3: Path, tmp_path: Path) -> None:
    model = ["--model-id", str(tiny_qwen3)]
    alone = answers(model, tmp_path / "one.log")
    split = answers(
        [*model, "--devices", "0,1", "--tensor-parallel-size", "2"], tmp_path / "tp2.log"
    )
    replicas = answers([*model, "--data-parallel-size", "2"], tmp_path / "dp2.log")
    for result in (split, replicas):
        assert result == alone
