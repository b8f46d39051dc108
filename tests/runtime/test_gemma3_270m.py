"""The engine on the real Gemma-3-270M GGUF (packaged alias ``gemma3-270m``, the base model: it
has no chat template) against HF transformers on the same file: greedy tokens of 8 text prompts
must agree exactly.

This is the one real checkpoint for Gemma 3's details together: offset RMSNorms, q/k norms,
scaled embeddings, the 5:1 sliding/global layer pattern with two rope bases, GeGLU, a 262k
vocabulary, and the GGUF loader's inversion of llama.cpp's norm offset.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jax_llm_runtime.runtime.engine.request import SamplingParams
from jax_llm_runtime.runtime.loading.sources import resolve_model_source

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "A haiku about the sea:",
    "A hash table is a data structure that",
    "The first five prime numbers are",
    "In Spanish, 'good morning' is",
    "The sky is blue because",
    "def fibonacci(n):",
    "12 times 12 equals",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    return resolve_model_source("gemma3-270m").path


@pytest.fixture(scope="module")
def engine(gemma3_gguf: Path):
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    engine = build_engine(
        EngineConfig(
            model_id=str(gemma3_gguf),
            max_num_seqs=8,
            max_model_len=256,
            dtype="float32",
            matmul_dtype="model",  # HF's float numbers, not the int8 activations of VNNI CPUs
            precompile="none",  # the shapes these requests run, when they first run
        )
    )
    engine.start()
    yield engine
    engine.shutdown()


async def _greedy_all(engine, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts at once, so they share decode steps as concurrent requests do."""

    async def one(i: int, ids: list[int]) -> list[int]:
        out: list[int] = []
        sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
        async for delta in engine.generate(ids, sampling, f"gemma-{i}"):
            out += delta.token_ids
        return out

    return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))


def test_greedy_tokens_match_hf(engine, gemma3_gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM

    assert engine.runner.config.sliding_layers.count(False) == 3  # 18 layers, every 6th global
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    ours = asyncio.run(_greedy_all(engine, prompts))
    model = AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32
    ).eval()
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=sorted(engine.tokenizer.eos_token_ids),
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert ours[i] == ref, f"prompt {i}: {PROMPTS[i]!r}"
