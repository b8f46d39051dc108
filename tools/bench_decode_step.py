"""One jitted decode step of a model for several weight formats, timed interleaved in one process.

Single-stream decode on a bandwidth-bound device is the step's weight bytes; this isolates the
step from the server (no HTTP, scheduling or sampling) so that formats compare on equal terms.
The formats are timed in turn, round after round, so machine noise hits all of them alike; the
best and median round per format are printed, with the ratio to the first format.

    .venv/bin/python tools/bench_decode_step.py --formats float,packed,int8,q4k --num-seqs 1,16

``float`` dequantizes a quantized checkpoint to float32 at load; ``packed`` keeps its quantized
tensors packed (what runtime-serve does); any ``--isq`` type re-quantizes the projections.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from models.batch import StepBatch
from models.registry import model_config_from_hf
from pallas_kernels.paged_attention import KVCache
from runtime.builder import load_checkpoint, resolve_dtype
from runtime.config import ISQ_CHOICES
from runtime.sources import resolve_model_source

PAGE_SIZE = 16


def _timed(fn, rounds: int, calls: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn()
        jax.block_until_ready(result)
        out.append((time.perf_counter() - start) / calls * 1e3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default="smollm2-135m-instruct")
    parser.add_argument("--formats", default="float,packed,int8")
    parser.add_argument("--num-seqs", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=128, help="KV positions per sequence")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    formats = args.formats.split(",")
    for name in formats:
        if name not in ("float", "packed", *ISQ_CHOICES):
            print(f"bench_decode_step: unknown format {name!r}", file=sys.stderr)
            return 2
    checkpoint = load_checkpoint(resolve_model_source(args.model_id, None))
    spec, base = model_config_from_hf(checkpoint.config)
    dtype = resolve_dtype(args.dtype)
    models = {}
    for name in formats:
        quantization = None if name in ("float", "packed") else name
        config = dataclasses.replace(base, quantization=quantization)
        tensors = checkpoint.tensors(packed=name != "float")
        models[name] = (config, spec.load(config, tensors, dtype, checkpoint.num_tensors))
    print(f"{args.model_id}: decode step ms at context {args.context} ({jax.default_backend()})")
    for num_seqs in (int(n) for n in args.num_seqs.split(",")):
        pages = -(-(args.context + 1) // PAGE_SIZE)
        k_shape, v_shape = base.cache_shapes(num_seqs * pages, PAGE_SIZE)
        batch = StepBatch(
            tokens=jnp.ones((num_seqs, 1), jnp.int32),
            positions=jnp.full((num_seqs, 1), args.context, jnp.int32),
            q_lens=jnp.ones((num_seqs,), jnp.int32),
            kv_lens=jnp.full((num_seqs,), args.context + 1, jnp.int32),
            page_indices=jnp.arange(num_seqs * pages, dtype=jnp.int32).reshape(num_seqs, pages),
        )
        steps = {}
        for name, (config, weights) in models.items():
            cache = KVCache.zeros(k_shape, dtype, v_shape)
            step = jax.jit(
                lambda w, c, config=config, batch=batch: spec.forward(config, w, c, batch)[0]
            )
            jax.block_until_ready(step(weights, cache))
            steps[name] = lambda step=step, w=weights, c=cache: step(w, c)
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, run in steps.items():
                times[name] += _timed(run, 1, 5)
        first = min(times[formats[0]])
        for name, ms in times.items():
            best, median = min(ms), statistics.median(ms)
            print(
                f"  {num_seqs:>3} seqs {name:>7}: best {best:7.1f}  median {median:7.1f}  "
                f"({first / best:.2f}x the speed of {formats[0]})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
