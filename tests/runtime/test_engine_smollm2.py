"""The engine on the real SmolLM2-135M-Instruct GGUF against HF transformers on the same file.

Tolerance: float32 last-position logits agree within 1e-3 (observed ~1e-4: the two differ only in
summation order); greedy tokens must agree exactly.
"""

from __future__ import annotations

import asyncio
import time

import jax
import numpy as np
import pytest

from jax_llm_runtime.runtime.engine.request import FinishReason, SamplingParams
from tests.smollm2 import chat_ids

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a short tip for learning to code.",
    "What is 12 times 12?",
]
NEW_TOKENS = 32
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


@pytest.fixture(scope="module")
def hf(hf_smollm2):
    return hf_smollm2


async def collect(
    engine, ids: list[int], request_id: str, max_tokens: int = NEW_TOKENS, **sampling_fields
) -> list[int]:
    out: list[int] = []
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling_fields)
    async for delta in engine.generate(ids, sampling, request_id):
        out += delta.token_ids
    return out


def test_prompt_ids_match_hf_chat_template(engine, hf):
    _, tok, _ = hf
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        expected = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert chat_ids(engine, prompt) == list(expected)


def test_greedy_tokens_and_logits_match_hf(engine, hf):
    torch, _, model = hf
    for i, prompt in enumerate(PROMPTS):
        ids = chat_ids(engine, prompt)
        ours = asyncio.run(collect(engine, ids, f"seq-{i}"))
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),  # id 0 is not padding
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=sorted(engine.tokenizer.eos_token_ids),
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        assert ours == ref, f"prompt {i}: {prompt!r}"

        # Last-position logits of the prompt, through the same jitted forward the engine uses.
        with torch.no_grad():
            ref_logits = model(torch.tensor([ids])).logits[0, -1].numpy()
        ours_logits = prompt_logits(engine, ids)
        np.testing.assert_allclose(ours_logits, ref_logits, atol=LOGIT_ATOL, rtol=0)


def prompt_logits(engine, ids: list[int]) -> np.ndarray:
    """Logits at the last prompt token from a fresh cache with the engine's weights."""
    from jax_llm_runtime.models.batch import StepBatch
    from jax_llm_runtime.models.registry import get_model_spec
    from jax_llm_runtime.pallas_kernels.paged_attention import KVCache

    runner = engine.runner
    spec = get_model_spec("LlamaForCausalLM")
    n = len(ids)
    pages = -(-n // runner.plan.page_size)
    k_shape, v_shape = runner.config.cache_shapes(pages, runner.plan.page_size)
    cache = KVCache.zeros(k_shape, np.float32, v_shape)
    batch = StepBatch.padded(
        tokens=np.asarray([ids], np.int32),
        positions=np.arange(n, dtype=np.int32)[None],
        q_lens=np.asarray([n], np.int32),
        kv_lens=np.asarray([n], np.int32),
        page_indices=np.arange(pages, dtype=np.int32)[::-1].copy()[None],
    )
    logits, _ = jax.jit(spec.forward, static_argnums=0)(runner.config, runner.weights, cache, batch)
    return np.asarray(logits[0])


def test_concurrent_requests_give_the_same_tokens_as_one_at_a_time(engine):
    prompts = [chat_ids(engine, p) for p in PROMPTS]
    alone = [asyncio.run(collect(engine, ids, f"alone-{i}")) for i, ids in enumerate(prompts)]

    async def together():
        return await asyncio.gather(
            *(collect(engine, ids, f"together-{i}") for i, ids in enumerate(prompts))
        )

    assert asyncio.run(together()) == alone


def test_prompts_arriving_mid_stream_share_steps_and_give_the_same_tokens(engine):
    """Prompts submitted while others decode are prefilled in the running sequences' steps
    (decode rows and prefill chunks of several sequences in one step), and every request's
    greedy tokens are those it gets alone."""
    prompts = [chat_ids(engine, p) for p in PROMPTS[:5]]
    early = {"max_tokens": 256, "ignore_eos": True}  # still decoding when the others arrive
    alone = [asyncio.run(collect(engine, ids, f"solo-{i}")) for i, ids in enumerate(prompts)]
    alone[0] = asyncio.run(collect(engine, prompts[0], "solo-early", **early))
    steps: list[list[tuple[int, int]]] = []  # per step: (start, length) of each item
    schedule = engine.scheduler.schedule

    def recorded():
        batch = schedule()
        if batch is not None:
            steps.append([(item.start, item.length) for item in batch.items])
        return batch

    async def staggered():
        stream = engine.generate(prompts[0], SamplingParams(temperature=0.0, **early), "early-0")
        first = await anext(stream)  # its prompt is in: the others arrive while it decodes
        rest = [collect(engine, ids, f"late-{i}") for i, ids in enumerate(prompts[1:], 1)]
        late = asyncio.ensure_future(asyncio.gather(*rest))
        out = list(first.token_ids)
        async for delta in stream:
            out += delta.token_ids
        return [out, *await late]

    engine.scheduler.schedule = recorded
    try:
        together = asyncio.run(staggered())
    finally:
        engine.scheduler.schedule = schedule
    assert together == alone
    mixed = [s for s in steps if any(n == 1 for _, n in s) and sum(n > 1 for _, n in s) >= 2]
    assert mixed, f"no step decoded while it prefilled two prompts: {steps}"


def test_serving_varied_lengths_compiles_nothing_after_warmup(engine):
    # The background compile of the remaining shapes ends first: it is warm-up, not serving.
    assert engine.compile_done.wait(timeout=900)
    compiles: list[str] = []

    def listener(event: str, duration: float, **_: object) -> None:
        if "compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        rng = np.random.default_rng(0)

        async def traffic():
            jobs = []
            for i in range(12):
                n = int(rng.integers(1, 400))
                ids = rng.integers(3, 40000, n).tolist()
                jobs.append(collect(engine, ids, f"mix-{i}", max_tokens=int(rng.integers(1, 40))))
            return await asyncio.gather(*jobs)

        outputs = asyncio.run(traffic())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert all(outputs)
    assert compiles == [], f"serving compiled: {compiles}"


def test_finish_reasons_and_page_release(engine):
    ids = chat_ids(engine, PROMPTS[0])

    async def run():
        reasons = []
        async for d in engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=3), "len"):
            reasons.append(d.finish_reason)
        return reasons

    assert asyncio.run(run())[-1] is FinishReason.LENGTH
    sched = engine.scheduler
    assert sched.allocator.num_free == sched.allocator.num_pages


