"""Prepared checkpoints (``runtime.loading.prepared``): a tiny random-weight model written with
orbax and restored gives the same arrays and greedy tokens, float and ``--isq``-packed; a
layout version of another runtime, a truncated directory and flags asking for other weights are
refused with one line; on 4 fake CPU devices every restored array has the sharding that
loading the source gives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedWeight
from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.loading.builder import build_engine, load_model
from jax_llm_runtime.runtime.loading.prepared import (
    LAYOUT_VERSION,
    PreparedCheckpointError,
    save_prepared,
)
from jax_llm_runtime.runtime.loading.sources import PREPARED_MANIFEST, resolve_model_source
from tests.models.harness import TINY, save_random_model
from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer
from tests.runtime.tensor_parallel_run import PROMPTS, greedy_tokens
from tests.serve_process import REPO_ROOT

SMALL = dict(
    max_num_seqs=4, max_model_len=128, kvcache_mem_mb=4, dtype="float32", precompile="none"
)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with random weights and a byte tokenizer, as an HF folder; its 8 heads and 4
    KV heads split over 4 devices."""
    import transformers

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = {**TINY, "vocab_size": VOCAB_SIZE, "bos_token_id": 256, "eos_token_id": None}
    config |= {"num_attention_heads": 8, "num_key_value_heads": 4}
    save_random_model(transformers.LlamaConfig(**config), folder)
    save_byte_tokenizer(folder)
    (folder / "generation_config.json").write_text('{"temperature": 0.5}')
    return folder


