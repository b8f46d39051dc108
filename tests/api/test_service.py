"""Service endpoints and behaviour: tokenize, version, metrics, OpenAPI, API key, served names,
CORS, X-Request-Id, the body size cap, sampling defaults and the usage extras."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.cli.serve import build_parser
from jax_llm_runtime.api.cli.service_flags import generation_config_defaults, server_config
from jax_llm_runtime.api.routes.service import package_version
from jax_llm_runtime.api.service.settings import SamplingDefaults, ServerConfig
from jax_llm_runtime.runtime.engine.mock import BOS_ID, MockEngine
from tests.api.conftest import assert_error, sse_chunks

Client = TestClient[Any]
HELLO = [{"role": "user", "content": "hello"}]


def _client(engine: MockEngine, **config: Any) -> TestClient[Any]:
    return TestClient(create_app(engine, config=ServerConfig(**config)))


@pytest.fixture
def keyed(engine: MockEngine) -> Iterator[Client]:
    with _client(engine, api_key="sekrit") as client:
        yield client


# ---------------------------------------------------------------------- tokenize / detokenize


def test_tokenize_prompt_and_detokenize_round_trip(client: Client) -> None:
    body = client.post("/tokenize", json={"prompt": "héllo"}).json()
    assert body["tokens"][0] == BOS_ID
    assert body["count"] == len(body["tokens"]) == 1 + len("héllo".encode())
    assert body["max_model_len"] == 256
    back = client.post("/detokenize", json={"tokens": body["tokens"][1:]})
    assert back.status_code == 200
    assert back.json() == {"prompt": "héllo"}


def test_tokenize_messages_matches_the_chat_prompt(client: Client, engine: MockEngine) -> None:
    tokens = client.post("/tokenize", json={"messages": HELLO}).json()["tokens"]
    client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1})
    assert tuple(tokens) == engine.requests[0].prompt_token_ids
    bare = client.post("/tokenize", json={"messages": HELLO, "add_generation_prompt": False}).json()
    assert bare["count"] < len(tokens)


def test_tokenize_and_detokenize_errors(client: Client) -> None:
    assert_error(client.post("/tokenize", json={}), 400, param="prompt")
    both = {"prompt": "a", "messages": HELLO}
    assert_error(client.post("/tokenize", json=both), 400, param="prompt")
    assert_error(client.post("/detokenize", json={"tokens": [1, 999]}), 400, param="tokens")
    assert_error(client.post("/detokenize", json={"tokens": [-1]}), 400)


# -------------------------------------------------------------------- version, metrics, schema


def test_version(client: Client) -> None:
    assert client.get("/version").json() == {"version": package_version()}
    assert package_version() != "0+unknown"  # the package is installed (editable) in the venv


def _samples(client: Client) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_metrics_move_after_a_request(client: Client) -> None:
    model = "{model_name=mock-model}"
    before = _samples(client)
    for name in (
        "runtime_num_requests_running",
        "runtime_num_requests_waiting",
        "runtime_kv_pages_used",
        "runtime_kv_pages_free",
        "runtime_compiling",
        "runtime_num_preemptions_total",
        "runtime_prompt_tokens_total",
        "runtime_generation_tokens_total",
        "runtime_time_to_first_token_seconds_count",
        "runtime_time_per_output_token_seconds_count",
    ):
        assert name + model in before, sorted(before)
    assert before["runtime_generation_tokens_total" + model] == 0
    body = client.post("/v1/chat/completions", json={"messages": HELLO}).json()
    after = _samples(client)
    usage = body["usage"]
    assert after["runtime_prompt_tokens_total" + model] == usage["prompt_tokens"]
    assert after["runtime_generation_tokens_total" + model] == usage["completion_tokens"]
    assert after["runtime_request_success_total{finish_reason=stop,model_name=mock-model}"] == 1
    assert after["runtime_time_to_first_token_seconds_count" + model] == 1
    assert after["runtime_time_per_output_token_seconds_count" + model] == 1
    assert after["runtime_http_responses_total{status_code=200}"] >= 2  # /metrics, the chat
    assert after["runtime_num_requests_running" + model] == 0


def test_metrics_say_which_kernels_run(engine: MockEngine) -> None:
    engine.kernel_choices = {"attention": "pallas", "dequant_matmul": "reference"}
    with _client(engine) as client:
        samples = _samples(client)
    for kernel, implementation in engine.kernel_choices.items():
        key = f"runtime_kernel{{implementation={implementation},kernel={kernel},model_name=mock-model}}"
        assert samples[key] == 1


def test_metrics_registries_are_per_app(engine: MockEngine) -> None:
    with _client(engine) as first:
        first.post("/v1/completions", json={"prompt": "ab"})
        assert _samples(first)["runtime_generation_tokens_total{model_name=mock-model}"] > 0
    with _client(MockEngine(max_model_len=256)) as second:
        assert _samples(second)["runtime_generation_tokens_total{model_name=mock-model}"] == 0


def test_openapi_schema_is_served(client: Client) -> None:
    schema = client.get("/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    assert "/v1/chat/completions" in schema["paths"] and "/tokenize" in schema["paths"]
    assert client.get("/schema/openapi.json").status_code == 200


def test_health_is_503_before_start_and_after_death(engine: MockEngine) -> None:
    app = create_app(engine)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        engine.shutdown()  # a dead engine loop
        assert_error(client.get("/health"), 503, code="engine_unhealthy")
    assert not MockEngine().healthy()  # before start() (loading) the engine is not healthy


# --------------------------------------------------------------------------------------- auth


def test_api_key_required_on_v1_and_tokenize(keyed: Client) -> None:
    for method, path, body in (
        ("POST", "/v1/chat/completions", {"messages": HELLO}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "a"}),
        ("POST", "/detokenize", {"tokens": [97]}),
    ):
        missing = keyed.request(method, path, json=body)
        error = assert_error(missing, 401, code="invalid_api_key")
        assert error["type"] == "authentication_error"
        wrong = keyed.request(method, path, json=body, headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401, code="invalid_api_key")
        ok = keyed.request(method, path, json=body, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200, (path, ok.text)


def test_open_routes_need_no_key(keyed: Client) -> None:
    for path in ("/health", "/version", "/metrics", "/openapi.json"):
        assert keyed.get(path).status_code == 200, path


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_API_KEY", "from-env")
    args = build_parser().parse_args(["--mock-engine"])
    assert server_config(args).api_key == "from-env"
    args = build_parser().parse_args(["--mock-engine", "--api-key", "flag"])
    assert server_config(args).api_key == "flag"


def test_request_read_timeout_flag() -> None:
    assert server_config(build_parser().parse_args(["--mock-engine"])).request_read_timeout_s == 60
    args = build_parser().parse_args(["--mock-engine", "--request-read-timeout", "2.5"])
    assert server_config(args).request_read_timeout_s == 2.5
    for bad in ("0", "-1", "nan", "inf"):
        args = build_parser().parse_args(["--mock-engine", "--request-read-timeout", bad])
        with pytest.raises(ValueError, match="request_read_timeout_s"):
            server_config(args)


def test_response_write_timeout_flag() -> None:
    args = build_parser().parse_args(["--mock-engine"])
    assert server_config(args).response_write_timeout_s == 30
    for value, seconds in (("2.5", 2.5), ("0", 0.0)):  # 0: a response may stay unread for ever
        args = build_parser().parse_args(["--mock-engine", "--response-write-timeout", value])
        assert server_config(args).response_write_timeout_s == seconds
    for bad in ("-1", "nan", "inf"):
        args = build_parser().parse_args(["--mock-engine", "--response-write-timeout", bad])
        with pytest.raises(ValueError, match="response_write_timeout_s"):
            server_config(args)


# ----------------------------------------------------------------------------- served names


def test_several_served_model_names(engine: MockEngine) -> None:
    with _client(engine, served_model_names=("mock-model", "alias")) as client:
        ids = [card["id"] for card in client.get("/v1/models").json()["data"]]
        assert ids == ["mock-model", "alias"]
        assert client.get("/v1/models/alias").json()["id"] == "alias"
        for name in ("alias", "mock-model", ""):
            body = client.post("/v1/completions", json={"prompt": "ab", "model": name}).json()
            assert body["model"] == "mock-model"  # the first name is the one reported
        unknown = client.post("/v1/chat/completions", json={"messages": HELLO, "model": "gpt-4"})
        assert unknown.json()["model"] == "mock-model"
    strict = {"served_model_names": ("mock-model", "alias"), "strict_model_names": True}
    with _client(engine, **strict) as client:
        unknown = client.post("/v1/chat/completions", json={"messages": HELLO, "model": "gpt-4"})
        assert_error(unknown, 404, param="model", code="model_not_found")
        assert client.post("/v1/completions", json={"prompt": "ab", "model": "alias"}).is_success


def test_first_served_name_must_be_the_engines(engine: MockEngine) -> None:
    with pytest.raises(ValueError, match="first served model name"):
        create_app(engine, config=ServerConfig(served_model_names=("other",)))


def test_cli_served_model_names_nargs() -> None:
    args = build_parser().parse_args(["--served-model-name", "a", "b"])
    assert server_config(args).served_model_names == ("a", "b")
    assert not server_config(args).strict_model_names
    strict = build_parser().parse_args(["--strict-model-names"])
    assert server_config(strict).strict_model_names


# --------------------------------------------------------------- CORS, request id, body cap


def test_cors_only_when_configured(client: Client, engine: MockEngine) -> None:
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    plain = client.get("/v1/models", headers={"Origin": "https://ui.example"})
    assert "access-control-allow-origin" not in plain.headers
    with _client(MockEngine(max_model_len=256), allowed_origins=("https://ui.example",)) as cors:
        response = cors.get("/v1/models", headers={"Origin": "https://ui.example"})
        assert response.headers["access-control-allow-origin"] == "https://ui.example"
        assert cors.options("/v1/chat/completions", headers=preflight).status_code in (200, 204)
        other = cors.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_cli_allowed_origins_comma_and_repeated() -> None:
    argv = ["--allowed-origins", "https://a.example,https://b.example"]
    args = build_parser().parse_args([*argv, "--allowed-origins", "https://c.example"])
    assert server_config(args).allowed_origins == (
        "https://a.example",
        "https://b.example",
        "https://c.example",
    )


def test_request_id_echoed_or_generated(client: Client) -> None:
    sent = client.get("/health", headers={"X-Request-Id": "abc-123"})
    assert sent.headers["x-request-id"] == "abc-123"
    made = client.get("/v1/models")
    assert len(made.headers["x-request-id"]) == 32
    missing_route = client.get("/nope", headers={"X-Request-Id": "r1"})
    assert missing_route.status_code == 404 and missing_route.headers["x-request-id"] == "r1"
    bad = client.get("/health", headers={"X-Request-Id": "has space"})
    assert bad.headers["x-request-id"] != "has space"


def test_body_over_the_cap_is_413(engine: MockEngine) -> None:
    with _client(engine, max_request_body_bytes=2048) as client:
        big = {"prompt": "x" * 4096}
        error = assert_error(client.post("/v1/completions", json=big), 413)
        assert error["type"] == "invalid_request_error"
        assert client.post("/v1/completions", json={"prompt": "x" * 100}).status_code == 200


def test_server_config_validates() -> None:
    with pytest.raises(ValueError, match="max_n"):
        ServerConfig(max_n=0)
    with pytest.raises(ValueError, match="API key"):
        ServerConfig(api_key=" ")
    with pytest.raises(ValueError, match="repeat"):
        ServerConfig(served_model_names=("a", "a"))
    with pytest.raises(ValueError, match="top_p"):
        SamplingDefaults(top_p=0)


# ---------------------------------------------------------------------- sampling defaults


def test_defaults_precedence_request_over_flag_over_generation_config(
    engine: MockEngine, tmp_path: Path
) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7})
    )
    generation = generation_config_defaults(str(tmp_path))
    assert generation == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, max_tokens=7)
    args = build_parser().parse_args(["--temperature", "0.3", "--max-gen-tokens", "3"])
    config = server_config(args, generation)
    assert config.sampling_defaults.temperature == 0.3  # flag over generation_config
    assert config.sampling_defaults.top_p == 0.9  # generation_config where no flag
    with TestClient(create_app(engine, config=config)) as client:
        client.post("/v1/chat/completions", json={"messages": HELLO})
        client.post("/v1/chat/completions", json={"messages": HELLO, "temperature": 1.5})
        client.post("/v1/completions", json={"prompt": "ab", "top_p": 0.5, "max_tokens": 9})
    first, second, third = (r.sampling for r in engine.requests)
    assert (first.temperature, first.top_p, first.top_k, first.max_tokens) == (0.3, 0.9, 20, 3)
    assert second.temperature == 1.5  # the request wins
    assert (third.top_p, third.max_tokens, third.temperature) == (0.5, 9, 0.3)


def test_openai_defaults_without_server_defaults(client: Client, engine: MockEngine) -> None:
    client.post("/v1/chat/completions", json={"messages": HELLO})
    sampling = engine.requests[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, 0)
    assert sampling.max_tokens == 256 - len(engine.requests[0].prompt_token_ids)


def test_generation_config_do_sample_false_is_greedy() -> None:
    defaults = SamplingDefaults.from_generation_config({"do_sample": False, "temperature": 0.7})
    assert defaults.temperature == 0.0
    assert SamplingDefaults.from_generation_config({"top_k": 0}) == SamplingDefaults()


def test_completion_tokens_cap(engine: MockEngine) -> None:
    with _client(engine, max_completion_tokens_cap=5) as client:
        too_many = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 6})
        assert_error(too_many, 400, param="max_tokens")
        assert client.post("/v1/chat/completions", json={"messages": HELLO}).status_code == 200
    assert engine.requests[0].sampling.max_tokens == 5  # the default budget is clamped


# ------------------------------------------------------------------------------- usage extras


def _assert_usage_extras(usage: dict[str, Any]) -> None:
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert isinstance(usage["prompt_time_costs"], int) and usage["prompt_time_costs"] >= 0
    assert isinstance(usage["completion_time_costs"], int) and usage["completion_time_costs"] >= 0


def test_usage_extras_in_json_and_final_chunk(client: Client) -> None:
    chat = client.post("/v1/chat/completions", json={"messages": HELLO}).json()
    _assert_usage_extras(chat["usage"])
    completion = client.post("/v1/completions", json={"prompt": "abc"}).json()
    _assert_usage_extras(completion["usage"])
    stream = {"messages": HELLO, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks(client.post("/v1/chat/completions", json=stream).text)
    _assert_usage_extras(chunks[-1]["usage"])


def test_penalty_and_min_p_defaults_reach_sampling(engine: MockEngine) -> None:
    defaults = SamplingDefaults(min_p=0.1, presence_penalty=0.5, frequency_penalty=0.2)
    with _client(engine, sampling_defaults=defaults) as client:
        client.post("/v1/chat/completions", json={"messages": HELLO})
        client.post("/v1/chat/completions", json={"messages": HELLO, "presence_penalty": 0})
    first, second = (r.sampling for r in engine.requests)
    assert (first.min_p, first.presence_penalty, first.frequency_penalty) == (0.1, 0.5, 0.2)
    assert second.presence_penalty == 0  # an explicit request value wins, even the default
