"""Prometheus metrics for one app: a registry per ``create_app``, never a module global.

Counters and histograms are observed by the HTTP layer (``api.generation.stream`` for tokens and
latencies, the ``before_send`` hook for response status codes); each engine's load (running and
waiting sequences, KV pages, preemptions) is read from ``engine.stats()`` at scrape time. Engine
and generation metrics carry a ``model_name`` label (one value per served model, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jax_llm_runtime.runtime.engine.interface import EngineClient

PREFIX = "runtime"
MODEL_LABEL = "model_name"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """Gauges and counters read from every engine's ``stats()`` on every scrape."""

    def __init__(self, engines: Sequence[EngineClient]) -> None:
        self._engines = engines

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = [(engine.model_name, engine.stats()) for engine in self._engines]
        gauges = {
            "num_requests_running": ("Sequences in the running batch.", "num_running"),
            "num_requests_waiting": ("Sequences waiting to be scheduled.", "num_waiting"),
            "kv_pages_used": ("KV cache pages in use.", "num_pages_used"),
            "kv_pages_free": ("KV cache pages free.", "num_pages_free"),
            "kv_pages_total": ("KV cache pages in all.", "num_pages_total"),
            "kv_pages_cached": (
                "Free KV cache pages that still hold a reusable prefix.",
                "num_pages_cached",
            ),
            "state_slots_used": (
                "State slots held by running sequences (models with linear-attention layers).",
                "num_state_slots_used",
            ),
            "state_slots_total": (
                "State slots in all (models with linear-attention layers; 0 for others).",
                "num_state_slots_total",
            ),
            "compiling": (
                "1 while step shapes still compile in the background after start (per replica).",
                "num_compiling",
            ),
        }
        counters = {
            "num_preemptions": (
                "Sequences preempted (pages freed, recomputed later).",
                "num_preemptions",
            ),
            "prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache.",
                "num_prefix_cache_queries",
            ),
            "prefix_cache_hits": (
                "Prompt tokens whose K/V came from the prefix cache.",
                "num_prefix_cache_hits",
            ),
        }
        kernels = GaugeMetricFamily(
            f"{PREFIX}_kernel",
            "1 for the implementation each kernel runs (pallas, reference, native or XLA).",
            labels=[MODEL_LABEL, "kernel", "implementation"],
        )
        for engine in self._engines:
            for kernel, implementation in getattr(engine, "kernel_choices", {}).items():
                kernels.add_metric([engine.model_name, kernel, implementation], 1)
        yield kernels
        for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, (doc, field) in table.items():
                family = kind(f"{PREFIX}_{name}", doc, labels=[MODEL_LABEL])
                for model_name, snapshot in stats:
                    family.add_metric([model_name], getattr(snapshot, field))
                yield family


class Metrics:
    """The app's registry and the instruments the HTTP layer observes."""

    def __init__(self, engines: Sequence[EngineClient]) -> None:
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
            [MODEL_LABEL, "finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens",
            "Prompt tokens processed.",
            [MODEL_LABEL],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens",
            "Tokens generated.",
            [MODEL_LABEL],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from submission to the first generated token.",
            [MODEL_LABEL],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            [MODEL_LABEL],
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        for engine in engines:  # every model's series exists from the start, at 0
            self.prompt_tokens.labels(engine.model_name)
            self.generation_tokens.labels(engine.model_name)
            self.time_to_first_token.labels(engine.model_name)
            self.time_per_output_token.labels(engine.model_name)
        self.registry.register(_EngineCollector(engines))

    def observe_finished(
        self,
        model_name: str,
        finish_reason: str,
        num_prompt_tokens: int,
        num_output_tokens: int,
        ttft_s: float,
        decode_s: float,
    ) -> None:
        """Record one finished generation of ``model_name``: its tokens, TTFT, and TPOT over the
        tokens after the first."""
        self.requests_finished.labels(model_name, finish_reason).inc()
        self.prompt_tokens.labels(model_name).inc(num_prompt_tokens)
        self.generation_tokens.labels(model_name).inc(num_output_tokens)
        self.time_to_first_token.labels(model_name).observe(ttft_s)
        if num_output_tokens > 1:
            self.time_per_output_token.labels(model_name).observe(
                decode_s / (num_output_tokens - 1)
            )

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)
