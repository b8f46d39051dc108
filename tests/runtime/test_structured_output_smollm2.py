"""Constrained decoding on the real SmolLM2-135M-Instruct engine: sampled output follows its JSON
schema for every seed, and a constrained sequence changes nothing for the ones batched with it."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from jax_llm_runtime.runtime.engine.grammar import json_schema_grammar, lark_grammar
from jax_llm_runtime.runtime.engine.request import FinishReason, SamplingParams
from tests.smollm2 import chat_ids

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Lima", "Oslo", "Cairo"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


async def run(engine, ids, sampling, request_id):
    tokens, reason = [], None
    async for delta in engine.generate(ids, sampling, request_id):
        tokens += delta.token_ids
        reason = delta.finish_reason
    return tokens, reason


def test_sampled_json_follows_the_schema_for_20_seeds(engine):
    ids = chat_ids(engine, "Describe a person as JSON with their name, age, city and pets.")
    grammar = json_schema_grammar(SCHEMA)

    async def all_seeds():
        return await asyncio.gather(
            *(
                run(
                    engine,
                    ids,
                    SamplingParams(temperature=1.0, seed=seed, max_tokens=120, grammar=grammar),
                    f"json-{seed}",
                )
                for seed in range(20)
            )
        )

    outputs = asyncio.run(all_seeds())
    documents = set()
    for tokens, reason in outputs:
        assert reason is FinishReason.STOP, "the grammar completes before max_tokens"
        text = engine.tokenizer.decode(tokens)
        document = json.loads(text)
        jsonschema.validate(document, SCHEMA)
        documents.add(text)
    assert len(documents) > 1, "different seeds sample different documents"
    sched = engine.scheduler
    assert sched.allocator.num_free == sched.allocator.num_pages


def test_a_constrained_sequence_leaves_its_batch_unchanged(engine):
    free_ids = chat_ids(engine, "What is the capital of France?")
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = asyncio.run(run(engine, free_ids, greedy, "alone"))
    choice = lark_grammar('start: "yes" | "no"')

    async def together():
        return await asyncio.gather(
            run(engine, free_ids, greedy, "free"),
            run(
                engine,
                chat_ids(engine, "Is Paris in France? Answer yes or no."),
                SamplingParams(temperature=0.0, max_tokens=8, grammar=choice),
                "constrained",
            ),
        )

    free, constrained = asyncio.run(together())
    assert free == alone
    assert engine.tokenizer.decode(constrained[0]) in ("yes", "no")
    assert constrained[1] is FinishReason.STOP
