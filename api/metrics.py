"""Prometheus metrics for one app: a registry per ``create_app``, never a module global.

Counters and histograms are observed by the HTTP layer (``api.generation`` for tokens and
latencies, the ``before_send`` hook for response status codes); the engine's load (running and
waiting sequences, KV pages, preemptions) is read from ``engine.stats()`` at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.interface import EngineClient

PREFIX = "runtime"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """Gauges read from ``engine.stats()`` on every scrape."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._engine.stats()
        gauges = {
            "num_requests_running": ("Sequences in the running batch.", stats.num_running),
            "num_requests_waiting": ("Sequences waiting to be scheduled.", stats.num_waiting),
            "kv_pages_used": ("KV cache pages in use.", stats.num_pages_used),
            "kv_pages_free": ("KV cache pages free.", stats.num_pages_free),
            "kv_pages_total": ("KV cache pages in all.", stats.num_pages_total),
            "kv_pages_cached": (
                "Free KV cache pages that still hold a reusable prefix.",
                stats.num_pages_cached,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield CounterMetricFamily(
            f"{PREFIX}_num_preemptions",
            "Sequences preempted (pages freed, recomputed later).",
            value=stats.num_preemptions,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            value=stats.num_prefix_cache_queries,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_prefix_cache_hits",
            "Prompt tokens whose K/V came from the prefix cache.",
            value=stats.num_prefix_cache_hits,
        )


class Metrics:
    """The app's registry and the instruments the HTTP layer observes."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        self.responses = Counter(
            f"{PREFIX}_http_responses",
            "HTTP responses by status code.",
            ["status_code"],
            registry=self.registry,
        )
        self.requests_finished = Counter(
            f"{PREFIX}_request_success",
            "Generation requests that finished, by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens processed.", registry=self.registry
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Tokens generated.", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from submission to the first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))

    def observe_finished(
        self,
        finish_reason: str,
        num_prompt_tokens: int,
        num_output_tokens: int,
        ttft_s: float,
        decode_s: float,
    ) -> None:
        """Record one finished generation: its tokens, TTFT, and TPOT over the tokens after the first."""
        self.requests_finished.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        self.time_to_first_token.observe(ttft_s)
        if num_output_tokens > 1:
            self.time_per_output_token.observe(decode_s / (num_output_tokens - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)
