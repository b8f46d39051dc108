"""POST /v1/embeddings against the mock engine: input forms, encodings, pooling, errors."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import pytest

from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.conftest import MAX_MODEL_LEN, assert_error


def _embed(client: Any, **body: Any) -> Any:
    return client.post("/v1/embeddings", json=body)


def _vectors(response: Any) -> list[np.ndarray]:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "mock-model"
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    assert all(d["object"] == "embedding" for d in body["data"])
    return [np.asarray(d["embedding"], np.float32) for d in body["data"]]


async def _raw(engine: MockEngine, ids: list[int], pooling: str) -> np.ndarray:
    return (await engine.embed([ids], pooling))[0]


def test_string_input_is_mean_pooled_and_unit_length(client: Any, engine: MockEngine) -> None:
    response = _embed(client, input="hi", model="mock-model")
    (vector,) = _vectors(response)
    ids = engine.tokenizer.encode("hi")  # with BOS, like a completion prompt
    assert response.json()["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}
    raw = asyncio.run(_raw(engine, ids, "mean"))
    np.testing.assert_allclose(vector, raw / np.linalg.norm(raw), rtol=1e-6)
    assert abs(np.linalg.norm(vector) - 1) < 1e-6


@pytest.mark.parametrize(
    ("body_input", "expected_ids"),
    [
        (["ab", "c"], [[256, 97, 98], [256, 99]]),
        ([97, 98], [[97, 98]]),
        ([[97], [98, 99]], [[97], [98, 99]]),
    ],
)
def test_input_forms(
    client: Any, engine: MockEngine, body_input: Any, expected_ids: list[list[int]]
) -> None:
    got = _vectors(_embed(client, input=body_input, normalize=False))
    want = asyncio.run(engine.embed(expected_ids, "mean"))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_last_pooling_and_base64(client: Any, engine: MockEngine) -> None:
    response = _embed(client, input=[[5, 6, 7]], pooling="last", encoding_format="base64")
    assert response.status_code == 200, response.text
    encoded = response.json()["data"][0]["embedding"]
    vector = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    raw = asyncio.run(engine.embed([[7]], "mean"))[0]  # last token only
    np.testing.assert_allclose(vector, raw / np.linalg.norm(raw), rtol=1e-6)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ["a", ""]}, "input", None),
        ({"input": [[]]}, "input", None),
        ({"input": ["a", 1]}, "input", None),
        ({"input": [-1]}, "input[0]", None),
        ({"input": "x", "dimensions": 4}, "dimensions", "unsupported_parameter"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
        ({"input": "x", "pooling": "cls"}, "pooling", None),
        ({"input": "x", "bogus": 1}, "bogus", None),
        ({"input": [1] * (MAX_MODEL_LEN + 1)}, "input", "context_length_exceeded"),
        ({"input": "x" * MAX_MODEL_LEN}, "input", "context_length_exceeded"),  # + BOS
    ],
)
def test_bad_requests_are_400(
    client: Any, body: dict[str, Any], param: str, code: str | None
) -> None:
    assert_error(_embed(client, **body), 400, param=param, code=code)


def test_input_of_max_model_len_tokens_is_accepted(client: Any) -> None:
    assert len(_vectors(_embed(client, input=[1] * MAX_MODEL_LEN))) == 1


def test_other_model_is_answered_by_the_one_served(client: Any) -> None:
    assert _embed(client, input="x", model="other").status_code == 200


def test_openai_sdk_decodes_base64_embeddings(client: Any) -> None:
    """The openai SDK asks for base64 by default and decodes little-endian float32."""
    response = _embed(client, input="hello", encoding_format="base64")
    floats = _vectors(_embed(client, input="hello"))[0]
    decoded = np.frombuffer(base64.b64decode(response.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, floats)
