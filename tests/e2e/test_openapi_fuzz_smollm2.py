"""schemathesis against ``runtime-serve`` with the embedded SmolLM2: the real tokenizer, chat
template and engine behind the fuzzing of tests/api/test_openapi_fuzz.py (which covers the HTTP
layer with the mock engine and thousands of requests).

A short run: generated cases only (no coverage cases), a small context, and the server's own caps
(``--max-completion-tokens-cap``, ``--max-gen-tokens``, ``--max-n``) keep every generation to a
few tokens, whatever the fuzzer asks for. Then the requests that once took this server down.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.openapi_fuzz import assert_envelope, run_fuzz
from tests.serve_process import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVER_ARGS = [
    *("--max-model-len", "128", "--max-num-seqs", "4"),
    *("--max-completion-tokens-cap", "8", "--max-gen-tokens", "8"),
    *("--max-n", "2", "--max-top-logprobs", "5"),
]
MAX_EXAMPLES = 20  # per operation and mode: about 230 requests
MIN_REQUESTS = 150
VOCAB_SIZE = 49152  # SmolLM2's tokenizer
QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's base URL; afterwards its log must hold no traceback and no error."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with running_server(SERVER_ARGS, log) as proc:
        yield proc.url.removesuffix("/v1")
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]


def assert_serving(base_url: str) -> None:
    """Healthy, and a plain chat completion still gets an answer."""
    assert requests.get(f"{base_url}/health", timeout=30).status_code == 200
    reply = requests.post(f"{base_url}/v1/chat/completions", json=QUESTION, timeout=120)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["message"]["content"] and choice["finish_reason"] in ("stop", "length")


def test_fuzzed_requests_get_no_5xx_and_leave_it_serving(server: str) -> None:
    log = run_fuzz(server, MAX_EXAMPLES, coverage=False, timeout_s=120)
    assert log.requests >= MIN_REQUESTS, sorted(log.statuses.items())
    assert not log.failures, log.report()
    assert {200, 400} <= log.codes("POST /v1/chat/completions"), sorted(log.statuses.items())
    assert_serving(server)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # An id past int32 stopped the engine loop for every client; one past the vocabulary
        # was read from a clamped embedding row.
        ("/v1/completions", {"prompt": [1, 2**31]}, "prompt"),
        ("/v1/completions", {"prompt": [VOCAB_SIZE]}, "prompt"),
        ("/v1/completions", {"prompt": [VOCAB_SIZE], "echo": True, "logprobs": 1}, "prompt"),
        ("/v1/embeddings", {"input": [[1, VOCAB_SIZE]]}, "input"),
        # The real template renderer takes ``template`` as an argument: this was a TypeError.
        (
            "/v1/chat/completions",
            {**QUESTION, "chat_template_kwargs": {"template": "x"}},
            "chat_template_kwargs",
        ),
    ],
)
def test_hostile_requests_are_400_and_leave_it_serving(
    server: str, path: str, body: dict[str, Any], param: str
) -> None:
    response = requests.post(f"{server}{path}", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert_envelope(response)
    assert response.json()["error"]["param"] == param
    assert_serving(server)
