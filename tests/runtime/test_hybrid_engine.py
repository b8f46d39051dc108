"""A tiny random Qwen3.5 through the whole engine (builder, compiled buckets, multi-step
decode, continuous batching): greedy completions equal HF's, the prefix cache is off, and the
state slots are reported and all free at the end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jax_llm_runtime.runtime.engine.request import SamplingParams
from tests.models.harness import save_random_model
from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = ["Hello there", "The quick brown fox jumps over", "1 2 3"]
NEW_TOKENS = 10


def test_engine_greedy_matches_hf(tmp_path: Path) -> None:
    import torch
    import transformers

    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine
    from tests.models.test_qwen3_next import HYBRID, LAYER_TYPES

    fields = {**HYBRID, "vocab_size": VOCAB_SIZE, "bos_token_id": 256, "eos_token_id": None}
    hf = transformers.Qwen3_5TextConfig(**fields, layer_types=LAYER_TYPES)
    hf_model = save_random_model(hf, tmp_path)
    save_byte_tokenizer(tmp_path)
    engine = build_engine(
        EngineConfig(
            model_id=str(tmp_path),
            max_num_seqs=4,
            max_model_len=64,
            dtype="float32",
            precompile="none",
        )
    )
    assert not engine.scheduler.prefix_cache
    engine.start()
    try:
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]

        async def one(i: int, ids: list[int], n: int = 1) -> list[list[int]]:
            sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
            streams = engine.generate_n(ids, sampling, f"req-{i}", n)
            outs: list[list[int]] = []
            for stream in streams:
                out: list[int] = []
                async for delta in stream:
                    out += delta.token_ids
                outs.append(out)
            return outs

        async def run_all() -> list[list[list[int]]]:
            jobs = [one(i, ids) for i, ids in enumerate(prompts)]
            return await asyncio.gather(*jobs, one(9, prompts[1], n=2))

        *ours, pair = asyncio.run(run_all())
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.num_state_slots_total == 4 and stats.num_state_slots_used == 0
    hf_model.generation_config.eos_token_id = None
    expected = []
    for ids in prompts:
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        expected.append(ref[0, len(ids) :].tolist())
    assert [o[0] for o in ours] == expected
    assert pair == [expected[1], expected[1]]
