"""The interference load of tools/bench.py (`--load interference`): how a server's running
streams fare while long prompts arrive.

`--streams S` background streams each run a closed loop of requests (`--input-len` prompt tokens,
`--output-len` output tokens; use `--exact-output`) for `--duration` seconds. From `--long-every T`
seconds after the start, a prompt of about `--long-len N` tokens arrives every T seconds (its own
tag, so no prefix cache helps; `max_tokens` 1). Every gap between two consecutive content chunks
of a background stream is one inter-token latency (ITL) sample, counted in the phase `prefill`
when it overlaps the time a long prompt was in flight before its first token, else `calm`.

Reported per server: ITL p50/p90/p99/max of each phase and of all samples, p99 over p50 of all
samples, the long prompts' time to first token, and the background streams' output tokens/s.
With a peer, a ratio row ours/peer.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

from bench_report import RequestResult, percentile

PHASES = ("calm", "prefill", "all")


@dataclass
class Timed:
    """A request and the moment (perf_counter seconds) it was sent."""

    sent_s: float
    result: RequestResult


@dataclass
class PhaseStats:
    samples: int
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    max_s: float | None


@dataclass
class InterferenceResult:
    """One server's run of the interference load."""

    name: str
    background_requests: int
    background_failed: int
    background_tok_per_s: float
    long_prompts: int
    long_failed: int
    long_input_tokens_mean: float | None
    long_ttft_p50_s: float | None
    long_ttft_max_s: float | None
    itl: dict[str, PhaseStats] = field(default_factory=dict)

    @property
    def p99_over_p50(self) -> float | None:
        stats = self.itl["all"]
        if stats.p50_s is None or stats.p99_s is None or stats.p50_s <= 0:
            return None
        return stats.p99_s / stats.p50_s


def prefill_windows(longs: list[Timed]) -> list[tuple[float, float]]:
    """When each long prompt was in flight before its first token (absolute seconds); a
    prompt that never produced one counts until its request ended."""
    windows = []
    for timed in longs:
        r = timed.result
        end = r.ttft_s if r.ttft_s is not None else r.e2e_s
        windows.append((timed.sent_s, timed.sent_s + end))
    return windows


def itl_by_phase(
    background: list[Timed], windows: list[tuple[float, float]]
) -> dict[str, list[float]]:
    """Every background gap between consecutive chunks, by phase (see the module docstring)."""
    gaps: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for timed in background:
        if timed.result.error is not None:
            continue
        times = [timed.sent_s + t for t in timed.result.chunk_times_s]
        for a, b in itertools.pairwise(times):
            busy = any(start < b and end > a for start, end in windows)
            gaps["prefill" if busy else "calm"].append(b - a)
            gaps["all"].append(b - a)
    return gaps


def _stats(values: list[float]) -> PhaseStats:
    if not values:
        return PhaseStats(0, None, None, None, None)
    return PhaseStats(
        len(values),
        percentile(values, 50),
        percentile(values, 90),
        percentile(values, 99),
        max(values),
    )


def summarize(
    name: str, background: list[Timed], longs: list[Timed], wall_s: float
) -> InterferenceResult:
    ok = [t.result for t in background if t.result.error is None]
    long_ok = [t.result for t in longs if t.result.error is None]
    ttfts = [r.ttft_s for r in long_ok if r.ttft_s is not None]
    inputs = [r.input_tokens for r in long_ok if r.input_tokens is not None]
    gaps = itl_by_phase(background, prefill_windows(longs))
    return InterferenceResult(
        name=name,
        background_requests=len(background),
        background_failed=len(background) - len(ok),
        background_tok_per_s=sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
        long_prompts=len(longs),
        long_failed=len(longs) - len(long_ok),
        long_input_tokens_mean=sum(inputs) / len(inputs) if inputs else None,
        long_ttft_p50_s=percentile(ttfts, 50) if ttfts else None,
        long_ttft_max_s=max(ttfts) if ttfts else None,
        itl={phase: _stats(values) for phase, values in gaps.items()},
    )


async def run(
    send: Callable[[dict], Awaitable[RequestResult]],
    body_for: Callable[[str, int, bool], dict],  # (tag, index, long) -> the request's body
    streams: int,
    duration_s: float,
    long_every_s: float,
) -> tuple[list[Timed], list[Timed], float]:
    """The load against one server: background streams and the long prompts' arrivals."""
    tag = secrets.token_hex(4)
    start = time.perf_counter()
    stop = start + duration_s
    background: list[Timed] = []
    longs: list[Timed] = []
    counter = itertools.count()

    async def stream_worker() -> None:
        while time.perf_counter() < stop:
            sent = time.perf_counter()
            result = await send(body_for(f"{tag}-bg", next(counter), False))
            background.append(Timed(sent, result))

    async def arrivals() -> None:
        tasks = []
        for k in itertools.count(1):
            at = start + k * long_every_s
            if at >= stop:
                break
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(_timed(send, body_for(f"{tag}-long", k, True))))
        longs.extend(await asyncio.gather(*tasks))

    await asyncio.gather(arrivals(), *(stream_worker() for _ in range(streams)))
    return background, longs, time.perf_counter() - start


async def _timed(send: Callable[[dict], Awaitable[RequestResult]], body: dict) -> Timed:
    sent = time.perf_counter()
    return Timed(sent, await send(body))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def print_report(results: list[InterferenceResult]) -> None:
    """One table of ITL by phase per server, then the long prompts and a ratio line."""
    print("\ninter-token latency of the background streams (ms), by phase")
    print(f"{'server':<8}{'phase':<9}{'n':>7}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}")
    for res in results:
        for phase in PHASES:
            s = res.itl[phase]
            cells = "".join(f"{_ms(v):>8}" for v in (s.p50_s, s.p90_s, s.p99_s, s.max_s))
            print(f"{res.name:<8}{phase:<9}{s.samples:>7}{cells}")
    print(
        f"\n{'server':<8}{'p99/p50':>9}{'bg tok/s':>10}{'bg req':>8}{'long':>6}"
        f"{'long in_tok':>12}{'long TTFT p50':>15}{'max':>8}{'failed':>8}"
    )
    for res in results:
        ratio = "-" if res.p99_over_p50 is None else f"{res.p99_over_p50:.2f}"
        long_in = "-" if res.long_input_tokens_mean is None else f"{res.long_input_tokens_mean:.0f}"
        failed = res.background_failed + res.long_failed
        print(
            f"{res.name:<8}{ratio:>9}{res.background_tok_per_s:>10.1f}"
            f"{res.background_requests:>8}{res.long_prompts:>6}{long_in:>12}"
            f"{_ms(res.long_ttft_p50_s):>15}{_ms(res.long_ttft_max_s):>8}{failed:>8}"
        )
    if len(results) == 2:
        ours, peer = results
        p99 = _ratio(ours.itl["all"].p99_s, peer.itl["all"].p99_s)
        tok = _ratio(ours.background_tok_per_s, peer.background_tok_per_s)
        print(f"ours/peer: ITL p99 {p99}, background tok/s {tok}")


def _ratio(ours: float | None, peer: float | None) -> str:
    return "-" if ours is None or not peer else f"{ours / peer:.2f}x"


def as_json(results: list[InterferenceResult]) -> list[dict]:
    return [{**asdict(r), "p99_over_p50": r.p99_over_p50} for r in results]
