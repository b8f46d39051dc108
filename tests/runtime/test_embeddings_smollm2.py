"""Embeddings on the real SmolLM2-135M-Instruct GGUF against HF transformers' final hidden states.

HF's ``last_hidden_state`` is after the final norm, like ours; mean pooling averages it over the
input's tokens, last pooling takes the last token's. Float32 on both sides; the two differ only in
summation order, so they agree within 1e-4.
"""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest

from jax_llm_runtime.runtime.engine.request import SamplingParams

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors; " * 12,  # crosses the 16- and 64-token buckets
]
RTOL = 1e-5
ATOL = 1e-4


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    torch, _, model = hf_smollm2
    return torch, model


def _hf_hidden(hf_model, ids: list[int]) -> np.ndarray:  # [len(ids), hidden]
    torch, model = hf_model
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].numpy()


@pytest.mark.parametrize("text", TEXTS)
def test_pooled_embeddings_match_hf(engine, hf_model, text: str) -> None:
    ids = engine.tokenizer.encode(text)
    hidden = _hf_hidden(hf_model, ids)
    mean, last = asyncio.run(_embed_both(engine, ids))
    # The last hidden state holds outliers near 35, where float32 sums in another order (XLA's
    # per CPU, torch's) differ by 1e-4 absolute: a relative bound as well, far below a wrong op.
    np.testing.assert_allclose(mean, hidden.mean(axis=0), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(last, hidden[-1], atol=ATOL, rtol=RTOL)
    assert mean.dtype == np.float32


async def _embed_both(engine, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    (mean,) = await engine.embed([ids], "mean")
    (last,) = await engine.embed([ids], "last")
    return mean, last


def test_embedding_between_steps_leaves_generation_unchanged_and_compiles_nothing(engine) -> None:
    prompt = engine.tokenizer.encode("Tell me about the moon.")
    sampling = SamplingParams(temperature=0.0, max_tokens=24)

    async def generate() -> list[int]:
        out: list[int] = []
        async for delta in engine.generate(prompt, sampling, f"r{len(prompt)}-{id(out)}"):
            out += delta.token_ids
        return out

    async def both() -> tuple[list[int], list[np.ndarray]]:
        tokens_task = asyncio.ensure_future(generate())
        vectors = [(await engine.embed([list(range(1, n))], "mean"))[0] for n in (5, 40, 300, 512)]
        return await tokens_task, vectors

    # Warm-up ends when the step shapes compiled in the background after start are done.
    assert engine.compile_done.wait(timeout=600)
    alone = asyncio.run(generate())
    compiles: list[str] = []

    def listener(event: str, duration: float, **_: object) -> None:
        if "compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        together, vectors = asyncio.run(both())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert together == alone
    assert all(np.isfinite(v).all() for v in vectors)
    assert compiles == [], f"embedding compiled after warmup: {compiles}"


def test_bad_inputs_raise_value_error(engine) -> None:
    for inputs in ([[]], [[1] * 513]):
        with pytest.raises(ValueError):
            asyncio.run(engine.embed(inputs, "mean"))


def test_prompt_logprobs_match_hf_log_softmax(engine, hf_model):
    torch, model = hf_model
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    scored = asyncio.run(engine.prompt_logprobs(ids, 5))
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
    assert scored[0] is None
    for i in range(1, len(ids)):
        entry = scored[i]
        assert entry.token_id == ids[i]
        np.testing.assert_allclose(entry.logprob, ref[i - 1, ids[i]], atol=1e-3)
        assert [t for t, _ in entry.top] == list(np.argsort(-ref[i - 1])[:5])
