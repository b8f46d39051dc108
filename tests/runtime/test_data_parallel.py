"""Data parallelism: replicas on their own devices give the same greedy tokens as one engine and
share the requests; the front engine routes to the least loaded replica that has room."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.engine.interface import EngineOverloadedError
from jax_llm_runtime.runtime.engine.stats import EngineStats
from jax_llm_runtime.runtime.parallel.data_parallel import DataParallelEngine
from tests.models.harness import TINY, save_random_model
from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_replicas_give_the_same_tokens_and_share_the_work(tmp_path: Path) -> None:
    import transformers

    fields = {**TINY, "vocab_size": VOCAB_SIZE, "pad_token_id": 0, "bos_token_id": 256}
    fields.update(eos_token_id=None, num_attention_heads=8, num_key_value_heads=4)
    save_random_model(transformers.LlamaConfig(**fields), tmp_path)
    save_byte_tokenizer(tmp_path)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    script = str(REPO / "tests/runtime/data_parallel_run.py")
    out = subprocess.run(
        [sys.executable, script, str(tmp_path), "1x1,2x1,2x2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    single = results["1x1"]
    for name, result in results.items():
        assert result["tokens"] == single["tokens"], f"{name} changed the tokens"
        assert all(result["steps"]), f"{name}: a replica ran nothing: {result['steps']}"
    assert results["2x1"]["cache_devices"] == [[0], [1]]
    assert results["2x2"]["cache_devices"] == [[0, 1], [2, 3]]


class _Replica:
    """What the front engine uses of a replica: its load and generate_n."""

    def __init__(self, load: int, full: bool = False) -> None:
        self.load, self.full, self.calls = load, full, 0
        self.model_name, self.max_model_len, self.tokenizer = "m", 64, None

    def num_unfinished(self) -> int:
        return self.load

    def generate_n(self, prompt: list[int], sampling: object, request_id: str, n: int) -> list:
        if self.full:
            raise EngineOverloadedError(self.load, 0)
        self.calls += 1
        self.load += n
        return [request_id] * n

    def stats(self) -> EngineStats:
        return EngineStats(self.load, 0, 10, 4, 1)


def test_requests_go_to_the_least_loaded_replica_with_room() -> None:
    replicas = [_Replica(3), _Replica(1), _Replica(0, full=True)]
    engine = DataParallelEngine(replicas)  # type: ignore[arg-type]
    assert engine.generate_n([1], None, "a", 2) == ["a", "a"]  # type: ignore[arg-type]
    assert [r.calls for r in replicas] == [0, 1, 0]  # the idle one is full: the next
    engine.generate([1], None, "b")  # type: ignore[arg-type]
    engine.generate([1], None, "c")  # type: ignore[arg-type]
    assert [r.calls for r in replicas] == [1, 2, 0]
    assert engine.stats() == EngineStats(4 + 4 + 0, 0, 30, 12, 3)
    for replica in replicas:
        replica.full = True
    with pytest.raises(EngineOverloadedError):
        engine.generate([1], None, "d")  # type: ignore[arg-type]


def test_devices_must_cover_every_replica() -> None:
    with pytest.raises(ValueError, match="needs 4"):
        EngineConfig(tensor_parallel_size=2, data_parallel_size=2, devices=(0, 1))
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        EngineConfig(data_parallel_size=0)
