"""Think markers: the incremental parser on randomly split text, and the chat route's wiring."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from litestar.testing import TestClient

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.generation.reasoning import Gemma4ReasoningParser, ReasoningParser
from jax_llm_runtime.runtime.engine.mock import MockEngine
from jax_llm_runtime.runtime.text.tokenizer import GEMMA4_MARKERS, detect_reasoning_markers
from tests.api.conftest import assert_error, sse_chunks

START, END = "<think>", "</think>"

CASES = [
    # (reply, in_reasoning, reasoning, content)
    ("<think>Let me see.</think>The answer is 4.", False, "Let me see.", "The answer is 4."),
    ("\n <think>a<b</thin</think>\n\nok", False, "a<b</thin", "\n\nok"),
    ("Just content with <think> inside.", False, "", "Just content with <think> inside."),
    ("<thinking is not a marker", False, "", "<thinking is not a marker"),
    ("<think>cut off in the reasoning </thi", False, "cut off in the reasoning </thi", ""),
    ("opened by the prompt</think>done", True, "opened by the prompt", "done"),
    ("<think></think>", False, "", ""),
    ("  ", False, "", "  "),
    ("<think>x</think>later <think>y</think>", False, "x", "later <think>y</think>"),
]


def _run(pieces: list[str], in_reasoning: bool) -> tuple[str, str, list[tuple[str, str]]]:
    parser = ReasoningParser(START, END, in_reasoning)
    outs = [parser.feed(p, 1) for p in pieces] + [parser.flush()]
    pairs = [(o.reasoning, o.content) for o in outs]
    return "".join(r for r, _ in pairs), "".join(c for _, c in pairs), pairs


def _random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if text else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize(("reply", "in_reasoning", "reasoning", "content"), CASES)
def test_parser_splits_reply_at_any_split_points(
    reply: str, in_reasoning: bool, reasoning: str, content: str
) -> None:
    rng = random.Random(reply)
    splits = [[reply], list(reply)] + [_random_split(reply, rng) for _ in range(50)]
    for pieces in splits:
        got_reasoning, got_content, pairs = _run(pieces, in_reasoning)
        assert (got_reasoning, got_content) == (reasoning, content), pieces
        for r, c in pairs:  # no piece ever shows part of a marker that the text does not hold
            for marker in (START, END):
                for n in range(2, len(marker) + 1):
                    if marker[:n] not in reasoning + content:
                        assert marker[:n] not in r and marker[:n] not in c, (pieces, r, c)


def test_parser_counts_reasoning_tokens_not_marker_tokens() -> None:
    parser = ReasoningParser(START, END)
    for piece in ["<think>", "a", "b", "</think>", "c"]:
        parser.feed(piece, 1)
    parser.flush()
    assert parser.reasoning_tokens == 2
    parser = ReasoningParser(START, END)
    for ch in "<think>ab</think>c":  # byte-level: the markers' own tokens are not counted
        parser.feed(ch, 1)
    assert parser.reasoning_tokens == 2


def test_markers_are_detected_from_the_vocabulary_or_the_template() -> None:
    assert detect_reasoning_markers({"<think>": 5, "</think>": 6}, None) == (START, END)
    assert detect_reasoning_markers({}, "{{ '</think>' }}") == (START, END)
    assert detect_reasoning_markers({"<think>": 5}, "{{ messages }}") is None


# Gemma 4: <|channel>thought ... <channel|>, as the model writes it with and without thinking.
GEMMA4_CASES = [
    # (reply, in_reasoning, reasoning, content)
    (
        "<|channel>thought\nThe user wants 2+2.\nThat is 4.<channel|>It is 4.",
        False,
        "The user wants 2+2.\nThat is 4.",
        "It is 4.",
    ),
    (
        "<|channel>thought\nNeed the forecast.<channel|>"
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
        False,
        "Need the forecast.",
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
    ),
    ("<|channel>thought<channel|>It is 4.", False, "", "It is 4."),
    ("\n <|channel>thought\nhm<channel|>\nok", False, "hm", "\nok"),
    ("It is 4.<|channel>thought\n<channel|>", False, "", "It is 4."),  # a trailing empty one
    ("It is 4.<channel|>", False, "", "It is 4."),  # a stray end
    ("<|channel><|channel>thought\n<channel|>It is 4.", False, "", "It is 4."),
    ("<|channel>final answer", False, "", "final answer"),  # not the thought channel
    ("<|channel>thought\ncut off <chan", False, "cut off <chan", ""),
    ("<|channel>thou", False, "", ""),
    ("weighing it<channel|>4", True, "weighing it", "4"),
    (
        "Plain, with < and | and channel|> in it.",
        False,
        "",
        "Plain, with < and | and channel|> in it.",
    ),
    ("  ", False, "", "  "),
]


@pytest.mark.parametrize(("reply", "in_reasoning", "reasoning", "content"), GEMMA4_CASES)
def test_gemma4_channel_splits_at_any_split_points(
    reply: str, in_reasoning: bool, reasoning: str, content: str
) -> None:
    rng = random.Random(reply)
    for pieces in [[reply], list(reply)] + [_random_split(reply, rng) for _ in range(50)]:
        parser = Gemma4ReasoningParser(in_reasoning)
        outs = [parser.feed(p, 1) for p in pieces] + [parser.flush()]
        got = "".join(o.reasoning for o in outs), "".join(o.content for o in outs)
        assert got == (reasoning, content), pieces
        for out in outs:  # no piece shows part of a channel marker the split text does not hold
            for marker in ("<|channel>", "<channel|>"):
                for n in range(2, len(marker) + 1):
                    if marker[:n] not in reasoning + content:
                        assert marker[:n] not in out.reasoning + out.content, (pieces, out)


def test_gemma4_counts_reasoning_tokens_not_the_label() -> None:
    parser = Gemma4ReasoningParser()
    for token in ["<|channel>", "thought", "\n", "a", "b", "<channel|>", "c"]:
        parser.feed(token, 1)
    parser.flush()
    assert parser.reasoning_tokens == 2


def test_gemma4_markers_are_detected_from_the_vocabulary_or_the_template() -> None:
    vocab = {"<|channel>": 100, "<channel|>": 101, "<|tool_call>": 48}
    assert detect_reasoning_markers(vocab, None) == GEMMA4_MARKERS
    template = "{%- for part in text.split('<channel|>') -%}{{ part }}{%- endfor -%}"
    assert detect_reasoning_markers({}, template) == GEMMA4_MARKERS
    assert detect_reasoning_markers({"<|channel>": 100}, None) is None


def test_parser_rejects_empty_markers() -> None:
    with pytest.raises(ValueError):
        ReasoningParser("", END)


# ------------------------------------------------------------------------------- the chat route

REPLY = "<think>two plus two</think>It is 4."


@pytest.fixture
def thinking_engine() -> MockEngine:
    engine = MockEngine(model_name="mock-model", max_model_len=256, reply=REPLY)
    engine.tokenizer.reasoning_markers = (START, END)
    return engine


@pytest.fixture
def thinking_client(thinking_engine: MockEngine) -> Any:
    with TestClient(create_app(thinking_engine)) as test_client:
        yield test_client


def _chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "2+2?"}], **extra}


def test_chat_response_has_reasoning_content_and_reasoning_tokens(thinking_client: Any) -> None:
    response = thinking_client.post("/v1/chat/completions", json=_chat())
    assert response.status_code == 200, response.text
    body = response.json()
    message = body["choices"][0]["message"]
    assert message["content"] == "It is 4."
    assert message["reasoning_content"] == message["reasoning"] == "two plus two"
    usage = body["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == len("two plus two")
    assert usage["completion_tokens"] == len(REPLY.encode()) + 1  # and EOS


def test_chat_stream_sends_reasoning_deltas_separately(thinking_client: Any) -> None:
    body = _chat(stream=True, stream_options={"include_usage": True})
    response = thinking_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    chunks = sse_chunks(response.text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning", "") for d in deltas) == "two plus two"
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    for d in deltas:
        assert "<" not in (d.get("content") or "") + d.get("reasoning_content", "")
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12


def test_model_without_markers_keeps_everything_in_content(engine: MockEngine) -> None:
    engine.reply = REPLY
    with TestClient(create_app(engine)) as client:
        message = client.post("/v1/chat/completions", json=_chat()).json()["choices"][0]["message"]
    assert message["content"] == REPLY
    assert "reasoning_content" not in message and "reasoning" not in message


def test_prompt_that_opens_the_think_block_starts_in_reasoning(
    thinking_engine: MockEngine, thinking_client: Any
) -> None:
    thinking_engine.reply = "pondering</think>answer"
    original = thinking_engine.tokenizer.apply_chat_template

    def opening_template(messages: Any, add_generation_prompt: bool = True, **kw: Any) -> str:
        return original(messages, add_generation_prompt, **kw) + "<think>\n"

    thinking_engine.tokenizer.apply_chat_template = opening_template  # type: ignore[method-assign]
    message = thinking_client.post("/v1/chat/completions", json=_chat()).json()["choices"][0][
        "message"
    ]
    assert (message["reasoning_content"], message["content"]) == ("pondering", "answer")


@pytest.mark.parametrize(
    "fields",
    [
        {"enable_thinking": False},
        {"thinking": False},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": False}},
    ],
)
def test_thinking_switches_reach_the_template(
    thinking_engine: MockEngine, thinking_client: Any, fields: dict[str, Any]
) -> None:
    response = thinking_client.post("/v1/chat/completions", json=_chat(**fields))
    assert response.status_code == 200, response.text
    assert thinking_engine.tokenizer.template_kwargs[-1]["enable_thinking"] is False


def test_contradicting_thinking_switches_are_a_400(thinking_client: Any) -> None:
    body = _chat(enable_thinking=True, chat_template_kwargs={"enable_thinking": False})
    response = thinking_client.post("/v1/chat/completions", json=body)
    assert_error(response, 400, param="enable_thinking")
