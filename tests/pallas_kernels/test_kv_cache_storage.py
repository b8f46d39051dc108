"""Integer storage of a bfloat16 or float8 KV cache on CPU (``layout.storage_dtype``).

XLA:CPU scatters into a bfloat16 or float8 array by converting the whole array to a wider float
and back, so a KV write cost time in proportion to the cache. These tests pin the fix: the
compiled write converts nothing of the cache's size, the stored bits are the ones a float cache
holds, and every reader (reference, native kernel, Pallas kernel in interpret mode) returns the
same numbers from either storage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels.paged_attention import (
    FP8,
    KVCache,
    from_stored,
    kernel,
    kv_cache_shape,
    kv_scale_shape,
    native,
    reference,
    storage_dtype,
    to_stored,
    value_dtype,
    write_cache,
)

BF16 = jnp.dtype(jnp.bfloat16)
NUM_LAYERS, NUM_PAGES, PAGE_SIZE, KV_HEADS, HEADS, HEAD_DIM = 2, 12, 4, 2, 4, 16
on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="integer storage is CPU's")


def test_storage_dtype_is_an_integer_for_bf16_and_fp8_on_cpu_only():
    assert storage_dtype(BF16, "cpu") == jnp.uint16
    assert storage_dtype(FP8, "cpu") == jnp.uint8
    for dtype in (jnp.float32, jnp.float16):
        assert storage_dtype(dtype, "cpu") == dtype
    for backend in ("gpu", "tpu"):
        assert storage_dtype(BF16, backend) == BF16 and storage_dtype(FP8, backend) == FP8
    for dtype in (BF16, FP8, jnp.dtype(jnp.float32)):
        assert value_dtype(storage_dtype(dtype, "cpu")) == dtype
    x = jnp.asarray([1.3, -2.7, jnp.nan], jnp.float32)
    for stored in (jnp.uint16, jnp.uint8):
        assert to_stored(x, stored).dtype == stored
        np.testing.assert_array_equal(
            np.asarray(from_stored(to_stored(x, stored)), np.float32),
            np.asarray(x.astype(value_dtype(stored)), np.float32),
        )


@on_cpu
@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bfloat16", "float8"])
def test_zeros_stores_bits_and_reports_the_float_dtype(dtype):
    shape = kv_cache_shape(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    cache = KVCache.zeros(shape, dtype)
    assert cache.dtype == dtype
    assert cache.k.dtype == cache.v.dtype == storage_dtype(dtype)
    assert cache.k.dtype.itemsize == dtype.itemsize


def _full_cache_converts(cache: KVCache) -> list[str]:
    """Instructions of the compiled, donated one-token ``write_cache`` that convert an array of
    the whole cache's shape (XLA:CPU's upcast of a bfloat16 or float8 scatter)."""
    shape = ",".join(map(str, cache.k.shape))
    k = jnp.ones((1, 1, KV_HEADS, HEAD_DIM), jnp.float32)
    args = (jnp.array([[5]], jnp.int32), jnp.array([1], jnp.int32), jnp.arange(3)[None] + 2)

    def write(c: KVCache) -> KVCache:
        return write_cache(c, jnp.int32(1), k, k, *args)

    hlo = jax.jit(write, donate_argnums=0).lower(cache).compile().as_text()
    return [
        line.strip()
        for line in hlo.splitlines()
        if " convert(" in line and f"[{shape}]" in line.split(" convert(")[0]
    ]


@on_cpu
@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bfloat16", "float8"])
def test_cache_write_on_cpu_converts_nothing_of_the_cache_size(dtype):
    shape = kv_cache_shape(NUM_LAYERS, 64, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    assert _full_cache_converts(KVCache.zeros(shape, dtype)) == []
    # The same write into float storage is what this guards against. If XLA:CPU ever scatters
    # bfloat16 and float8 in place, this fails and the integer storage can go.
    float_stored = KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        k_scales=None if dtype == BF16 else jnp.zeros(kv_scale_shape(shape)),
        v_scales=None if dtype == BF16 else jnp.zeros(kv_scale_shape(shape)),
    )
    assert _full_cache_converts(float_stored), "XLA:CPU now scatters this dtype in place"


def _float_stored(cache: KVCache) -> KVCache:
    """``cache`` with its K and V in their float dtype (the storage other backends use)."""
    return cache.replace(k=from_stored(cache.k), v=from_stored(cache.v))


def _written(dtype: jnp.dtype, rng: np.random.Generator):
    """The same random history written into an integer-stored and a float-stored cache."""
    shape = kv_cache_shape(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    kv_lens = np.array([9, 1, 14], np.int32)
    page_indices = rng.permutation(NUM_PAGES)[:12].reshape(3, 4).astype(np.int32)
    stored = KVCache.zeros(shape, dtype)
    as_float = _float_stored(stored)
    write = jax.jit(write_cache)
    chunk = 5
    for start in range(0, int(kv_lens.max()), chunk):
        positions = (start + np.arange(chunk)[None, :].repeat(3, 0)).astype(np.int32)
        lens = np.clip(kv_lens - start, 0, chunk).astype(np.int32)
        k = rng.standard_normal((3, chunk, KV_HEADS, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((3, chunk, KV_HEADS, HEAD_DIM)).astype(np.float32)
        args = (jnp.int32(1), k, v, positions, lens, page_indices)
        stored, as_float = write(stored, *args), write(as_float, *args)
    return stored, as_float, kv_lens, page_indices


def _bits(x: jax.Array) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))


@on_cpu
@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bfloat16", "float8"])
def test_integer_storage_holds_the_float_caches_bits(dtype):
    stored, as_float, _, _ = _written(dtype, np.random.default_rng(0))
    assert stored.k.dtype == storage_dtype(dtype) and as_float.k.dtype == dtype
    for name in ("k", "v"):
        np.testing.assert_array_equal(_bits(getattr(stored, name)), _bits(getattr(as_float, name)))
    if dtype == FP8:
        np.testing.assert_array_equal(np.asarray(stored.k_scales), np.asarray(as_float.k_scales))
        np.testing.assert_array_equal(np.asarray(stored.v_scales), np.asarray(as_float.v_scales))
    assert np.any(_bits(stored.k)), "nothing was written"


def _readers() -> list[str]:
    return ["reference", "pallas"] + (["native"] if native.available() else [])


@on_cpu
@pytest.mark.parametrize("impl", _readers())
@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bfloat16", "float8"])
def test_attention_reads_integer_storage_as_its_floats(dtype, impl):
    rng = np.random.default_rng(1)
    stored, as_float, kv_lens, page_indices = _written(dtype, rng)
    q_len = 3
    positions = (kv_lens[:, None] - q_len + np.arange(q_len)).clip(0).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((3, q_len, HEADS, HEAD_DIM)), jnp.float32)

    def run(cache: KVCache) -> np.ndarray:
        args = (q, cache.k, cache.v, jnp.int32(1), positions, page_indices, kv_lens)
        kw = dict(scale=HEAD_DIM**-0.5, k_scales=cache.k_scales, v_scales=cache.v_scales)
        if impl == "pallas":
            return np.asarray(kernel.paged_attention(*args, **kw, interpret=True))
        if impl == "native":
            return np.asarray(native.paged_attention(*args, **kw))
        return np.asarray(reference.paged_attention(*args, **kw))

    got = run(stored)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, run(as_float))
