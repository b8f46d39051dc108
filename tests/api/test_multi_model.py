"""Several models behind one app: each request goes to the engine its ``model`` names.

Two mock engines that answer differently (and have different context lengths, which the
tokenize and embeddings routes reveal) show which one served each route.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.service.served_models import ServedModel
from jax_llm_runtime.api.service.settings import SamplingDefaults, ServerConfig
from jax_llm_runtime.runtime.engine.mock import MockEngine
from tests.api.conftest import assert_error, sse_chunks

Client = TestClient[Any]
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
def alpha() -> MockEngine:
    return MockEngine(model_name="alpha", max_model_len=256, reply="from alpha")


@pytest.fixture
def beta() -> MockEngine:
    return MockEngine(model_name="beta", max_model_len=512, reply="from beta")


@pytest.fixture
def client(alpha: MockEngine, beta: MockEngine) -> Iterator[Client]:
    models = [ServedModel(alpha, SamplingDefaults(temperature=0.25)), ServedModel(beta)]
    config = ServerConfig(sampling_defaults=SamplingDefaults(temperature=0.75))
    with TestClient(create_app(models, config=config)) as test_client:
        yield test_client


def _chat(client: Client, **fields: Any) -> Any:
    return client.post("/v1/chat/completions", json={"messages": HELLO, **fields})


def test_chat_and_completions_go_to_the_named_model(
    client: Client, alpha: MockEngine, beta: MockEngine
) -> None:
    for name in ("alpha", "beta", "beta", "alpha"):
        reply = _chat(client, model=name).json()
        assert reply["model"] == name
        assert reply["choices"][0]["message"]["content"] == f"from {name}"
    completion = client.post("/v1/completions", json={"model": "beta", "prompt": "x"}).json()
    assert (completion["model"], completion["choices"][0]["text"]) == ("beta", "from beta")
    assert (len(alpha.requests), len(beta.requests)) == (2, 3)


def test_streams_report_their_model(client: Client) -> None:
    chunks = sse_chunks(_chat(client, model="beta", stream=True).text)
    assert {chunk["model"] for chunk in chunks} == {"beta"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "from beta"


def test_a_request_without_a_model_goes_to_the_first(client: Client, beta: MockEngine) -> None:
    assert _chat(client).json()["model"] == "alpha"
    assert _chat(client, model="").json()["model"] == "alpha"
    assert not beta.requests


def test_each_model_has_its_own_sampling_defaults(
    client: Client, alpha: MockEngine, beta: MockEngine
) -> None:
    _chat(client, model="alpha")
    _chat(client, model="beta")
    assert alpha.requests[0].sampling.temperature == 0.25  # its own (its generation_config)
    assert beta.requests[0].sampling.temperature == 0.75  # none of its own: the server's


def test_responses_embeddings_and_tokenize_route_by_model(client: Client) -> None:
    response = client.post("/v1/responses", json={"model": "beta", "input": "hi"}).json()
    assert (response["model"], response["output_text"]) == ("beta", "from beta")
    for name, max_model_len in (("alpha", 256), ("beta", 512)):
        tokens = client.post("/tokenize", json={"model": name, "prompt": "a"}).json()
        assert tokens["max_model_len"] == max_model_len
        back = client.post("/detokenize", json={"model": name, "tokens": [104, 105]})
        assert back.json() == {"prompt": "hi"}
    long_input = [7] * 300  # fits beta's 512-token context, not alpha's 256
    embedded = client.post("/v1/embeddings", json={"model": "beta", "input": long_input})
    assert embedded.status_code == 200 and embedded.json()["model"] == "beta"
    too_long = client.post("/v1/embeddings", json={"model": "alpha", "input": long_input})
    assert_error(too_long, 400, code="context_length_exceeded")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": HELLO}),
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/responses", {"input": "x"}),
        ("/v1/embeddings", {"input": "x"}),
        ("/tokenize", {"prompt": "x"}),
        ("/detokenize", {"tokens": [104]}),
    ],
)
def test_an_unknown_model_is_a_404_naming_the_served_ones(
    client: Client, path: str, body: dict[str, Any]
) -> None:
    error = assert_error(
        client.post(path, json={**body, "model": "gpt-4"}), 404, "model", "model_not_found"
    )
    assert "`gpt-4`" in error["message"] and "`alpha`, `beta`" in error["message"]


def test_a_malformed_body_is_a_400_whatever_model_it_names(client: Client) -> None:
    # The body is decoded before its model is looked up, as with one model.
    response = client.post("/v1/chat/completions", json={"model": "gpt-4"})
    assert_error(response, 400, param="messages")


def test_models_lists_every_model(client: Client) -> None:
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [("alpha", 256), ("beta", 512)]
    assert client.get("/v1/models/beta").json()["id"] == "beta"
    assert_error(client.get("/v1/models/gamma"), 404, code="model_not_found")


def test_health_reflects_every_engine(client: Client, beta: MockEngine) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    beta.mark_unhealthy()
    error = assert_error(client.get("/health"), 503, code="engine_unhealthy")
    assert "beta" in error["message"] and "alpha" not in error["message"]


def test_metrics_carry_each_model(client: Client) -> None:
    usage = _chat(client, model="beta").json()["usage"]
    text = client.get("/metrics").text
    samples = {
        (s.name, s.labels.get("model_name")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for model in ("alpha", "beta"):
        assert ("runtime_num_requests_running", model) in samples
        assert ("runtime_kv_pages_total", model) in samples
    assert samples[("runtime_generation_tokens_total", "alpha")] == 0
    assert samples[("runtime_generation_tokens_total", "beta")] == usage["completion_tokens"]


def test_the_lifespan_starts_and_stops_every_engine(alpha: MockEngine, beta: MockEngine) -> None:
    app = create_app([ServedModel(alpha), ServedModel(beta)])
    assert not alpha.started and not beta.started
    with TestClient(app):
        assert alpha.started and beta.started
    assert not alpha.started and not beta.started


def test_served_model_aliases_still_rename_one_model(alpha: MockEngine) -> None:
    config = ServerConfig(served_model_names=("alpha", "a"))
    with TestClient(create_app(alpha, config=config)) as client:
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["alpha", "a"]
        assert _chat(client, model="a").json()["model"] == "alpha"  # the first name is reported


def test_names_must_be_unambiguous(alpha: MockEngine, beta: MockEngine) -> None:
    with pytest.raises(ValueError, match="rename a single model"):
        create_app([ServedModel(alpha), ServedModel(beta)], config=ServerConfig(("x",)))
    with pytest.raises(ValueError, match="two models are served as 'alpha'"):
        create_app([ServedModel(alpha), ServedModel(MockEngine(model_name="alpha"))])
    with pytest.raises(ValueError, match="no model"):
        create_app([])
