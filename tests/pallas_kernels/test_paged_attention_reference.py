"""The paged reference against dense causal attention, on adversarial page tables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels.paged_attention import (
    KVCache,
    kv_cache_shape,
    paged_attention,
    write_kv,
)

NUM_LAYERS, NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, HEADS = 2, 32, 4, 2, 8, 6


def dense_attention(q, k, v, q_pos, window=None, soft_cap=None):
    """q: [q_len, heads, d]; k, v: [kv_len, kv_heads, d]; plain causal attention in float64."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1).astype(np.float64)
    v = np.repeat(v, group, axis=1).astype(np.float64)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    if soft_cap:
        s = soft_cap * np.tanh(s / soft_cap)
    key_pos = np.arange(k.shape[0])
    mask = key_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= key_pos[None, :] > q_pos[:, None] - window
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (None, 3.0)])
def test_matches_dense_with_shuffled_pages_and_nan_padding(window, soft_cap):
    rng = np.random.default_rng(0)
    kv_lens = np.array([9, 1, 14], np.int32)  # odd lengths, one sequence with a single token
    q_lens = np.array([3, 1, 5], np.int32)
    q_len, pages_per_seq = 5, 4
    perm = rng.permutation(NUM_PAGES).astype(np.int32)
    page_indices = perm[: 3 * pages_per_seq].reshape(3, pages_per_seq)
    shape = kv_cache_shape(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    cache = KVCache(k=jnp.full(shape, jnp.nan), v=jnp.full(shape, jnp.nan))  # stale pages: NaN
    layer = jnp.int32(1)
    ks = [rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float32) for n in kv_lens]
    vs = [rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float32) for n in kv_lens]
    # Write every sequence's full history through write_kv, q_len tokens at a time.
    k_cache, v_cache = cache.k, cache.v
    for start in range(0, int(kv_lens.max()), q_len):
        pos = np.minimum(start + np.arange(q_len)[None, :].repeat(3, 0), 10**6).astype(np.int32)
        lens = np.clip(kv_lens - start, 0, q_len).astype(np.int32)
        kb = np.zeros((3, q_len, KV_HEADS, HEAD_DIM), np.float32)
        vb = np.zeros_like(kb)
        for s in range(3):
            kb[s, : lens[s]] = ks[s][start : start + lens[s]]
            vb[s, : lens[s]] = vs[s][start : start + lens[s]]
        k_cache, v_cache = write_kv(
            k_cache,
            v_cache,
            layer,
            jnp.asarray(kb),
            jnp.asarray(vb),
            jnp.asarray(pos),
            jnp.asarray(lens),
            jnp.asarray(page_indices),
        )
    positions = np.stack([kv_lens[s] - q_lens[s] + np.arange(q_len) for s in range(3)]).astype(
        np.int32
    )
    q = rng.standard_normal((3, q_len, HEADS, HEAD_DIM)).astype(np.float32)
    out = paged_attention(
        jnp.asarray(q),
        k_cache,
        v_cache,
        layer,
        jnp.asarray(positions),
        jnp.asarray(page_indices),
        jnp.asarray(kv_lens),
        scale=HEAD_DIM**-0.5,
        sliding_window=window,
        soft_cap=soft_cap,
    )
    out = np.asarray(out)
    for s in range(3):
        ref = dense_attention(
            q[s, : q_lens[s]], ks[s], vs[s], positions[s, : q_lens[s]], window, soft_cap
        )
        np.testing.assert_allclose(out[s, : q_lens[s]], ref, rtol=2e-5, atol=2e-5)
    assert np.isfinite(out).all(), "padding rows and NaN-filled pages must not produce NaN"
    assert np.isnan(np.asarray(k_cache[0])).all(), "writes must touch only the given layer"


def test_padding_tokens_write_nothing():
    shape = kv_cache_shape(1, 4, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = jnp.zeros(shape)
    ones = jnp.ones((1, 3, KV_HEADS, HEAD_DIM))
    k_cache, _ = write_kv(
        k_cache,
        k_cache,
        jnp.int32(0),
        ones,
        ones,
        jnp.array([[0, 1, 2]], jnp.int32),
        jnp.array([1], jnp.int32),
        jnp.array([[2, 3]], jnp.int32),
    )
    written = np.asarray(k_cache[0]).sum(axis=(2, 3))
    assert written[2, 0] == KV_HEADS * HEAD_DIM and written.sum() == KV_HEADS * HEAD_DIM


def test_rejects_bad_shapes():
    shape = kv_cache_shape(1, 4, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    cache = jnp.zeros(shape)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(
            jnp.zeros((1, 1, 3, HEAD_DIM)),
            cache,
            cache,
            jnp.int32(0),
            jnp.zeros((1, 1), jnp.int32),
            jnp.zeros((1, 1), jnp.int32),
            jnp.ones(1, jnp.int32),
            scale=1.0,
        )
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        kv_cache_shape(1, 0, PAGE_SIZE, KV_HEADS, HEAD_DIM)


def test_jit_compatible():
    shape = kv_cache_shape(1, 4, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    cache = jnp.ones(shape)
    f = jax.jit(
        lambda q: paged_attention(
            q,
            cache,
            cache,
            jnp.int32(0),
            jnp.zeros((1, 1), jnp.int32),
            jnp.zeros((1, 2), jnp.int32),
            jnp.ones(1, jnp.int32),
            scale=1.0,
        )
    )
    assert f(jnp.ones((1, 1, HEADS, HEAD_DIM))).shape == (1, 1, HEADS, HEAD_DIM)
