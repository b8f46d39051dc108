"""schemathesis against a running server: what the OpenAPI fuzz tests send and what they check.

``run_fuzz`` reads the server's own ``/schema/openapi.json`` and, for every operation, sends

1. (optionally) its coverage cases: deterministic boundary values and violations of the schema
   (missing, extra and mistyped fields, numbers and lists just past their limits, unexpected
   methods), and
2. Hypothesis-generated bodies and parameters, valid ones (positive) and, where there is a body,
   invalid ones (negative), derandomized so every run sends the same requests.

Every response must pass ``CHECKS``: no 5xx; status, content type and body as documented (every
error is the OpenAI envelope, which ``assert_envelope`` checks once more without the schema);
invalid data rejected with a 4xx. The run goes on past a failure and collects them all.

``positive_data_acceptance`` is left out: a schema-valid request may still be refused for what no
static schema holds (the prompt plus max_tokens past the context window, ``n`` above the server's
cap, another model's name, a token id outside the vocabulary), and those refusals are right.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)
from schemathesis.errors import FailureGroup

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    unsupported_method,
]
ENVELOPE_KEYS = {"message", "type", "param", "code"}


def assert_envelope(response: requests.Response) -> None:
    """An error response is exactly ``{"error": {"message", "type", "param", "code"}}``."""
    if response.status_code < 400:
        return
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ENVELOPE_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


@dataclass
class FuzzLog:
    """What a run sent (per operation and status) and every failure it saw."""

    base_url: str
    timeout_s: float
    session: requests.Session = field(default_factory=requests.Session)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def codes(self, label: str) -> set[int]:
        """The statuses seen for one operation, e.g. ``"POST /v1/completions"``."""
        return {code for (op, code) in self.statuses if op == label}

    def report(self) -> str:
        lines = [f"{len(self.failures)} failures in {self.requests} requests:"]
        return "\n".join([*lines, *self.failures[:40]])

    def send(self, case: schemathesis.Case, source: str) -> None:
        response = case.call(base_url=self.base_url, session=self.session, timeout=self.timeout_s)
        self.statuses[(case.operation.label, response.status_code)] += 1
        try:
            case.validate_response(response, checks=CHECKS)
            assert_envelope(response)
        except FailureGroup as group:
            self._failed(case, response, source, "; ".join(f.title for f in group.exceptions))
        except AssertionError as exc:  # one schemathesis Failure, or assert_envelope
            self._failed(case, response, source, str(exc).strip().split("\n")[0])

    def _failed(
        self, case: schemathesis.Case, response: requests.Response, source: str, what: str
    ) -> None:
        self.failures.append(
            f"{source} {case.method} {case.path} -> {response.status_code}: {what} "
            f"| sent: {str(case.body)[:300]} | reply: {response.text[:300]}"
        )


def _generate(log: FuzzLog, operation: Any, mode: GenerationMode, max_examples: int) -> None:
    settings = hypothesis.settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # failures are collected, not shrunk
        suppress_health_check=list(HealthCheck),
    )

    @settings
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def send(case: schemathesis.Case) -> None:
        log.send(case, mode.value)

    send()


def run_fuzz(
    base_url: str, max_examples: int, *, coverage: bool = True, timeout_s: float = 60
) -> FuzzLog:
    """Fuzz every operation of the server at ``base_url``; see the module docstring.

    ``max_examples``: generated cases per operation and mode (Hypothesis stops earlier for an
    operation with fewer distinct inputs, such as a GET without parameters).
    """
    schema = schemathesis.openapi.from_url(f"{base_url}/schema/openapi.json")
    log = FuzzLog(base_url, timeout_s)
    for result in schema.get_all_operations():
        operation = result.ok()
        if coverage:
            config = schema.config.generation_for(operation=operation)
            for case in schema.iter_coverage_cases(
                operation, generation_modes=list(GenerationMode), generation_config=config
            ):
                log.send(case, "coverage")
        _generate(log, operation, GenerationMode.POSITIVE, max_examples)
        # Only a body can be made invalid: the one path parameter (a model name) is any string.
        if len(operation.body) > 0:
            _generate(log, operation, GenerationMode.NEGATIVE, max_examples)
    return log
