"""What a KV write costs against the size of the cache: the donated one-token ``write_cache``
alone, and a served engine's single-stream decode speed, at several cache sizes and dtypes.

XLA:CPU scatters into a bfloat16 or float8 array by converting the whole array to a wider float
and back, so a write into such a cache in float storage costs time in proportion to the cache
(``pallas_kernels/paged_attention/layout.py``: on CPU ``KVCache.zeros`` stores those dtypes as
integers). The write is timed on the cache ``KVCache.zeros`` makes and, beside it in the same
process, on the same cache in float storage (the layout every cache had before).

    .venv/bin/python tools/bench_kv_write.py --dtypes bfloat16,fp8,float32 --pages 256,8192
    .venv/bin/python tools/bench_kv_write.py --model /path/to/hf-folder --kvcache-mb 4,64,256

The cache of the write timing is ``[2, pages, 16, 2, 64]``. ``--model`` serves that checkpoint
(``--model-dtype`` weights, one sequence, greedy, EOS ignored) with each ``--dtypes`` cache at
each ``--kvcache-mb`` size and prints the decode speed after the first token.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

from jax_llm_runtime.pallas_kernels.paged_attention import FP8, KVCache, kv_scale_shape, write_cache

PROMPT = list(range(1, 33))  # 32 token ids every vocabulary has


def _cache_dtype(name: str) -> jnp.dtype:
    return FP8 if name == "fp8" else jnp.dtype(name)


def _float_stored(shape: tuple[int, ...], dtype: jnp.dtype) -> KVCache:
    """A zeroed cache kept in its float dtype whatever the backend."""

    def scales() -> jax.Array | None:
        return jnp.zeros(kv_scale_shape(shape)) if dtype == FP8 else None

    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), k_scales=scales(),
                   v_scales=scales())  # fmt: skip


def _time_write(cache: KVCache, rounds: int) -> float:
    """Median ms of a donated, jitted one-token ``write_cache`` into ``cache``."""
    k = jnp.ones((1, 1, *cache.k.shape[3:]), jnp.float32)
    positions, q_lens = jnp.array([[5]], jnp.int32), jnp.array([1], jnp.int32)
    page_indices = jnp.arange(4, dtype=jnp.int32)[None] + 3

    def write(c: KVCache) -> KVCache:
        return write_cache(c, jnp.int32(1), k, k, positions, q_lens, page_indices)

    step = jax.jit(write, donate_argnums=0)
    cache = jax.block_until_ready(step(cache))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        cache = jax.block_until_ready(step(cache))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_write(dtypes: list[str], pages: list[int], rounds: int) -> None:
    print("| cache | pages | MiB (K) | storage | write, float storage | write, as stored |")
    print("|---|---:|---:|---|---:|---:|")
    for name in dtypes:
        dtype = _cache_dtype(name)
        for n in pages:
            shape = (2, n, 16, 2, 64)
            stored = KVCache.zeros(shape, dtype)
            mib = stored.k.size * stored.k.dtype.itemsize / 2**20
            as_float = _time_write(_float_stored(shape, dtype), rounds)
            as_stored = _time_write(stored, rounds)
            print(f"| {name} | {n} | {mib:.0f} | {stored.k.dtype.name} | {as_float:.3f} ms "
                  f"| {as_stored:.3f} ms |", flush=True)  # fmt: skip


def _decode_speed(engine: Any, max_tokens: int) -> float:
    """Tokens per second of one greedy request after its first token."""
    from jax_llm_runtime.runtime.engine.request import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def run() -> list[float]:
        stamps: list[float] = []
        async for delta in engine.generate(PROMPT, sampling, "bench"):
            stamps += [time.perf_counter()] * len(delta.token_ids)
        return stamps

    stamps = asyncio.run(run())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def bench_engine(args: argparse.Namespace) -> None:
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    print("| cache | --kvcache-mem MB | storage | decode tok/s |")
    print("|---|---:|---|---:|")
    for name in args.dtypes.split(","):
        for mb in (int(m) for m in args.kvcache_mb.split(",")):
            config = EngineConfig(model_id=args.model, dtype=args.model_dtype, max_num_seqs=1,
                                  max_model_len=512, kv_cache_dtype=name, kvcache_mem_mb=mb)  # fmt: skip
            engine = build_engine(config)
            engine.start()
            try:
                engine.compile_done.wait(600)
                speed = _decode_speed(engine, args.tokens)
                storage = engine.runner.cache.k.dtype.name
            finally:
                engine.shutdown()
            print(f"| {name} | {mb} | {storage} | {speed:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,fp8,float32",
                        help="cache dtypes: bfloat16, float16, float32, fp8")  # fmt: skip
    parser.add_argument("--pages", default="256,8192", help="page counts of the write timing")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--model", help="an HF checkpoint folder: also time a served engine")
    parser.add_argument("--model-dtype", default="float32")
    parser.add_argument("--kvcache-mb", default="4,64,256")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"backend {jax.default_backend()}, jax {jax.__version__}")
    bench_write(args.dtypes.split(","), [int(p) for p in args.pages.split(",")], args.rounds)
    if args.model:
        bench_engine(args)


if __name__ == "__main__":
    main()
