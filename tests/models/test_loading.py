"""HF checkpoints as users have them: bf16/f16 and sharded safetensors; clear errors for an
unsupported architecture or a broken config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jax_llm_runtime.models.registry import (
    UnsupportedArchitectureError,
    get_model_spec,
    model_config_from_hf,
)
from tests.api.test_cli import run_cli
from tests.models.harness import TINY, check_model, load_ours


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_sharded_checkpoint(tmp_path: Path, dtype: str) -> None:
    """A bf16/f16 checkpoint in several shards (with ``model.safetensors.index.json``) runs like
    HF's model on the same half-precision weights (computed in float32 on both sides)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).eval()
    model.to(getattr(torch, dtype)).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    check_model(load_ours(tmp_path), model.float())


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(UnsupportedArchitectureError) as err:
        get_model_spec("FooForCausalLM")
    message = str(err.value)
    assert "'FooForCausalLM' is not supported" in message and "\n" not in message
    for name in ("LlamaForCausalLM", "Gemma3ForCausalLM", "DeepseekV3ForCausalLM"):
        assert name in message


def test_missing_config_key_is_a_value_error() -> None:
    hf = {"architectures": ["LlamaForCausalLM"], **TINY}
    del hf["hidden_size"]
    with pytest.raises(ValueError, match="missing the key 'hidden_size'"):
        model_config_from_hf(hf)


def _cli_error(folder: Path) -> str:
    result = run_cli("--model-id", str(folder), "--log", os.devnull)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("runtime-serve: error: "), result.stderr
    return lines[0]


def test_unsupported_architecture_is_one_cli_line(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    save_file({"w": np.zeros(2, np.float32)}, tmp_path / "model.safetensors")
    assert "'FooForCausalLM' is not supported" in _cli_error(tmp_path)


def test_corrupt_safetensors_is_one_cli_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 4)
    assert "not a readable safetensors file" in _cli_error(tmp_path)