def test_stop_strings_end_the_sequence_in_the_engine(engine):
    """The engine's stream hands out finished text: it ends before a stop string, with finish
    reason "stop", the logprobs of the tokens that text came from, and the sequence's pages freed."""
    ids = chat_ids(engine, PROMPTS[0])

    async def run(sampling: SamplingParams, request_id: str):
        deltas = [d async for d in engine.generate(ids, sampling, request_id)]
        return "".join(d.text for d in deltas), deltas

    full, _ = asyncio.run(run(SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), "full"))
    cut = len(full) // 2
    stop = full[cut : cut + 4]
    assert len(stop) == 4 and stop.strip(), full
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=(stop,), logprobs=0)
    text, deltas = asyncio.run(run(sampling, "stopped"))
    assert text == full[: full.find(stop)]
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert all(d.finish_reason is None for d in deltas[:-1])
    kept = [entry.token_id for d in deltas for entry in d.logprobs]
    decode = engine.tokenizer.decode
    assert decode(kept).startswith(text) and len(decode(kept[:-1])) < len(text)
    sched = engine.scheduler
    for _ in range(200):  # the abort reaches the loop thread between steps
        if sched.allocator.num_free == sched.allocator.num_pages:
            break
        time.sleep(0.01)
    assert sched.allocator.num_free == sched.allocator.num_pages


def test_a_stream_whose_event_loop_closed_is_aborted_and_the_engine_serves_on(engine):
    """A caller that reads one delta and lets its event loop end without closing the stream (a
    script calling asyncio.run per request) must not stop the engine's loop thread."""
    ids = chat_ids(engine, PROMPTS[1])

    async def first_delta():
        stream = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=24), "left")
        return await anext(stream)

    assert asyncio.run(first_delta()).finish_reason is None
    sched = engine.scheduler
    for _ in range(500):
        if sched.allocator.num_free == sched.allocator.num_pages:
            break
        time.sleep(0.01)
    assert engine.healthy() and sched.allocator.num_free == sched.allocator.num_pages
    assert len(asyncio.run(collect(engine, ids, "after", max_tokens=4))) == 4


async def collect_n(engine, ids: list[int], sampling: SamplingParams, n: int) -> list[list[int]]:
    async def one(stream) -> list[int]:
        out: list[int] = []
        async for delta in stream:
            out += delta.token_ids
        return out

    return await asyncio.gather(*(one(s) for s in engine.generate_n(ids, sampling, "n", n)))


def test_n_greedy_samples_equal_the_single_answer_and_free_every_page(engine):
    ids = chat_ids(engine, PROMPTS[1])
    single = asyncio.run(collect(engine, ids, "single"))
    outs = asyncio.run(collect_n(engine, ids, SamplingParams(temperature=0.0, max_tokens=32), 3))
    assert outs == [single] * 3
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_pages


def test_n_sampled_completions_differ(engine):
    ids = chat_ids(engine, PROMPTS[6])
    outs = asyncio.run(collect_n(engine, ids, SamplingParams(temperature=1.0, max_tokens=24), 4))
    assert len({tuple(o) for o in outs}) > 1, "each fork draws from its own seed"
