"""The native CPU paged-attention kernel against the pure-jnp reference, and its dispatch.

The cases are the Pallas kernel's (``make_case``): shuffled page tables, odd lengths, a cache whose
every slot no sequence owns is NaN, GQA, windows, soft-caps, decode and prefill chunks with
padding rows. The kernel is compiled on first use (``pallas_kernels.native``); without a C++
compiler the numerics tests skip and the fallback tests still run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels.paged_attention import (
    KVCache,
    attention,
    native,
    reference,
    write_cache,
)
from tests.pallas_kernels.test_paged_attention_fp8 import _zeroed, fp8_case
from tests.pallas_kernels.test_paged_attention_kernel import (
    CHUNK_7,
    CHUNK_16,
    DECODE,
    HEAD_DIM,
    assert_matches,
    make_case,
)

needs_kernel = pytest.mark.skipif(
    not native.available(), reason="the native kernel could not be built here (no C++ compiler?)"
)


def run_native(case, **kwargs) -> jax.Array:
    return jax.jit(lambda *a: native.paged_attention(*a, **kwargs))(*case.args())


@needs_kernel
@pytest.mark.parametrize(
    "shape,num_heads,num_kv_heads,window,soft_cap",
    [
        (DECODE, 2, 2, None, None),
        (DECODE, 8, 2, 5, None),
        (DECODE, 9, 3, None, 30.0),
        (CHUNK_7, 4, 2, None, None),
        (CHUNK_7, 8, 2, 4, 3.0),
        (CHUNK_16, 4, 1, None, 3.0),
        (CHUNK_16, 2, 1, 6, None),
    ],
)
def test_matches_reference(shape, num_heads, num_kv_heads, window, soft_cap):
    q_lens, kv_lens, q_len = shape
    case = make_case(q_lens, kv_lens, q_len, num_heads, num_kv_heads)
    kwargs = dict(scale=HEAD_DIM**-0.5, sliding_window=window, soft_cap=soft_cap)
    # query_block=3 cuts the chunks into blocks whose tokens see different key ranges.
    out = run_native(case, query_block=3, **kwargs)
    assert_matches(out, reference.paged_attention(*case.args(), **kwargs), case.seen(window))
    # NaN in unused slots must change nothing, bit for bit.
    zeroed = case.args(k_cache=jnp.nan_to_num(case.k_cache), v_cache=jnp.nan_to_num(case.v_cache))
    same = jax.jit(lambda *a: native.paged_attention(*a, query_block=3, **kwargs))(*zeroed)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


@needs_kernel
@pytest.mark.parametrize(
    "head_dim,page_size,dtype,tol",
    [
        (64, 16, jnp.float32, 1e-5),  # the unrolled head sizes
        (128, 8, jnp.float32, 1e-5),
        (24, 3, jnp.float32, 1e-5),  # rows padded to whole vectors, pages of 3
        (64, 16, jnp.bfloat16, 2e-2),  # converted to float32 rows first
        (32, 4, jnp.float16, 2e-3),
        (128, 16, jnp.float16, 2e-3),  # float16 rows of 64 or 128: widened as they load
        (64, 16, jnp.float16, 2e-3),
        (24, 3, jnp.float16, 2e-3),  # rows that do not fill vectors: converted first
    ],
)
def test_head_sizes_page_sizes_and_dtypes(head_dim, page_size, dtype, tol):
    # 40 keys span several key blocks of 16: the online softmax rescales across them.
    case = make_case([1, 5, 0], [40, 19, 0], 5, 8, 2, head_dim=head_dim, page_size=page_size)
    case = dataclasses.replace(
        case, k_cache=case.k_cache.astype(dtype), v_cache=case.v_cache.astype(dtype)
    )
    kwargs = dict(scale=head_dim**-0.5, sliding_window=23)
    out = np.asarray(run_native(case, **kwargs), np.float32)
    ref = np.asarray(reference.paged_attention(*case.args(), **kwargs), np.float32)
    seen = case.seen(23)
    assert np.isfinite(out).all() and not out[~seen].any()
    np.testing.assert_allclose(out[seen], ref[seen], rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("q_len", [1, 4])
def test_enough_rows_for_the_thread_pool(q_len):
    # ~6,000 K rows per call: past the size a call runs on its calling thread alone.
    kv_lens = np.random.default_rng(3).integers(q_len, 200, 32).tolist()
    assert sum(kv_lens) * 2 > 4096
    case = make_case([q_len] * 32, kv_lens, q_len, 8, 2, page_size=16, head_dim=32)
    kwargs = dict(scale=32**-0.5, soft_cap=20.0)
    out = run_native(case, **kwargs)
    assert_matches(out, reference.paged_attention(*case.args(), **kwargs), case.seen())


@needs_kernel
def test_bfloat16_queries_keep_their_dtype():
    case = make_case(*DECODE, 4, 2)
    case = dataclasses.replace(case, q=case.q.astype(jnp.bfloat16))
    out = run_native(case, scale=0.25)
    ref = reference.paged_attention(*case.args(), scale=0.25)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), 1e-2, 1e-2)


@needs_kernel
@pytest.mark.parametrize("shape,window,soft_cap", [(DECODE, None, None), (CHUNK_7, 4, 3.0)])
def test_fp8_cache_with_row_scales(shape, window, soft_cap):
    fc = fp8_case(*shape, 8, 2)
    case = fc.case
    kwargs = dict(scale=0.25, sliding_window=window, soft_cap=soft_cap)
    f = jax.jit(lambda *a, **s: native.paged_attention(*a, **kwargs, **s))
    out = f(*case.args(), **fc.scales())
    ref = reference.paged_attention(*case.args(), **kwargs, **fc.scales())
    assert_matches(out, ref, case.seen(window))
    # NaN in unused slots (values and scales) changes nothing, bit for bit.
    args, scales = _zeroed(fc)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(f(*args, **scales)))


@needs_kernel
def test_every_fp8_code_reads_as_its_value():
    # Sequence s sees one key (weight 1): its output is its V row, codes 16 s .. 16 s + 15.
    codes = jnp.arange(256, dtype=jnp.uint8).reshape(16, 1, 1, 1, 16).view(jnp.float8_e4m3fn)
    v_cache = jnp.swapaxes(codes, 0, 1)  # [1 layer, 16 pages, page_size 1, 1 KV head, 16]
    out = native.paged_attention(
        jnp.zeros((16, 1, 1, 16)), jnp.zeros_like(v_cache), v_cache, jnp.int32(0),
        jnp.zeros((16, 1), jnp.int32), jnp.arange(16, dtype=jnp.int32)[:, None],
        jnp.ones(16, jnp.int32), scale=1.0,
    )  # fmt: skip
    expected = np.asarray(codes.astype(jnp.float32)).reshape(-1)
    np.testing.assert_array_equal(np.asarray(out).reshape(-1), expected)  # NaN where NaN


@needs_kernel
def test_kv_lens_past_the_page_table_see_only_the_table():
    case = make_case(*DECODE, 4, 2)
    case = dataclasses.replace(
        case,
        k_cache=jnp.nan_to_num(case.k_cache),
        v_cache=jnp.nan_to_num(case.v_cache),
        kv_lens=jnp.full_like(case.kv_lens, 1000),
        positions=jnp.full_like(case.positions, 999),
    )
    out = run_native(case, scale=0.25)
    assert_matches(out, reference.paged_attention(*case.args(), scale=0.25), case.seen())


@needs_kernel
def test_traced_layer_and_window_inside_a_scan_with_a_donated_cache():
    """The decoder's pattern: the whole cache carried through a layer scan, written, then read.

    XLA must neither copy the cache for the custom call nor lose the in-place update.
    """
    case = make_case(*CHUNK_7, 4, 2, layers=(0, 1))
    cache = KVCache(k=jnp.nan_to_num(case.k_cache), v=jnp.nan_to_num(case.v_cache))
    q_lens = jnp.asarray(CHUNK_7[0], jnp.int32)
    new_k = jnp.ones((*case.q.shape[:2], 2, HEAD_DIM), jnp.float32)
    windows = jnp.asarray([3, 1 << 30], jnp.int32)  # a sliding layer, then a global one

    def step(attend, cache, q, windows):
        def layer(cache, xs):
            index, window = xs
            cache = write_cache(
                cache, index, new_k * index, -new_k, case.positions, q_lens, case.page_indices
            )
            out = attend(
                q, cache.k, cache.v, index, case.positions, case.page_indices, case.kv_lens,
                scale=0.25, sliding_window=window,
            )  # fmt: skip
            return cache, out

        return jax.lax.scan(layer, cache, (jnp.arange(2, dtype=jnp.int32), windows))

    on_native = functools.partial(step, native.paged_attention)
    compiled = jax.jit(on_native, donate_argnums=0).lower(cache, case.q, windows).compile()
    hlo = compiled.as_text()
    cache_type = "f32[" + ",".join(map(str, case.k_cache.shape)) + "]"
    assert not [line for line in hlo.splitlines() if " copy(" in line and cache_type in line]
    assert 'custom_call_target="runtime_paged_attention_' in hlo
    assert "input_output_alias" in hlo  # the donated cache is the updated cache's buffer

    on_reference = functools.partial(step, reference.paged_attention)
    expected_cache, expected = jax.jit(on_reference)(cache, case.q, windows)
    got_cache, got = compiled(cache, case.q, windows)
    np.testing.assert_array_equal(np.asarray(got_cache.k), np.asarray(expected_cache.k))
    for layer, window in enumerate((3, None)):
        assert_matches(got[layer], expected[layer], case.seen(window))


def test_entry_point_falls_back_to_the_reference(monkeypatch):
    case = make_case(*CHUNK_7, 4, 2)
    ref = np.asarray(reference.paged_attention(*case.args(), scale=0.25))
    # No kernel (no compiler, a failed build, or RUNTIME_NATIVE_KERNELS=0): the reference, exactly.
    monkeypatch.setattr(native, "_target", lambda: None)
    assert not native.available()
    out = attention(*case.args(), scale=0.25, impl="native")
    np.testing.assert_array_equal(np.asarray(out), ref)
    with pytest.raises(RuntimeError, match="unavailable"):
        native.paged_attention(*case.args(), scale=0.25)
    monkeypatch.undo()
    # A cache dtype the kernel does not read (float8_e5m2): the reference, exactly.
    e5m2 = case.args(
        k_cache=case.k_cache.astype(jnp.float8_e5m2), v_cache=case.v_cache.astype(jnp.float8_e5m2)
    )
    assert not native.supports(*e5m2[:3])
    np.testing.assert_array_equal(
        np.asarray(attention(*e5m2, scale=0.25, impl="native")),
        np.asarray(reference.paged_attention(*e5m2, scale=0.25)),
    )


def test_switched_off_by_the_environment():
    # What the fallback above stands in for, as a server sees it: no kernel, so the reference.
    code = "from jax_llm_runtime.pallas_kernels.paged_attention import native; print(native.available())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "RUNTIME_NATIVE_KERNELS": "0"},
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "False"


@needs_kernel
def test_entry_point_runs_the_kernel():
    case = make_case(*DECODE, 8, 2)
    out = attention(*case.args(), scale=0.25, k_scale=0.5, v_scale=2.0, impl="native")
    np.testing.assert_array_equal(
        np.asarray(out), np.asarray(native.paged_attention(*case.args(), scale=0.125) * 2.0)
    )
    lowered = jax.jit(lambda *a: attention(*a, scale=0.25, impl="native")).lower(*case.args())
    assert "runtime_paged_attention_" in lowered.as_text()


def test_rejects_bad_arguments():
    case = make_case(*DECODE, 4, 2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        native.paged_attention(case.q[:, :, :3], *case.args()[1:], scale=1.0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        native.paged_attention(*case.args(), scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap must be > 0"):
        native.paged_attention(*case.args(), scale=1.0, soft_cap=0.0)
    with pytest.raises(ValueError, match="native kernel reads caches of"):
        native.paged_attention(*case.args(v_cache=case.v_cache.astype(jnp.bfloat16)), scale=1.0)
