"""Every GGUF architecture end to end: tiny HF model -> GGUF (written the way llama.cpp's
converter lays it out) -> our loader and model -> the harness's checks against the HF model
(last-position logits of ragged prompts, and 16 greedy tokens through the paged cache).

``tests/runtime/test_gguf_archs.py`` proves the loader returns HF's exact tensors and config;
this proves our models run those files the way HF runs the originals.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jax_llm_runtime.runtime.loading.gguf.loader import load_gguf_checkpoint
from tests.models.gguf_writer import write_gguf
from tests.models.harness import check_model, load_checkpoint
from tests.runtime.test_gguf_archs import CASES, _random_model

# The 46-layer case only checks a metadata rule; the other Gemma 2 case covers the model.
MODEL_CASES = [case for case in CASES if case != "gemma2_27b_scaling"]


@pytest.mark.parametrize("case", MODEL_CASES)
def test_gguf_model_matches_hf(case: str, tmp_path: Path) -> None:
    hf_model = _random_model(CASES[case]())
    files = write_gguf(hf_model, hf_model.config, tmp_path / "model.gguf")
    check_model(load_checkpoint(load_gguf_checkpoint(files[0])), hf_model)


def test_quantized_gguf_runs_like_its_dequantized_weights(tmp_path: Path) -> None:
    """A Q8_0 file: our model on it equals HF on the dequantized tensors (same numbers)."""
    import torch

    hf_model = _random_model(CASES["qwen3"]())
    files = write_gguf(hf_model, hf_model.config, tmp_path / "model.gguf", qtype="q8_0")
    checkpoint = load_gguf_checkpoint(files[0])
    state = {name: torch.from_numpy(array) for name, array in checkpoint.tensors()}
    hf_model.load_state_dict(state, strict=False)
    check_model(load_checkpoint(checkpoint), hf_model)
