"""Per-request sampling fields on the real SmolLM2-135M-Instruct GGUF.

Each request's output must not depend on what else is in the batch, for greedy and seeded
sampling alike; logprobs follow HF transformers' log-softmax of the same (penalized) logits.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from jax_llm_runtime.runtime.engine.request import FinishReason, SamplingParams
from tests.smollm2 import chat_ids

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Give me a short tip for learning to code.",
]
VARIANTS = [
    SamplingParams(temperature=0.0, max_tokens=24, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(
        temperature=0.8, max_tokens=24, seed=1, repetition_penalty=1.3, repeat_last_n=16
    ),
    SamplingParams(temperature=1.0, max_tokens=24, seed=2, min_p=0.1, logit_bias=((30, 5.0),)),
    SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20, logprobs=5),
    SamplingParams(temperature=0.7, max_tokens=24, seed=3, top_k=20, logprobs=3),
]


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


async def run(engine, ids, sampling, request_id):
    tokens, logprobs, reason = [], [], None
    async for delta in engine.generate(ids, sampling, request_id):
        tokens += delta.token_ids
        logprobs += delta.logprobs
        reason = delta.finish_reason
    return tokens, logprobs, reason


def run_all(engine, jobs):
    """Run (prompt ids, sampling) jobs concurrently; returns their (tokens, logprobs, reason)."""

    async def main():
        return await asyncio.gather(
            *(run(engine, ids, sp, f"r{i}") for i, (ids, sp) in enumerate(jobs))
        )

    return asyncio.run(main())


@pytest.fixture(scope="module", params=["float32", "auto"])
def int8_engine(smollm2_gguf, request):
    """The same model with int8 activations (``--matmul-dtype int8``), with a float32 KV cache
    and the default one (float16 under int8 activations)."""
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    engine = build_engine(
        EngineConfig(
            model_id=str(smollm2_gguf),
            max_num_seqs=8,
            max_model_len=512,
            dtype="float32",
            matmul_dtype="int8",
            kv_cache_dtype=request.param,
        )
    )
    engine.start()
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_output_is_the_same_alone_and_in_a_mixed_batch(engine, variant):
    check_batch_invariance(engine, variant)


@pytest.mark.parametrize("variant", [0, 1])
def test_int8_activations_are_batch_invariant_too(int8_engine, variant):
    """A lone decoding row is rounded to int8 like a batch's rows, so its tokens and logprobs
    do not depend on whether it decodes alone (greedy, and seeded sampling); the integer dots
    are exact per row, so a 16-bit cache's rounding keeps that too."""
    check_batch_invariance(int8_engine, variant)


def test_the_default_kv_cache_under_int8_activations_is_float16(int8_engine, request):
    import jax.numpy as jnp

    requested = request.node.callspec.params["int8_engine"]
    expected = jnp.float16 if requested == "auto" else jnp.float32
    assert int8_engine.runner.cache.dtype == jnp.dtype(expected)


def test_int8_greedy_tokens_are_the_same_alone_and_together(int8_engine):
    """Greedy decoding into a low-margin loop (the France prompt repeats itself within 32 int8
    tokens), where a last-bit difference in any float op before the rounding to int8 shows up
    as a different token: it did with XLA's own mean in the norms (``models.layers.norms``)."""
    prompts = [chat_ids(int8_engine, p) for p in ["What is the capital of France?", *PROMPTS]]
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    alone = [run_all(int8_engine, [(ids, greedy)])[0][0] for ids in prompts]
    together = [out[0] for out in run_all(int8_engine, [(ids, greedy) for ids in prompts])]
    assert together == alone


def check_batch_invariance(engine, variant):
    ids = chat_ids(engine, PROMPTS[variant % len(PROMPTS)])
    [alone] = run_all(engine, [(ids, VARIANTS[variant])])
    others = [v for i, v in enumerate(VARIANTS) if i != variant][:3]
    jobs = [(ids, VARIANTS[variant])] + [
        (chat_ids(engine, p), v) for p, v in zip(PROMPTS, others, strict=False)
    ]
    batched = run_all(engine, jobs)[0]
    assert alone[0] == batched[0]
    for a, b in zip(alone[1], batched[1], strict=True):
        assert a.token_id == b.token_id
        np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-4)


def test_same_seed_same_text_different_seeds_differ(engine):
    ids = chat_ids(engine, PROMPTS[0])
    sp = SamplingParams(temperature=1.0, max_tokens=24, seed=1234)
    a, b, c = run_all(engine, [(ids, sp), (ids, sp), (ids, dataclasses.replace(sp, seed=99))])
    assert a[0] == b[0]
    assert a[0] != c[0]


def test_logit_bias_minus_100_bans_a_token(engine):
    ids = chat_ids(engine, PROMPTS[1])
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    [(tokens, _, _)] = run_all(engine, [(ids, sp)])
    banned = tokens[0]
    biased = dataclasses.replace(sp, logit_bias=((banned, -100.0),))
    [(out, _, _)] = run_all(engine, [(ids, biased)])
    assert banned not in out


def test_min_tokens_suppresses_eos(engine):
    ids = chat_ids(engine, "What is 12 times 12?")
    sp = SamplingParams(temperature=0.0, max_tokens=128)
    [(tokens, _, reason)] = run_all(engine, [(ids, sp)])
    assert reason is FinishReason.STOP and len(tokens) < 100
    longer = dataclasses.replace(sp, min_tokens=len(tokens) + 10)
    [(out, _, _)] = run_all(engine, [(ids, longer)])
    assert len(out) >= len(tokens) + 10
    eos = engine.tokenizer.eos_token_ids
    assert not any(t in eos for t in out[: len(tokens) + 10])


def test_logprobs_match_hf_log_softmax_of_penalized_logits(engine, hf_smollm2):
    torch, _, model = hf_smollm2
    ids = chat_ids(engine, PROMPTS[2])
    penalty = 1.5
    sp = SamplingParams(temperature=0.0, max_tokens=1, repetition_penalty=penalty, logprobs=20)
    [(tokens, [entry], _)] = run_all(engine, [(ids, sp)])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
    seen = np.unique(ids)
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
    ref = logits - logits.max()
    ref -= np.log(np.exp(ref).sum())
    assert tokens[0] == entry.token_id == int(np.argmax(ref))
    np.testing.assert_allclose(entry.logprob, ref[entry.token_id], atol=1e-3)
    top_ids = [t for t, _ in entry.top]
    np.testing.assert_allclose([lp for _, lp in entry.top], ref[top_ids], atol=1e-3)
    assert top_ids[:5] == list(np.argsort(-ref)[:5])
