"""Reporting for tools/bench.py: what a benchmark run measured and how it is shown.

Holds the result dataclasses (one request, one concurrency level, one server), the statistics
that fold a level's requests into means and percentiles, the two printed tables with their
ours/peer ratio rows and notes, the JSON writer and the PNG plot. The load generator, its flags
and the description of every metric are in tools/bench.py.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class RequestResult:
    """One streamed completion; times in seconds from sending the request."""

    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each content chunk
    e2e_s: float = 0.0
    output_tokens: int = 0
    token_source: str = "chunks"  # "usage" | "timings" | "chunks"
    input_tokens: int | None = None  # as the server reports it
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None


@dataclass
class LevelResult:
    """Aggregates of one concurrency level against one server; latencies in seconds."""

    concurrency: int
    requests: int
    failed: int
    output_tokens: int
    wall_s: float
    output_tok_per_s: float
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tpot_mean_s: float | None
    e2e_mean_s: float | None
    request_per_s: float
    input_tokens_mean: float | None  # None when the server reports no prompt tokens
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    itl_mean_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    token_sources: list[str] = field(default_factory=list)
    first_error: str | None = None


@dataclass
class ServerResult:
    """All levels run against one server."""

    name: str
    base_url: str
    model: str
    levels: list[LevelResult]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (as numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _dist(name: str, values: list[float], qs: tuple[int, ...]) -> dict[str, float | None]:
    """{name}_mean_s and {name}_p{q}_s for each q; None when there are no values."""
    out = {f"{name}_mean_s": statistics.fmean(values) if values else None}
    for q in qs:
        out[f"{name}_p{q}_s"] = percentile(values, q) if values else None
    return out


def summarize(concurrency: int, results: list[RequestResult], wall_s: float) -> LevelResult:
    """Aggregates one level. Failed requests count as failed and add no tokens or latencies."""
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.ttft_s is not None and r.output_tokens > 1
    ]
    itls = [b - a for r in ok for a, b in itertools.pairwise(r.chunk_times_s)]
    inputs = [r.input_tokens for r in ok if r.input_tokens is not None]
    total = sum(r.output_tokens for r in ok)
    errors = [r.error for r in results if r.error is not None]
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        failed=len(errors),
        output_tokens=total,
        wall_s=wall_s,
        output_tok_per_s=total / wall_s if wall_s > 0 else 0.0,
        request_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        input_tokens_mean=statistics.fmean(inputs) if inputs else None,
        **_dist("ttft", ttfts, (50, 90, 99)),
        **_dist("tpot", tpots, (50, 90)),
        **_dist("itl", itls, (50, 90, 99)),
        **_dist("e2e", [r.e2e_s for r in ok], (50, 90)),
        token_sources=sorted({r.token_source for r in ok}),
        first_error=errors[0] if errors else None,
    )


@dataclass(frozen=True)
class Column:
    """One column of a report table: a LevelResult field and how to print it."""

    header: str
    key: str
    width: int
    kind: str  # "int" | "num" (2 decimals) | "rate" (2 decimals, ratio) | "mean" | "ms" (ratio)


THROUGHPUT_TABLE = (
    Column("conc", "concurrency", 5, "int"),
    Column("reqs", "requests", 6, "int"),
    Column("fail", "failed", 5, "int"),
    Column("out_tok", "output_tokens", 8, "int"),
    Column("wall_s", "wall_s", 8, "num"),
    Column("tok/s", "output_tok_per_s", 9, "rate"),
    Column("req/s", "request_per_s", 7, "rate"),
    Column("in_tok", "input_tokens_mean", 7, "mean"),
    Column("ttft_ms", "ttft_mean_s", 9, "ms"),
    Column("p50", "ttft_p50_s", 8, "ms"),
    Column("p90", "ttft_p90_s", 8, "ms"),
    Column("p99", "ttft_p99_s", 8, "ms"),
)
LATENCY_TABLE = (
    Column("conc", "concurrency", 5, "int"),
    Column("tpot_ms", "tpot_mean_s", 9, "ms"),
    Column("p50", "tpot_p50_s", 8, "ms"),
    Column("p90", "tpot_p90_s", 8, "ms"),
    Column("itl_ms", "itl_mean_s", 9, "ms"),
    Column("p50", "itl_p50_s", 8, "ms"),
    Column("p90", "itl_p90_s", 8, "ms"),
    Column("p99", "itl_p99_s", 8, "ms"),
    Column("e2e_ms", "e2e_mean_s", 9, "ms"),
    Column("p50", "e2e_p50_s", 8, "ms"),
    Column("p90", "e2e_p90_s", 8, "ms"),
)
TABLES = {
    "throughput and time to first token (ms; in_tok: mean prompt tokens)": THROUGHPUT_TABLE,
    "time per output token, inter-token and end-to-end latency (ms)": LATENCY_TABLE,
}
RATIO_FIELDS = tuple(c.key for table in TABLES.values() for c in table if c.kind in ("rate", "ms"))


def _cell(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "int":
        return str(value)
    if kind == "ms":
        return f"{value * 1000:.1f}"
    return f"{value:.0f}" if kind == "mean" else f"{value:.2f}"


def _row(name: str, lv: LevelResult, columns: tuple[Column, ...]) -> str:
    cells = (f"{_cell(getattr(lv, c.key), c.kind):>{c.width}}" for c in columns)
    return f"{name:<12}" + "".join(cells)


def _ratio_row(ratios: dict, columns: tuple[Column, ...]) -> str:
    def cell(c: Column) -> str:
        if c.key == "concurrency":
            return str(ratios["concurrency"])
        if c.key not in RATIO_FIELDS:
            return ""
        return "-" if ratios[c.key] is None else f"{ratios[c.key]:.2f}x"

    return f"{'ours/peer':<12}" + "".join(f"{cell(c):>{c.width}}" for c in columns)


def _ratio(ours: float | None, peer: float | None) -> float | None:
    if ours is None or peer is None or peer == 0:
        return None
    return ours / peer


def compute_ratios(ours: ServerResult, peer: ServerResult) -> list[dict]:
    """Per level, ours/peer for throughput and latencies (tok/s, req/s: higher is better)."""
    out = []
    for a, b in zip(ours.levels, peer.levels, strict=True):
        row: dict = {"concurrency": a.concurrency}
        for key in RATIO_FIELDS:
            row[key] = _ratio(getattr(a, key), getattr(b, key))
        out.append(row)
    return out


def _notes(servers: list[ServerResult], output_len: int, exact_output: bool) -> list[str]:
    """Caveats a reader of the tables needs: approximate counts, early stops, errors."""
    notes = []
    for s in servers:
        for lv in s.levels:
            where = f"{s.name} concurrency {lv.concurrency}"
            if "chunks" in lv.token_sources:
                notes.append(
                    f"note: {s.name} sent no usage or timings at concurrency {lv.concurrency}; "
                    "output tokens were counted as content chunks (approximate)"
                )
            ok = lv.requests - lv.failed
            if ok and lv.output_tokens < ok * output_len:
                hint = (
                    "the server ignored ignore_eos/min_tokens"
                    if exact_output
                    else "pass --exact-output to run every request to --output-len"
                )
                notes.append(
                    f"note: {where}: {lv.output_tokens / ok:.1f} output tokens per request, "
                    f"below --output-len {output_len} ({hint})"
                )
            if lv.first_error:
                notes.append(f"error: {where}: {lv.first_error}")
    return notes


def print_report(
    servers: list[ServerResult], ratios: list[dict] | None, output_len: int, exact_output: bool
) -> None:
    """Prints two tables, a row per server and level plus a ratio row per level with a peer.

    `output_len` and `exact_output` are the run's --output-len and --exact-output, for the notes
    on requests that stopped early.
    """
    print()
    for s in servers:
        print(f"{s.name}: {s.base_url} model={s.model}")
    for title, columns in TABLES.items():
        print(f"\n{title}")
        print(f"{'server':<12}" + "".join(f"{c.header:>{c.width}}" for c in columns))
        for i in range(len(servers[0].levels)):
            for s in servers:
                print(_row(s.name, s.levels[i], columns))
            if ratios:
                print(_ratio_row(ratios[i], columns))
    if ratios:
        print("ours/peer: above 1x is better for tok/s and req/s, below 1x for the latencies")
    for line in _notes(servers, output_len, exact_output):
        print(line)


def write_plot(servers: list[ServerResult], path: str) -> None:
    """A PNG with output tokens/s and p50 TTFT against concurrency, one line per server."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot as plt

    fig, (tput_ax, ttft_ax) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    levels = sorted({lv.concurrency for s in servers for lv in s.levels})
    for s in servers:
        conc = [lv.concurrency for lv in s.levels]
        ttft_ms = [float("nan") if v.ttft_p50_s is None else v.ttft_p50_s * 1e3 for v in s.levels]
        label = f"{s.name} ({s.model})"
        tput_ax.plot(conc, [lv.output_tok_per_s for lv in s.levels], marker="o", label=label)
        ttft_ax.plot(conc, ttft_ms, marker="o", label=label)
    for ax, ylabel in ((tput_ax, "output tokens/s"), (ttft_ax, "p50 time to first token (ms)")):
        if len(levels) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(
    path: str, config: dict, servers: list[ServerResult], ratios: list[dict] | None
) -> None:
    """Writes the run's settings, every number of every server and the ratios to `path`."""
    report = {
        "config": config,
        "servers": [asdict(s) for s in servers],
        "ratios_ours_over_peer": ratios,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