@pytest.fixture(scope="module")
def prepared(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``source`` prepared as it is (float32)."""
    return save_prepared(
        EngineConfig(model_id=str(source), **SMALL), tmp_path_factory.mktemp("p") / "tiny"
    )


def _tokens(model_id: Path, **fields) -> list[list[int]]:
    engine = build_engine(EngineConfig(model_id=str(model_id), **SMALL, **fields))
    engine.start()
    try:
        return greedy_tokens(engine, PROMPTS, "prepared")
    finally:
        engine.shutdown()


def _same_arrays(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_directory_holds_config_tokenizer_template_and_version(prepared: Path) -> None:
    manifest = json.loads((prepared / PREPARED_MANIFEST).read_text())
    assert manifest["layout_version"] == LAYOUT_VERSION
    assert (
        manifest["prepared_with"]["dtype"] == "float32" and manifest["prepared_with"]["isq"] is None
    )
    assert json.loads((prepared / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    assert (prepared / "tokenizer" / "tokenizer.json").is_file()
    assert "assistant: " in (prepared / "chat_template.jinja").read_text()
    assert json.loads((prepared / "generation_config.json").read_text()) == {"temperature": 0.5}
    assert not prepared.with_name(prepared.name + ".partial").exists()
    assert resolve_model_source(str(prepared)).kind == "prepared"


def test_round_trip_restores_the_same_model(source: Path, prepared: Path) -> None:
    loaded = load_model(EngineConfig(model_id=str(source), **SMALL))
    restored = load_model(EngineConfig(model_id=str(prepared), **{**SMALL, "dtype": "auto"}))
    _same_arrays(loaded.weights, restored.weights)
    assert restored.config == loaded.config and restored.dtype == loaded.dtype
    text = "Hello, world! 12 + 30"
    assert restored.tokenizer.encode(text) == loaded.tokenizer.encode(text)
    assert restored.tokenizer.eos_token_ids == loaded.tokenizer.eos_token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert restored.tokenizer.apply_chat_template(messages) == loaded.tokenizer.apply_chat_template(
        messages
    )
    assert _tokens(prepared) == _tokens(source)


@pytest.mark.parametrize("isq", ["q4_0", "int8"])
def test_quantized_weights_round_trip(source: Path, tmp_path: Path, isq: str) -> None:
    config = EngineConfig(model_id=str(source), isq=isq, **SMALL)
    path = save_prepared(config, tmp_path / isq)
    loaded = load_model(config)
    restored = load_model(EngineConfig(model_id=str(path), **SMALL))  # --isq left out
    _same_arrays(loaded.weights, restored.weights)
    assert restored.config.quantization == isq
    wq = restored.weights["segments"][0]["wq"]
    assert isinstance(wq, PackedWeight) if isq == "q4_0" else type(wq).__name__ == "QuantizedWeight"
    if isq == "q4_0":
        assert _tokens(path) == _tokens(source, isq=isq)


def test_matmul_operands_follow_the_restoring_flags(source: Path, tmp_path: Path) -> None:
    config = EngineConfig(model_id=str(source), isq="q4_0", matmul_dtype="model", **SMALL)
    path = save_prepared(config, tmp_path / "q4_0")
    for matmul_dtype, operands in (("model", None), ("bfloat16", "bfloat16")):
        fields = dict(SMALL, matmul_dtype=matmul_dtype)
        weights = load_model(EngineConfig(model_id=str(path), **fields)).weights
        packed = [w for w in weights["segments"][0].values() if isinstance(w, PackedWeight)]
        assert packed and {w.operand_dtype for w in packed} == {operands}


def test_offloaded_experts_restore_into_pinned_host_memory(tmp_path: Path) -> None:
    import transformers

    config = {**TINY, "vocab_size": VOCAB_SIZE, "bos_token_id": 256, "eos_token_id": None}
    hf = transformers.Qwen2MoeConfig(
        **config,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )
    save_random_model(hf, tmp_path / "moe")
    save_byte_tokenizer(tmp_path / "moe")
    fields = dict(SMALL, isq="q4_0", num_experts_offload_per_rank=2)
    source = EngineConfig(model_id=str(tmp_path / "moe"), **fields)
    path = save_prepared(source, tmp_path / "moe-prepared")
    loaded = load_model(source).weights
    restored = load_model(EngineConfig(model_id=str(path), **fields)).weights
    _same_arrays(loaded, restored)
    kinds = [
        (a.sharding.memory_kind, b.sharding.memory_kind)
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(restored), strict=True)
    ]
    assert all(a == b for a, b in kinds) and ("pinned_host", "pinned_host") in kinds
    assert "--num-experts-offload-per-rank 2, not 0" in _error(path, isq="q4_0")


def _copy(prepared: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(prepared, tmp_path / "copy"))


def _error(model_id: Path, **fields) -> str:
    with pytest.raises(PreparedCheckpointError) as caught:
        load_model(EngineConfig(model_id=str(model_id), **{**SMALL, **fields}))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_another_layout_version_is_refused(prepared: Path, tmp_path: Path) -> None:
    copy = _copy(prepared, tmp_path)
    manifest = json.loads((copy / PREPARED_MANIFEST).read_text())
    (copy / PREPARED_MANIFEST).write_text(json.dumps({**manifest, "layout_version": 0}))
    assert "layout version 0" in _error(copy) and "prepare it again" in _error(copy)


def test_truncated_or_missing_files_are_refused(prepared: Path, tmp_path: Path) -> None:
    copy = _copy(prepared, tmp_path)
    largest = max(
        (p for p in (copy / "weights").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    with largest.open("r+b") as f:
        f.truncate(largest.stat().st_size // 2)
    assert "is damaged" in _error(copy)
    largest.unlink()
    assert "is incomplete" in _error(copy)
    (copy / PREPARED_MANIFEST).write_text('{"layout_version": 1,')
    assert "cannot read" in _error(copy)


def test_weights_orbax_cannot_read_are_a_clean_error(prepared: Path, tmp_path: Path) -> None:
    copy = _copy(prepared, tmp_path)
    manifest = json.loads((copy / PREPARED_MANIFEST).read_text())
    # A file the size check does not know about was damaged: orbax's own error, as one line.
    metadata = "weights/_METADATA"  # orbax's description of the stored tree
    (copy / metadata).write_text("x" * manifest["files"][metadata])
    assert "cannot restore the weights" in _error(copy)


def test_flags_asking_for_other_weights_are_refused(prepared: Path) -> None:
    assert "--isq q8_0" in _error(prepared, isq="q8_0")
    assert "--dtype bfloat16" in _error(prepared, dtype="bfloat16")
    assert "--tensor-parallel-size 1, not 2" in _error(prepared, tensor_parallel_size=2)


def test_saving_refuses_an_existing_directory(source: Path, prepared: Path) -> None:
    with pytest.raises(PreparedCheckpointError, match="already exists"):
        save_prepared(EngineConfig(model_id=str(source), **SMALL), prepared)
    with pytest.raises(PreparedCheckpointError, match="already a prepared checkpoint"):
        save_prepared(EngineConfig(model_id=str(prepared), **SMALL), prepared.parent / "again")


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jax_llm_runtime.api.cli.serve", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_cli_saves_then_refuses_a_truncated_copy_in_one_line(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "cli"
    saved = _serve("--model-id", str(source), "--save-prepared", str(target), "--dtype", "float32")
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert f"--model-id {target}" in saved.stdout
    manifest = json.loads((target / PREPARED_MANIFEST).read_text())
    name = max(manifest["files"], key=manifest["files"].get)
    (target / name).write_bytes(b"")
    served = _serve("--model-id", str(target), "--log-level", "off")
    assert served.returncode == 1
    assert "Traceback" not in served.stderr
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("runtime-serve: error: "), served.stderr
    assert "is damaged" in lines[0] and name in lines[0]


def test_cli_refuses_save_prepared_with_models_config(tmp_path: Path) -> None:
    result = _serve("--save-prepared", str(tmp_path / "x"), "--models-config", "m.yaml")
    assert result.returncode == 2
    assert "--save-prepared" in result.stderr and "--models-config" in result.stderr


@pytest.mark.slow
def test_restored_shards_keep_their_shardings_on_four_devices(source: Path, tmp_path: Path) -> None:
    # JAX fixes its device count when it starts: the 4 fake devices need a fresh process.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    script = REPO_ROOT / "tests/runtime/prepared_run.py"
    command = [sys.executable, str(script), str(source), str(tmp_path / "tp4")]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mismatched"] == []
    assert result["split"] > 0  # some arrays really are split over the 4 devices
    assert result["restored_tokens"] == result["loaded_tokens"]


@pytest.mark.slow
def test_gemma3_270m_q4k_restores_to_the_same_tokens(tmp_path: Path) -> None:
    """The real model: quantized to Q4_K at load, and restored from its prepared checkpoint."""
    from tests.runtime.test_gemma3_270m import PROMPTS as TEXTS

    gguf = resolve_model_source("gemma3-270m").path
    fields = dict(max_num_seqs=8, max_model_len=256, kvcache_mem_mb=64, dtype="float32")
    config = EngineConfig(model_id=str(gguf), isq="q4k", **fields)
    path = save_prepared(config, tmp_path / "gemma3-q4k")

    def greedy(model_id: Path, isq: str | None) -> list[list[int]]:
        engine = build_engine(EngineConfig(model_id=str(model_id), isq=isq, **fields))
        engine.start()
        try:
            prompts = [engine.tokenizer.encode(text) for text in TEXTS]
            return greedy_tokens(engine, prompts, "gemma")
        finally:
            engine.shutdown()

    assert greedy(path, None) == greedy(gguf, "q4k")


def test_gemma4_bfloat16_per_layer_table_round_trips(tmp_path: Path) -> None:
    """A bfloat16 Gemma 4 E2B-shaped checkpoint prepared for a float32 run keeps its per-layer
    embedding table in bfloat16 (``per_layer_dtype``), and restores the same arrays and tokens."""
    import torch

    from tests.models.test_gemma4_llama4 import _gemma4_config, _randomised

    source = tmp_path / "gemma4"
    hf = _gemma4_config(
        vocab_size=VOCAB_SIZE, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB_SIZE, num_kv_shared_layers=1, bos_token_id=256,
    )  # fmt: skip
    _randomised(hf, tmp_path / "f32").to(torch.bfloat16).save_pretrained(source)
    save_byte_tokenizer(source)
    path = save_prepared(EngineConfig(model_id=str(source), **SMALL), tmp_path / "prepared")
    loaded = load_model(EngineConfig(model_id=str(source), **SMALL))
    restored = load_model(EngineConfig(model_id=str(path), **SMALL))
    assert loaded.config.per_layer_dtype == "bfloat16" == restored.config.per_layer_dtype
    assert restored.weights["ple_embed"].dtype == jax.numpy.bfloat16
    _same_arrays(loaded.weights, restored.weights)
    assert _tokens(path) == _tokens(source)
