"""The float8 (e4m3) KV cache: row quantization, ``write_cache``, and both attention paths.

Tolerances follow from e4m3fn's 3 mantissa bits: rounding to nearest moves a normal value by at
most 2^-4 of itself, and a value below the smallest normal (2^-6 after scaling) by at most half
the subnormal step, 2^-10 times the row's scale. Reading is checked exactly (against the float
reference on the dequantised cache); the end-to-end error of attention against the unquantised
cache is bounded by those per-element errors, measured on unit-normal data.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels.paged_attention import (
    FP8,
    KVCache,
    attention,
    kernel,
    kv_cache_bytes,
    kv_cache_shape,
    kv_scale_shape,
    quantize_rows,
    reference,
    storage_dtype,
    write_cache,
)
from tests.pallas_kernels.test_paged_attention_kernel import (
    CHUNK_7,
    DECODE,
    HEAD_DIM,
    TOL,
    Case,
    assert_matches,
    make_case,
)


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    return values.astype(jnp.float32) * scales[..., None]


def test_quantize_rows_error_bound_and_range():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    for magnitude in (1e-4, 1.0, 1e4):  # far below and far above e4m3's [2^-9, 448]
        rows = x * magnitude
        values, scales = quantize_rows(jnp.asarray(rows))
        assert values.dtype == FP8 and scales.dtype == jnp.float32
        err = np.abs(np.asarray(dequantize(values, scales)) - rows)
        bound = np.maximum(2**-4 * np.abs(rows), 2**-10 * np.asarray(scales)[:, None])
        assert (err <= bound * (1 + 1e-6)).all()
        # Each row's largest element lands on 448 exactly: the full range is used, nothing clips.
        np.testing.assert_array_equal(np.abs(np.asarray(values, np.float32)).max(-1), 448.0)
    # A plain cast (a per-tensor scale of 1) turns the large rows into NaN: e4m3fn has no inf.
    assert np.isnan(np.asarray(jnp.asarray(x * 1e4).astype(FP8), np.float32)).any()
    values, scales = quantize_rows(jnp.zeros((2, 8)))
    assert not np.asarray(values, np.float32).any() and not np.asarray(scales).any()


def test_cache_shapes_bytes_and_zeros():
    shape = kv_cache_shape(2, 5, 4, 3, 64)
    assert kv_scale_shape(shape) == (2, 5, 4, 3)
    cache = KVCache.zeros(shape, FP8)
    assert cache.dtype == FP8 and cache.k_scales.shape == cache.v_scales.shape == (2, 5, 4, 3)
    assert cache.k.dtype == storage_dtype(FP8)  # uint8 on CPU (see test_kv_cache_storage.py)
    rows = 2 * 5 * 4 * 3
    assert kv_cache_bytes(shape, shape, FP8) == 2 * rows * (64 + 4)
    assert kv_cache_bytes(shape, shape, jnp.float32) == 2 * rows * 64 * 4
    assert KVCache.zeros(shape, jnp.float32).k_scales is None
    # A zero-width V (MLA) has nothing to scale.
    mla = KVCache.zeros(shape, FP8, (*shape[:4], 0))
    assert mla.k_scales is not None and mla.v_scales is None
    assert kv_cache_bytes(shape, (*shape[:4], 0), FP8) == rows * (64 + 4)
    with pytest.raises(ValueError, match="float8_e5m2 KV cache is not supported"):
        KVCache.zeros(shape, jnp.float8_e5m2)


NUM_LAYERS, NUM_PAGES, PAGE_SIZE, KV_HEADS, HEADS = 2, 24, 4, 2, 6
KEY_GAIN = 600.0


def _write_history(cache: KVCache, kv_lens: np.ndarray, page_indices: np.ndarray, chunk: int, rng):
    """Every sequence's K/V written through ``write_cache`` ``chunk`` tokens at a time; returns
    the cache and the float K/V that went in, [seq] of [kv_len, kv_heads, head_dim]."""
    num_seqs = len(kv_lens)
    ks = [rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float32) for n in kv_lens]
    vs = [rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float32) for n in kv_lens]
    ks[0] *= KEY_GAIN  # one sequence whose keys exceed e4m3's range, as some models' do
    write = jax.jit(write_cache)
    for start in range(0, int(kv_lens.max()), chunk):
        positions = (start + np.arange(chunk)[None, :].repeat(num_seqs, 0)).astype(np.int32)
        lens = np.clip(kv_lens - start, 0, chunk).astype(np.int32)
        kb = np.zeros((num_seqs, chunk, KV_HEADS, HEAD_DIM), np.float32)
        vb = np.zeros_like(kb)
        for s in range(num_seqs):
            kb[s, : lens[s]] = ks[s][start : start + lens[s]]
            vb[s, : lens[s]] = vs[s][start : start + lens[s]]
        cache = write(cache, jnp.int32(1), kb, vb, positions, lens, page_indices)
    return cache, ks, vs


@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, 3.0)])
def test_write_cache_and_reference_against_float(window, soft_cap):
    rng = np.random.default_rng(1)
    kv_lens = np.array([9, 1, 14], np.int32)  # odd lengths, one sequence with a single token
    q_lens = np.array([3, 1, 5], np.int32)
    q_len, pages_per_seq = 5, 4
    page_indices = rng.permutation(NUM_PAGES)[: 3 * pages_per_seq].astype(np.int32)
    page_indices = page_indices.reshape(3, pages_per_seq)
    shape = kv_cache_shape(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    nan = KVCache(  # every row nobody writes, and its scale, is NaN
        k=jnp.full(shape, jnp.nan, FP8),
        v=jnp.full(shape, jnp.nan, FP8),
        k_scales=jnp.full(shape[:4], jnp.nan),
        v_scales=jnp.full(shape[:4], jnp.nan),
    )
    fp8, ks, vs = _write_history(nan, kv_lens, page_indices, q_len, rng)
    float_cache = _float_cache_of(shape, ks, vs, page_indices)
    positions = np.stack([kv_lens[s] - q_lens[s] + np.arange(q_len) for s in range(3)])
    q = rng.standard_normal((3, q_len, HEADS, HEAD_DIM)).astype(np.float32)
    q[0] /= KEY_GAIN  # large keys, ordinary scores
    args = (jnp.int32(1), positions.astype(np.int32), page_indices, kv_lens)
    kw = dict(scale=HEAD_DIM**-0.5, sliding_window=window, soft_cap=soft_cap)
    scales = dict(k_scales=fp8.k_scales, v_scales=fp8.v_scales)
    out = np.asarray(reference.paged_attention(q, fp8.k, fp8.v, *args, **kw, **scales))
    valid = np.arange(q_len)[None, :] < q_lens[:, None]  # [num_seqs, q_len]
    assert np.isfinite(out).all(), "a NaN row or scale of an unused slot leaked"

    # Reading: exactly the float reference on the dequantised cache.
    deq_k, deq_v = dequantize(fp8.k, fp8.k_scales), dequantize(fp8.v, fp8.v_scales)
    exact = np.asarray(reference.paged_attention(q, deq_k, deq_v, *args, **kw))
    np.testing.assert_allclose(out[valid], exact[valid], rtol=1e-6, atol=1e-6)
    # NaN in unused slots changes nothing, bit for bit.
    zeroed = jax.tree.map(jnp.nan_to_num, fp8)
    out0 = reference.paged_attention(
        q, zeroed.k, zeroed.v, *args, **kw, k_scales=zeroed.k_scales, v_scales=zeroed.v_scales
    )
    np.testing.assert_array_equal(out, np.asarray(out0))

    # Against the unquantised cache: V rows are unit normal (|v| < ~4), so V's 2^-4 relative
    # rounding moves an output by at most ~0.25 and on average far less; K's rounding shifts the
    # softmax weights by a few percent. Measured here: max ~0.06, mean ~0.01.
    ref = np.asarray(reference.paged_attention(q, float_cache.k, float_cache.v, *args, **kw))
    err = np.abs(out[valid] - ref[valid])
    assert err.max() < 0.15 and err.mean() < 0.03, (err.max(), err.mean())


def _float_cache_of(shape, ks, vs, page_indices) -> KVCache:
    k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    for s, (ks_s, vs_s) in enumerate(zip(ks, vs, strict=True)):
        t = np.arange(len(ks_s))
        page, offset = page_indices[s, t // PAGE_SIZE], t % PAGE_SIZE
        k[1, page, offset], v[1, page, offset] = ks_s, vs_s
    return KVCache(k=jnp.asarray(k), v=jnp.asarray(v))


@dataclasses.dataclass(frozen=True)
class Fp8Case:
    case: Case  # the float8 values, NaN in every slot the sequences do not own
    k_scales: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads], NaN where unowned
    v_scales: jax.Array

    def scales(self) -> dict[str, jax.Array]:
        return dict(k_scales=self.k_scales, v_scales=self.v_scales)


def fp8_case(*args, **kwargs) -> Fp8Case:
    """``make_case``'s shuffled, NaN-filled cache, quantised row by row (NaN rows: NaN scales)."""
    case = make_case(*args, **kwargs)
    k, ks = quantize_rows(case.k_cache * KEY_GAIN)  # keys past e4m3's range
    v, vs = quantize_rows(case.v_cache)
    ks = jnp.where(jnp.isnan(case.k_cache).any(-1), jnp.nan, ks)
    vs = jnp.where(jnp.isnan(case.v_cache).any(-1), jnp.nan, vs)
    # Large keys, ordinary scores: a sharply peaked softmax would hide errors.
    case = dataclasses.replace(case, q=case.q / KEY_GAIN, k_cache=k, v_cache=v)
    return Fp8Case(case, ks, vs)


