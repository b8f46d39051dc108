"""Paged attention alone: the native CPU kernel against the pure-jnp reference, in one process.

Times what a model step spends in attention: a ``lax.scan`` over the layers (each layer's output
is the next layer's query, as in the decoder) of one implementation, reading the whole stacked
cache with the layer index, over pages scattered at random through a cache with room for every
sequence. The two implementations are timed in turn, round after round, so machine noise hits
both alike; the best round of each is printed with the speed-up of the native kernel.

    .venv/bin/python tools/bench_paged_attention.py --num-seqs 1,16 --contexts 128,256,512,1024

The default shape is SmolLM2-135M's (30 layers, 9 query heads over 3 KV heads of 64, pages of
16). ``--q-len`` above 1 times prefill chunks of that many tokens ending at each context.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.pallas_kernels.paged_attention import FP8, native, quantize_rows, reference

IMPLS = {"reference": reference.paged_attention, "native": native.paged_attention}


def _inputs(args: argparse.Namespace, num_seqs: int, context: int, rng: np.random.Generator):
    """Query, cache (values and, for fp8, row scales) and batch metadata of one shape."""
    pages_per_seq = -(-context // args.page_size)
    num_pages = num_seqs * pages_per_seq + 1
    shape = (args.layers, num_pages, args.page_size, args.kv_heads, args.head_dim)
    k, v = (rng.standard_normal(shape, np.float32) for _ in range(2))
    scales = {}
    if args.cache_dtype == "fp8":
        (k, ks), (v, vs) = quantize_rows(jnp.asarray(k)), quantize_rows(jnp.asarray(v))
        scales = {"k_scales": ks, "v_scales": vs}
    else:
        k, v = jnp.asarray(k, args.cache_dtype), jnp.asarray(v, args.cache_dtype)
    page_indices = rng.permutation(num_pages)[: num_seqs * pages_per_seq].astype(np.int32)
    positions = np.arange(context - args.q_len, context, dtype=np.int32)
    meta = {
        "positions": jnp.asarray(np.tile(positions, (num_seqs, 1))),
        "page_indices": jnp.asarray(page_indices.reshape(num_seqs, pages_per_seq)),
        "kv_lens": jnp.full((num_seqs,), context, jnp.int32),
    }
    q = jnp.asarray(
        rng.standard_normal((num_seqs, args.q_len, args.heads, args.head_dim), np.float32)
    )
    return q, k, v, scales, meta


def _layer_scan(impl, args: argparse.Namespace, meta: dict, scales: dict):
    def run(q, k, v, scales):
        def body(x, layer):
            out = impl(
                x, k, v, layer, meta["positions"], meta["page_indices"], meta["kv_lens"],
                scale=args.head_dim**-0.5, **scales,
            )  # fmt: skip
            return out, None

        return jax.lax.scan(body, q, jnp.arange(args.layers, dtype=jnp.int32))[0]

    return jax.jit(run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", default="1,16")
    parser.add_argument("--contexts", default="128,256,512,1024", help="KV positions per sequence")
    parser.add_argument("--q-len", type=int, default=1, help="query tokens per sequence")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--cache-dtype", default="float32", choices=("float32", "float16", "bfloat16", "fp8")
    )
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not native.available():
        print("bench_paged_attention: the native kernel is unavailable", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    dtype = FP8.name if args.cache_dtype == "fp8" else args.cache_dtype
    print(
        f"paged attention, {args.layers} layers, {args.heads}/{args.kv_heads} heads of "
        f"{args.head_dim}, {dtype} cache, q_len {args.q_len}: ms per step "
        f"({jax.default_backend()}, best of {args.rounds})"
    )
    for num_seqs in (int(n) for n in args.num_seqs.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            q, k, v, scales, meta = _inputs(args, num_seqs, context, rng)
            runs = {name: _layer_scan(impl, args, meta, scales) for name, impl in IMPLS.items()}
            outs = {name: run(q, k, v, scales) for name, run in runs.items()}
            diff = float(jnp.max(jnp.abs(outs["native"] - outs["reference"])))
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(args.rounds):
                for name, run in runs.items():
                    start = time.perf_counter()
                    jax.block_until_ready(run(q, k, v, scales))
                    best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
            print(
                f"  {num_seqs:>3} seqs, context {context:>5}: reference {best['reference']:8.2f}"
                f"  native {best['native']:7.2f}  speed-up {best['reference'] / best['native']:5.2f}x"
                f"  (max |diff| {diff:.1e})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
