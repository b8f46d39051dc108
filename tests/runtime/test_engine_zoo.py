"""Tiny random models of the less Llama-like architectures through the whole engine (loader,
bucket compilation, scheduler, sampler): greedy completions equal HF's ``generate``.

This covers what the model-level harness does not: the builder sizing MLA's latent-only cache,
ahead-of-time compilation of MoE and segmented layer scans, and continuous batching over them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jax_llm_runtime.runtime.engine.request import SamplingParams
from tests.models.harness import TINY, save_random_model
from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = ["Hello there", "The quick brown fox jumps over", "1 2 3"]
NEW_TOKENS = 12


def _configs():
    import transformers

    base = {**TINY, "vocab_size": VOCAB_SIZE, "pad_token_id": 0, "bos_token_id": 256}
    # No EOS: random weights would stop at arbitrary points; both sides run the full budget.
    base["eos_token_id"] = None
    yield (
        "deepseek_v3",
        transformers.DeepseekV3Config(
            **{**base, "num_key_value_heads": 4},
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
        ),
    )
    yield (
        "gemma2",
        transformers.Gemma2Config(
            **base, head_dim=16, sliding_window=8, attn_logit_softcapping=5.0
        ),
    )


@pytest.mark.parametrize(
    ("name", "hf_config"), list(_configs()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_engine_greedy_matches_hf(tmp_path: Path, name: str, hf_config) -> None:
    import torch

    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    hf_model = save_random_model(hf_config, tmp_path)
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
    engine.start()
    try:
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]

        async def run_all() -> list[list[int]]:
            async def one(i: int, ids: list[int]) -> list[int]:
                out: list[int] = []
                sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
                async for delta in engine.generate(ids, sampling, f"{name}-{i}"):
                    out += delta.token_ids
                return out

            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))

        ours = asyncio.run(run_all())
    finally:
        engine.shutdown()
    hf_model.generation_config.eos_token_id = None
    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert got == ref
