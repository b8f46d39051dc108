"""The mock engine the API tests rely on: deterministic output, limits, and abort bookkeeping."""

from __future__ import annotations

import pytest

from jax_llm_runtime.runtime.engine.mock import BOS_ID, EOS_ID, MockEngine, MockTokenizer
from jax_llm_runtime.runtime.engine.request import (
    ContextLengthError,
    FinishReason,
    GenerationDelta,
    SamplingParams,
)


async def run(engine: MockEngine, prompt: str, **sampling: object) -> list[GenerationDelta]:
    ids = engine.tokenizer.encode(prompt)
    return [d async for d in engine.generate(ids, SamplingParams(**sampling), "req")]  # type: ignore[arg-type]


@pytest.fixture
def engine() -> MockEngine:
    engine = MockEngine(token_delay_s=0)
    engine.start()
    return engine


def test_tokenizer_round_trips_utf8_and_specials() -> None:
    tok = MockTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == BOS_ID and len(ids) == 7
    assert tok.decode(ids) == "héllo"
    assert tok.decode([*ids, EOS_ID], skip_special_tokens=False) == "<s>héllo</s>"
    with pytest.raises(ValueError):
        tok.decode([999])


async def test_echoes_reversed_one_token_per_delta_then_eos(engine: MockEngine) -> None:
    deltas = await run(engine, "hé")
    assert [d.token_ids for d in deltas] == [(0xC3,), (0xA9,), (ord("h"),), (EOS_ID,)]
    # Reversed by character; "é" is two byte tokens and appears once both arrived.
    assert [d.text for d in deltas] == ["", "é", "h", ""]
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert [d.num_output_tokens for d in deltas] == [1, 2, 3, 4]
    assert {d.num_prompt_tokens for d in deltas} == {4}
    assert engine.aborted == []


async def test_max_tokens_stop_ids_and_ignore_eos(engine: MockEngine) -> None:
    short = await run(engine, "abc", max_tokens=2)
    assert "".join(d.text for d in short) == "cb"
    assert short[-1].finish_reason is FinishReason.LENGTH
    stopped = await run(engine, "abc", stop_token_ids=(ord("b"),))
    assert (
        "".join(d.text for d in stopped) == "c" and stopped[-1].finish_reason is FinishReason.STOP
    )
    repeated = await run(engine, "ab", ignore_eos=True, max_tokens=5)
    assert "".join(d.text for d in repeated) == "babab"


async def test_context_limit_is_the_engine_rule() -> None:
    """A budget the context cannot hold is refused as the engine refuses it; one that fills the
    context ends with "length"."""
    engine = MockEngine(max_model_len=6, token_delay_s=0, reply="xxxxxxxx")
    engine.start()
    with pytest.raises(ContextLengthError):
        await run(engine, "abc", max_tokens=3)  # 4 prompt tokens leave 2
    deltas = await run(engine, "abc", max_tokens=2)
    assert len(deltas) == 2 and deltas[-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("prompt_ids", [[], list(range(2048)), [1, 300]])
async def test_rejects_bad_prompts_before_yielding(
    engine: MockEngine, prompt_ids: list[int]
) -> None:
    with pytest.raises(ValueError):
        await anext(engine.generate(prompt_ids, SamplingParams(), "bad"))
    assert engine.requests == []


async def test_leaving_early_records_an_abort(engine: MockEngine) -> None:
    stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=10), "early")
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert engine.aborted == ["early"]
    assert engine.wait_for_aborts(1, timeout_s=0)


async def test_shutdown_aborts_running_streams(engine: MockEngine) -> None:
    stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=10), "running")
    await anext(stream)
    engine.shutdown()
    last = await anext(stream)
    assert last.finish_reason is FinishReason.ABORT
    assert not engine.healthy()