def _zeroed(fc: Fp8Case) -> tuple[tuple, dict[str, jax.Array]]:
    """The case's arguments and scales with every NaN (unused slots) replaced by zero."""
    case, zero = fc.case, jnp.nan_to_num
    args = case.args(k_cache=zero(case.k_cache), v_cache=zero(case.v_cache))
    return args, dict(k_scales=zero(fc.k_scales), v_scales=zero(fc.v_scales))


def test_kernel_matches_reference_on_fp8_decode():
    fc = fp8_case(*DECODE, 8, 2)
    case = fc.case
    assert np.isnan(np.asarray(case.k_cache, np.float32)).any()
    assert np.isnan(np.asarray(fc.k_scales)).any()
    f = jax.jit(lambda *a, **s: kernel.paged_attention(*a, scale=0.25, interpret=True, **s))
    out = f(*case.args(), **fc.scales())
    assert_matches(
        out, reference.paged_attention(*case.args(), scale=0.25, **fc.scales()), case.seen()
    )
    # NaN in unused slots (values and scales) changes nothing, bit for bit.
    args, scales = _zeroed(fc)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(f(*args, **scales)))


def test_kernel_matches_reference_on_fp8_chunk_through_the_entry_point():
    # GQA, a window, a soft-cap, split-K, and per-tensor scales on top of the row scales.
    fc = fp8_case(*CHUNK_7, 8, 2)
    case = fc.case
    kw = dict(scale=HEAD_DIM**-0.5, sliding_window=4, soft_cap=3.0, k_scale=0.5, v_scale=2.0)
    f = jax.jit(lambda *a, **s: attention(*a, impl="pallas", **kw, **s))
    out = f(*case.args(), **fc.scales())
    ref = attention(*case.args(), impl="reference", **kw, **fc.scales())
    assert_matches(out, ref, case.seen(4))
    k = dequantize(case.k_cache, fc.k_scales) * 0.5
    v = dequantize(case.v_cache, fc.v_scales) * 2.0
    plain = reference.paged_attention(
        *case.args(k_cache=k, v_cache=v), scale=kw["scale"], sliding_window=4, soft_cap=3.0
    )
    seen = case.seen(4)
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(plain)[seen], rtol=TOL, atol=TOL)
    args, scales = _zeroed(fc)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(f(*args, **scales)))


def test_rejects_bad_scales():
    fc = fp8_case(*DECODE, 4, 2)
    case = fc.case
    for f in (
        reference.paged_attention,
        lambda *a, **k: kernel.paged_attention(*a, **k, interpret=True),
    ):
        with pytest.raises(ValueError, match="both k_scales and v_scales"):
            f(*case.args(), scale=1.0, k_scales=fc.k_scales)
        with pytest.raises(ValueError, match="k_scales must be"):
            f(*case.args(), scale=1.0, k_scales=fc.k_scales[:, :1], v_scales=fc.v_scales)
