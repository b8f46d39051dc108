"""GGUF loading: synthetic llama files (fast) and the real SmolLM2 file against HF transformers."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest

from jax_llm_runtime.runtime.loading.gguf.loader import (
    GGUFError,
    load_gguf_checkpoint,
    read_gguf_header,
)
from tests.runtime.gguf_fixtures import TINY_LLAMA, write_tiny_llama_gguf


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_llama_gguf(path)


def test_config_from_metadata(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    config = load_gguf_checkpoint(tiny[0]).config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    for key, value in TINY_LLAMA.items():
        assert config[key] == value, key
    assert config["head_dim"] == 16
    assert config["rope_theta"] == 50000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["tie_word_embeddings"] is False


def test_tensors_are_hf_named_shaped_and_unpermuted(
    tiny: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, expected = tiny
    checkpoint = load_gguf_checkpoint(path)
    got = dict(checkpoint.tensors())
    assert checkpoint.num_tensors == len(expected)
    assert got.keys() == expected.keys()
    for name, array in got.items():
        assert array.dtype == np.float32, name
        assert array.shape == expected[name].shape, name
        np.testing.assert_array_equal(array, expected[name], err_msg=name)
    # A second pass starts over and yields the same arrays.
    again = dict(checkpoint.tensors())
    np.testing.assert_array_equal(
        again["model.layers.1.self_attn.k_proj.weight"],
        got["model.layers.1.self_attn.k_proj.weight"],
    )


def test_vocab_size_falls_back_to_embedding_rows(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    write_tiny_llama_gguf(path, skip_keys=("vocab_size",))
    assert load_gguf_checkpoint(path).config["vocab_size"] == TINY_LLAMA["vocab_size"]


def test_tied_embeddings(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    expected = write_tiny_llama_gguf(path, tied=True)
    checkpoint = load_gguf_checkpoint(path)
    assert checkpoint.config["tie_word_embeddings"] is True
    names = [name for name, _ in checkpoint.tensors()]
    assert "lm_head.weight" not in names
    assert sorted(names) == sorted(expected)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    write_tiny_llama_gguf(path, arch="mamba9")
    with pytest.raises(GGUFError, match="mamba9"):
        load_gguf_checkpoint(path)


def test_missing_metadata_key(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    write_tiny_llama_gguf(path, skip_keys=("block_count",))
    with pytest.raises(GGUFError, match=r"llama\.block_count"):
        load_gguf_checkpoint(path)


@pytest.mark.parametrize(
    "name", ["blk.0.attn_rot_embd.weight", "blk.7.attn_norm.weight", "mystery.weight"]
)
def test_unmapped_tensor(tmp_path: Path, name: str) -> None:
    path = tmp_path / "x.gguf"
    write_tiny_llama_gguf(path, extra_tensors={name: np.ones(64, dtype=np.float32)})
    with pytest.raises(GGUFError, match=name.replace(".", r"\.")):
        load_gguf_checkpoint(path)


def test_truncated_file(tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    data = tiny[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in (0, 3, 10, 24, 100, 1000, len(data) // 2, len(data) - 1):
        cut.write_bytes(data[:size])
        with pytest.raises(GGUFError):
            load_gguf_checkpoint(cut)


def test_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf_checkpoint(path)
    with pytest.raises(GGUFError, match="cannot read"):
        load_gguf_checkpoint(tmp_path / "missing.gguf")


def test_huge_array_count_fails_fast(tmp_path: Path) -> None:
    # gguf.GGUFReader loops forever on this 37-byte file.
    path = tmp_path / "evil.gguf"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    path.write_bytes(header + struct.pack("<Q", 1) + b"x" + struct.pack("<IIQ", 9, 0, 2**62))
    start = time.monotonic()
    with pytest.raises(GGUFError, match="too long"):
        read_gguf_header(path)
    assert time.monotonic() - start < 1.0


def test_corrupted_bytes_raise_gguf_error_or_load(
    tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """Flipping header bytes either still loads or raises GGUFError, never anything else."""
    data = bytearray(tiny[0].read_bytes())
    header_end = read_gguf_header(tiny[0]).tensors[0].offset
    rng = np.random.default_rng(0)
    bad = tmp_path / "bad.gguf"
    for _ in range(300):
        mutated = bytearray(data)
        for pos in rng.integers(0, header_end, size=3):
            mutated[pos] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(mutated))
        try:
            for _name, _array in load_gguf_checkpoint(bad).tensors():
                pass
        except GGUFError:
            pass


@pytest.mark.slow
def test_tiny_file_matches_transformers(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    """HF transformers reads the synthetic file to the same tensors (an independent unpermute)."""
    import torch
    import transformers

    path, _ = tiny
    _assert_matches_transformers(path, torch, transformers)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_gguf: Path) -> None:
    import torch
    import transformers

    _assert_matches_transformers(smollm2_gguf, torch, transformers)


def _assert_matches_transformers(path: Path, torch, transformers) -> None:  # type: ignore[no-untyped-def]
    checkpoint = load_gguf_checkpoint(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    reference = {k: v.numpy() for k, v in model.state_dict().items()}
    seen = set()
    for name, array in checkpoint.tensors():
        assert name in reference, name
        np.testing.assert_array_equal(array, reference[name], err_msg=name)
        seen.add(name)
    leftover = set(reference) - seen
    assert leftover <= ({"lm_head.weight"} if checkpoint.config["tie_word_embeddings"] else set())

    hf = model.config
    config = checkpoint.config
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings",
        "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type",
    ):  # fmt: skip
        assert config[key] == getattr(hf, key), key
    # We spell float32 metadata the shortest way (1e-05), transformers keeps the float32 value.
    assert config["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert config["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert config["architectures"] == ["LlamaForCausalLM"]
