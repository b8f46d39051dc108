"""How a decode step should walk its layers on an accelerator: the same bfloat16 projections
(Llama-3-8B's layer shapes by default) run four ways, timed and traced in one process.

- ``scan``: the weights stacked ``[layers, ...]`` and the layers under ``lax.scan`` (what the
  models do: ``models.layers.decoder_layer.Segment``);
- ``scan-unrolled``: the same scan with ``unroll=True``;
- ``static-index``: the stacked weights indexed ``w[i]`` in a Python loop;
- ``per-layer``: one array per layer and weight (no stacked array at all).

Each row prints the best step time, its bandwidth over the weights' bytes, and the device time of
``memcpy`` kernels in a traced call (a layer loop that copies each layer's slice of a stacked
weight before its matmul reads the weights twice).

    python tools/bench_layer_loop.py [--layers 8] [--rows 1,64] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_summary import summarize


def _layer(x, wqkv, wo, wgu, wd):
    d, f = x.shape[-1], wd.shape[0]
    x = x + (x @ wqkv)[:, :d] @ wo
    h = x @ wgu
    return x + (jax.nn.silu(h[:, :f]) * h[:, f:]) @ wd


def variants(layers: int):
    def scan(x, stacked):
        def body(x, w):
            return _layer(x, *w), None

        return jax.lax.scan(body, x, stacked)[0]

    def scan_unrolled(x, stacked):
        def body(x, w):
            return _layer(x, *w), None

        return jax.lax.scan(body, x, stacked, unroll=True)[0]

    def static_index(x, stacked):
        for i in range(layers):
            x = _layer(x, *(w[i] for w in stacked))
        return x

    def per_layer(x, split):
        for ws in split:
            x = _layer(x, *ws)
        return x

    return {
        "scan": (scan, False),
        "scan-unrolled": (scan_unrolled, False),
        "static-index": (static_index, False),
        "per-layer": (per_layer, True),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--tiny", action="store_true", help="small shapes (a CPU check)")
    args = parser.parse_args()
    d, f, kv = (64, 128, 32) if args.tiny else (4096, 14336, 1024)
    shapes = [(d, d + 2 * kv), (d, d), (d, 2 * f), (f, d)]
    key = jax.random.PRNGKey(0)
    stacked = tuple(
        (jax.random.normal(jax.random.fold_in(key, i), (args.layers, *s)) * 0.02).astype(
            jnp.bfloat16
        )
        for i, s in enumerate(shapes)
    )
    split = [tuple(w[i] for w in stacked) for i in range(args.layers)]
    total = sum(w.size * 2 for w in stacked)
    print(f"{jax.devices()[0].device_kind}: {args.layers} layers, {total / 1e9:.2f} GB of weights")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.full((rows, d), 0.01, jnp.bfloat16)
        for name, (fn, is_split) in variants(args.layers).items():
            step = jax.jit(fn)
            ws = split if is_split else stacked
            jax.block_until_ready(step(x, ws))
            best = float("inf")
            for _ in range(20):
                t0 = time.perf_counter()
                jax.block_until_ready(step(x, ws))
                best = min(best, time.perf_counter() - t0)
            with tempfile.TemporaryDirectory() as tmp:
                with jax.profiler.trace(tmp, create_perfetto_trace=True):
                    jax.block_until_ready(step(x, ws))
                trace = summarize(Path(tmp), top=40)
            copies = sum(us for n, us, _, _ in trace["kernels"] if "memcpy" in n or "copy" in n)
            row = {
                "rows": rows,
                "loop": name,
                "best_ms": round(best * 1e3, 3),
                "GBps": round(total / best / 1e9, 1),
                "traced_us": trace["total_us"],
                "copy_us": round(copies, 1),
            }
            print("LOOP " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
