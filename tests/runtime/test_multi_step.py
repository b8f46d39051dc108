"""Multi-step decode through the whole engine on a tiny random Llama: several tokens per call,
fed back on device, give exactly what single steps give (greedy: HF's ``generate``; sampled:
the same per-token seeded draws)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jax_llm_runtime.runtime.engine.request import SamplingParams
from tests.models.harness import save_tiny_byte_llama

pytestmark = pytest.mark.slow

PROMPTS = ["Hello there", "The quick brown fox jumps over", "1 2 3"]
NEW_TOKENS = 14  # not a multiple of the 4 steps per call: the last call overshoots


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, save_tiny_byte_llama(folder)


def _run(folder: Path, decode_steps: int, sampling: SamplingParams) -> tuple[list, int]:
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading import builder
    from jax_llm_runtime.runtime.loading.builder import build_engine

    engine = build_engine(
        EngineConfig(
            model_id=str(folder),
            max_num_seqs=4,
            max_model_len=64,
            dtype="float32",
            decode_steps=decode_steps,
        )
    )
    engine.start(compile_all=True)
    if decode_steps == 0:  # auto on CPU: four steps per call while at most four sequences decode
        assert engine.scheduler.decode_steps == builder.CPU_DECODE_STEPS
        assert engine.scheduler.multi_step_seqs == builder.CPU_MULTI_STEP_SEQS
        assert engine.runner.multi_step_seqs == builder.CPU_MULTI_STEP_SEQS
        # On CPU each kernel runs natively or in XLA per call class, as calibration measured.
        assert engine.kernel_choices == dict.fromkeys(
            ("attention", "dequant_matmul"), "native-or-xla"
        )
    try:
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]

        async def one(i: int, ids: list[int]) -> list[int]:
            out: list[int] = []
            async for delta in engine.generate(ids, sampling, f"r{i}"):
                out += delta.token_ids
            return out

        async def run_all() -> list[list[int]]:
            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))

        return [prompts, asyncio.run(run_all())], engine.num_steps
    finally:
        engine.shutdown()


def test_greedy_multi_step_matches_hf(model_dir) -> None:
    import torch

    folder, hf_model = model_dir
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # decode_steps 0: the CPU default, four steps per call.
    (prompts, ours), calls = _run(folder, 0, greedy)
    # Three prefills, then about NEW_TOKENS / 4 calls for all three sequences at once.
    assert calls < len(PROMPTS) + NEW_TOKENS // 2
    hf_model.generation_config.eos_token_id = None
    for ids, got in zip(prompts, ours, strict=True):
        assert len(got) == NEW_TOKENS
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert got == ref


def test_seeded_sampling_is_the_same_in_one_or_many_steps(model_dir) -> None:
    folder, _ = model_dir
    sampled = SamplingParams(
        temperature=0.9, top_p=0.95, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True
    )
    (_, single), _ = _run(folder, 1, sampled)
    (_, multi), _ = _run(folder, 4, sampled)
    assert multi == single


def test_a_chunk_holding_pages_past_its_step_fits_the_steps_page_bucket(model_dir) -> None:
    # A prompt chunk cut shorter than its allocation (to fill a token bucket, or to stay within
    # the step's budget) keeps pages the step does not reach; the step's page table is the
    # bucket of the positions it reaches, which those pages need not fit.
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.engine.scheduler import ScheduledBatch, ScheduledSeq, StepKind
    from jax_llm_runtime.runtime.engine.sequence import Sequence
    from jax_llm_runtime.runtime.loading.builder import build_engine

    folder, _ = model_dir
    engine = build_engine(
        EngineConfig(model_id=str(folder), max_num_seqs=4, max_model_len=1024, dtype="float32")
    )
    seq = Sequence("r", list(range(1, 301)), SamplingParams(max_tokens=4), seed=0, arrival=0)
    seq.pages = list(range(40, 21, -1))  # 19 pages of 16 allocated; the step runs 16 tokens
    batch = ScheduledBatch(StepKind.PREFILL, (ScheduledSeq(seq, 0, 16),))
    step_batch, _ = engine.runner._prepare(batch)
    width = step_batch.page_indices.shape[1]
    assert width == engine.runner.plan.pages[0] < len(seq.pages)
    assert step_batch.page_indices[0].tolist() == seq.pages[:width]
    assert int(step_batch.kv_lens[0]) == 16
