"""Time to ready of ``runtime-serve`` quantizing at load against restoring a prepared checkpoint,
and whether both serve the same greedy tokens (BENCHMARKS.md, "Prepared checkpoints").

    .venv/bin/python tools/bench_prepared.py --model-id gemma3-270m --isq q4k --runs 3

1. ``runtime-serve --model-id M --isq Q --save-prepared DIR`` once, timed.
2. One start of each kind, not counted: it fills the persistent compilation cache, so every
   counted start compiles nothing (both serve the same shapes and shardings).
3. ``--runs`` starts of each kind, alternating: the seconds from launching the process to its
   ``Serving ... on`` line (printed once the engine has warmed up and the socket listens), and
   the greedy completions of ``PROMPTS`` (the first start of each kind).
4. ``--runs`` times, in a fresh process each, ``builder.load_model`` alone for each kind: the
   part of a start that the prepared checkpoint replaces.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVE = [sys.executable, "-m", "jax_llm_runtime.api.cli.serve"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "The sky is blue because"]
LOAD_ONLY = """
import sys, time
from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.loading.builder import load_model
import jax
start = time.perf_counter()
model = load_model(EngineConfig(model_id=sys.argv[1], isq=sys.argv[2] or None))
jax.block_until_ready(model.weights)
print(time.perf_counter() - start)
"""


def _start(args: list[str]) -> tuple[float, list[str]]:
    """Seconds from launch to the ready line, and the greedy completions of ``PROMPTS``."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*SERVE, "--port", "0", "--log-level", "warning", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        ready = time.perf_counter() - started
        if " on http://" not in line:
            raise SystemExit(f"runtime-serve {' '.join(args)} did not start: {line!r}")
        url = line.split(" on ", 1)[1].split()[0]
        return ready, [_complete(url, prompt) for prompt in PROMPTS]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _complete(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    request = urllib.request.Request(
        f"{url}/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["text"]


def _load_seconds(model_id: str, isq: str | None) -> float:
    out = subprocess.run(
        [sys.executable, "-c", LOAD_ONLY, model_id, isq or ""],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default="gemma3-270m")
    parser.add_argument("--isq", default="q4k")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    kinds = {"quantize at load": ["--model-id", args.model_id, "--isq", args.isq]}
    with tempfile.TemporaryDirectory(prefix="prepared-") as tmp:
        target = Path(tmp) / "prepared"
        started = time.perf_counter()
        subprocess.run(
            [*SERVE, *kinds["quantize at load"], "--save-prepared", str(target)],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        print(f"--save-prepared: {time.perf_counter() - started:.1f} s")
        kinds["prepared checkpoint"] = ["--model-id", str(target)]
        for kind_args in kinds.values():
            _start(kind_args)  # fills the compilation cache
        ready = {kind: [] for kind in kinds}
        texts = {}
        for _ in range(args.runs):
            for kind, kind_args in kinds.items():
                seconds, completions = _start(kind_args)
                ready[kind].append(seconds)
                texts.setdefault(kind, completions)
        sources = {
            "quantize at load": (args.model_id, args.isq),
            "prepared checkpoint": (str(target), None),
        }
        load = {kind: [_load_seconds(*sources[kind]) for _ in range(args.runs)] for kind in kinds}
    for kind in kinds:
        print(
            f"{kind:>20}: ready {statistics.median(ready[kind]):6.2f} s "
            f"(runs {', '.join(f'{s:.2f}' for s in ready[kind])}), "
            f"load_model {statistics.median(load[kind]):6.2f} s"
        )
    quantize, prepared = (statistics.median(ready[k]) for k in kinds)
    load_q, load_p = (statistics.median(load[k]) for k in kinds)
    print(f"speed-up: ready {quantize / prepared:.2f}x, load_model {load_q / load_p:.2f}x")
    same = texts["quantize at load"] == texts["prepared checkpoint"]
    print(f"greedy completions identical: {same}")
    for prompt, text in zip(PROMPTS, texts["prepared checkpoint"], strict=True):
        print(f"  {prompt!r} -> {text!r}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
