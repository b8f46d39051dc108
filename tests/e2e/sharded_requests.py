"""The requests a sharded server must answer as one device does: greedy chats side by side (they
share decode steps), greedy logprobs, a seeded sample, ``n = 2``, a ``json_schema`` response,
a streamed chat and a completion. Every one must succeed; the deterministic answers come back
for comparison with one device's."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai

PROMPTS = ["Hello there", "What is two plus two?", "Tell me a story about the sea"]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


def exercise(url: str, model: str, max_tokens: int = 12) -> dict:
    """Send every kind of request; return the greedy answers (text, rounded logprobs, the JSON
    reply, the completion). Raises on any error status."""
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    chat = client.chat.completions.create

    def greedy(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        reply = chat(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(greedy, PROMPTS))

    messages = [{"role": "user", "content": PROMPTS[0]}]
    scored = chat(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = [round(t.logprob, 2) for t in scored.choices[0].logprobs.content]
    assert all(len(t.top_logprobs) == 2 for t in scored.choices[0].logprobs.content)

    def seeded() -> str:
        reply = chat(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.9, seed=11
        )
        return reply.choices[0].message.content

    first = seeded()
    assert seeded() == first, "the same seed drew other tokens"

    pair = chat(model=model, messages=messages, max_tokens=max_tokens, temperature=0.8, n=2)
    assert sorted(c.index for c in pair.choices) == [0, 1]

    structured = chat(
        model=model,
        messages=[{"role": "user", "content": "The weather in Paris, as JSON."}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
    ).choices[0]
    if structured.finish_reason == "stop":
        reply = json.loads(structured.message.content)
        assert set(reply) == {"city", "sunny"} and isinstance(reply["sunny"], bool)

    stream = chat(model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == texts[0], "the stream differs from the same greedy request"

    completion = client.completions.create(
        model=model, prompt="Count: one two", max_tokens=max_tokens, temperature=0
    )
    return {
        "texts": texts,
        "logprobs": logprobs,
        "json": structured.message.content,
        "completion": completion.choices[0].text,
    }
