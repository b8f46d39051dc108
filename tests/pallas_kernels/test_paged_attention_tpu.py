"""The TPU ragged paged-attention kernel (``tpu.py``), without a TPU.

Numerics run in Pallas' TPU interpret mode on CPU against ``reference.ragged_paged_attention``,
on the ragged suite's cases (``mixed_case``: decode rows and prefill chunks in one run, a
sequence with no rows, padding rows at an absurd position, a shuffled page table, NaN in every
slot no sequence owns). Small ``block_q`` and ``pages_per_block`` make query blocks hold rows of
several sequences, chunks span several blocks, and each sequence take several key steps. The
lowering for TPU is checked with ``jax.export``: it must produce a Mosaic custom call.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jax_llm_runtime.pallas_kernels.paged_attention import (
    ops,
    reference,
    self_check,
    to_stored,
    tpu,
)
from tests.pallas_kernels.test_paged_attention_fp8 import fp8_case
from tests.pallas_kernels.test_paged_attention_kernel import HEAD_DIM, assert_matches, make_case
from tests.pallas_kernels.test_paged_attention_ragged import (
    KERNEL_CASES,
    MIXED,
    PADDING,
    mixed_case,
    ragged,
    run_reference,
    zeroed,
)


def run_tpu(args: tuple, interpret=True, **kwargs) -> jax.Array:
    """The kernel, jitted, in Pallas' TPU interpret mode."""
    return jax.jit(lambda *a: tpu.ragged_paged_attention(*a, interpret=interpret, **kwargs))(*args)


@pytest.mark.parametrize("num_heads,num_kv_heads,window,soft_cap", KERNEL_CASES)
def test_matches_the_reference(num_heads, num_kv_heads, window, soft_cap):
    rc = mixed_case(num_heads, num_kv_heads)
    kwargs = dict(scale=HEAD_DIM**-0.5, sliding_window=window, soft_cap=soft_cap)
    blocks = dict(block_q=4, pages_per_block=2)
    out = run_tpu(rc.args(), **blocks, **kwargs)
    assert out.shape == rc.q.shape and out.dtype == rc.q.dtype
    assert_matches(out, run_reference(*rc.args(), **kwargs), rc.seen(window))
    # NaN in unused slots must change nothing, bit for bit.
    same = run_tpu(zeroed(rc.args()), **blocks, **kwargs)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


@pytest.mark.parametrize("block_q,pages_per_block", [(1, 1), (8, 3), (16, None)])
def test_block_sizes_do_not_change_the_result(block_q, pages_per_block):
    rc = mixed_case(4, 2)
    kwargs = dict(scale=0.25, sliding_window=6, soft_cap=20.0)
    out = run_tpu(rc.args(), block_q=block_q, pages_per_block=pages_per_block, **kwargs)
    assert_matches(out, run_reference(*rc.args(), **kwargs), rc.seen(6))


@pytest.mark.parametrize("dma_execution_mode", ["on_wait", "eager"])
def test_double_buffered_copies(dma_execution_mode):
    # One page per step, so every sequence takes several steps and each step's prefetch lands
    # in the other buffer. "eager" performs a copy when it starts: a prefetch into the buffer in
    # use would overwrite the keys before they are read.
    rc = mixed_case(8, 2)
    kwargs = dict(scale=0.25, soft_cap=20.0)
    interpret = pltpu.InterpretParams(dma_execution_mode=dma_execution_mode)
    out = run_tpu(rc.args(), interpret, block_q=4, pages_per_block=1, **kwargs)
    assert_matches(out, run_reference(*rc.args(), **kwargs), rc.seen())


def test_many_sequences_and_a_long_chunk():
    # 12 decoding sequences beside a 40-row chunk after cached pages, pages of 16 and a longer
    # head: the default block sizes, several key steps for the long sequences.
    rng = np.random.default_rng(5)
    seqs = [(1, int(n)) for n in rng.integers(1, 90, 12)] + [(40, 70), (1, 33)]
    rc = mixed_case(8, 2, seqs, page_size=16, head_dim=32)
    kwargs = dict(scale=32**-0.5, soft_cap=20.0, sliding_window=50)
    out = run_tpu(rc.args(), pages_per_block=2, **kwargs)
    assert_matches(out, run_reference(*rc.args(), **kwargs), rc.seen(50))


@pytest.mark.parametrize(
    "cache_dtype,q_dtype,tol",
    [
        (jnp.bfloat16, jnp.float32, 1e-5),  # the same bfloat16 values, upcast alike
        (jnp.bfloat16, jnp.bfloat16, 2e-2),  # a bfloat16 output
        (jnp.float16, jnp.float32, 1e-5),
        (jnp.float8_e4m3fn, jnp.float32, 1e-5),  # float8 without row scales
    ],
)
def test_cache_dtypes(cache_dtype, q_dtype, tol):
    rc = mixed_case(8, 2)
    k, v = (c.astype(cache_dtype) for c in (rc.padded.k_cache, rc.padded.v_cache))
    args = (rc.q.astype(q_dtype), *rc.args(k_cache=k, v_cache=v)[1:])
    kwargs = dict(scale=0.25, sliding_window=5)
    out = np.asarray(run_tpu(args, block_q=4, pages_per_block=2, **kwargs), np.float32)
    ref = np.asarray(run_reference(*args, **kwargs), np.float32)
    seen = rc.seen(5)
    assert np.isfinite(out).all() and not out[~seen].any()
    np.testing.assert_allclose(out[seen], ref[seen], rtol=tol, atol=tol)


def test_fp8_cache_with_row_scales():
    q_lens, kv_lens = (list(x) for x in zip(*MIXED, strict=True))
    fc = fp8_case(q_lens, kv_lens, max(q_lens), 8, 2)
    rc = ragged(fc.case, q_lens)
    assert np.isnan(np.asarray(fc.k_scales)).any()  # stale rows carry NaN scales
    kwargs = dict(scale=0.25, sliding_window=5, soft_cap=3.0)
    out = run_tpu(rc.args(), block_q=4, pages_per_block=2, **kwargs, **fc.scales())
    assert_matches(out, run_reference(*rc.args(), **kwargs, **fc.scales()), rc.seen(5))
    zero_scales = {k: jnp.nan_to_num(v) for k, v in fc.scales().items()}
    zero_args = rc.args(
        k_cache=jnp.nan_to_num(rc.padded.k_cache), v_cache=jnp.nan_to_num(rc.padded.v_cache)
    )
    same = run_tpu(zero_args, block_q=4, pages_per_block=2, **kwargs, **zero_scales)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


def test_traced_window_and_layer_and_one_compiled_shape():
    traces = []

    def attend(window, *args):
        traces.append(1)
        return tpu.ragged_paged_attention(
            *args, scale=0.25, sliding_window=window, block_q=4, pages_per_block=2,
            interpret=True,
        )  # fmt: skip

    f = jax.jit(attend)
    case = make_case([1, 7, 1, 0, 1, 5, 1], [9, 7, 1, 0, 14, 13, 6], 14, 4, 2, layers=(0, 1))
    num_tokens = 16 + PADDING
    for layer, q_lens in ((1, [1, 7, 1, 0, 1, 5, 1]), (0, [1, 1, 1, 0, 1, 1, 1]),
                          (1, [0, 0, 0, 0, 14, 0, 0])):  # fmt: skip
        rc = ragged(case, q_lens, padding=num_tokens - sum(q_lens))
        for window in (3, 1 << 30):
            out = f(jnp.int32(window), *rc.args(layer=layer))
            expected = run_reference(*rc.args(layer=layer), scale=0.25, sliding_window=window)
            assert_matches(out, expected, rc.seen(window))
    assert len(traces) == 1


def test_kv_lens_past_the_page_table_see_only_the_table():
    # kv_lens claim every slot of the table, so the cache must hold no NaN: zero-filled. The
    # interpreter raises on a read past the page table.
    rc = mixed_case(4, 2)
    pages = rc.padded.page_indices
    args = list(zeroed(rc.args()))
    args[7] = rc.padded.kv_lens + pages.shape[1] * rc.padded.k_cache.shape[2]
    out = run_tpu(tuple(args), scale=0.25, block_q=4)
    ref = run_reference(*args, scale=0.25)
    assert_matches(out, ref, np.abs(np.asarray(ref)).sum((1, 2)) > 0)


def test_keeps_q_starts_inside_the_rows():
    # Offsets past the rows or decreasing: nothing is read or written out of bounds (the
    # interpreter raises on an out-of-bounds read) and the rows no sequence covers are zeros.
    rc = mixed_case(4, 2)
    args = list(rc.args())
    args[5] = jnp.asarray([2, 1, 9, 9, 5, 40, 41, 50], jnp.int32)
    out = np.asarray(run_tpu(tuple(args), scale=0.25, block_q=4))
    assert np.isfinite(out).all() and not out[:2].any()


def test_rejects_bad_arguments():
    args = mixed_case(4, 2).args()
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tpu.ragged_paged_attention(args[0][:, :3], *args[1:], scale=1.0)
    with pytest.raises(ValueError, match=r"q_starts \[num_seqs \+ 1\]"):
        tpu.ragged_paged_attention(*args[:5], args[5][:-1], *args[6:], scale=1.0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        tpu.ragged_paged_attention(*args, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap must be > 0"):
        tpu.ragged_paged_attention(*args, scale=1.0, soft_cap=0.0)
    with pytest.raises(ValueError, match="integer storage"):
        stored = [to_stored(c, jnp.uint16) for c in args[1:3]]
        tpu.ragged_paged_attention(args[0], *stored, *args[3:], scale=1.0)
    with pytest.raises(ValueError, match="pass both k_scales and v_scales"):
        tpu.ragged_paged_attention(*args, scale=1.0, k_scales=jnp.ones(args[1].shape[:4]))
    with pytest.raises(ValueError, match="must be >= 1"):
        tpu.ragged_paged_attention(*args, scale=1.0, pages_per_block=-1)


def test_key_ranges_and_block_sequences():
    # Rows 0..5: a decode row at 8, a chunk at 3..5 with a window of 2, an empty sequence, then
    # two padding rows.
    q_starts = jnp.asarray([0, 1, 4, 4], jnp.int32)
    positions = jnp.asarray([8, 3, 4, 5, 0, 0], jnp.int32)
    kv_lens = jnp.asarray([9, 6, 0], jnp.int32)
    lo, hi, seq = tpu.key_ranges(positions, q_starts, kv_lens, max_keys=16, sliding_window=2)
    np.testing.assert_array_equal(seq, [0, 1, 1, 1, -1, -1])
    np.testing.assert_array_equal(lo, [7, 2, 3, 4, 0, 0])
    np.testing.assert_array_equal(hi, [9, 4, 5, 6, 0, 0])
    first, end = tpu.block_sequences(q_starts, num_blocks=3, block_q=2)
    # Block 0 holds rows of sequences 0 and 1, block 1 of sequence 1 only, block 2 none.
    np.testing.assert_array_equal(first, [0, 1, 3])
    np.testing.assert_array_equal(end, [2, 2, 3])


# Lowering for TPU without one: jax.export runs Pallas' Mosaic lowering on abstract shapes.


def _abstract_args(
    dtype, num_tokens=64, num_seqs=8, pages_per_seq=16, num_heads=8, num_kv_heads=2
) -> tuple:
    s = jax.ShapeDtypeStruct
    cache = s((2, 128, 16, num_kv_heads, 128), dtype)
    return (
        s((num_tokens, num_heads, 128), jnp.float32 if dtype == jnp.float8_e4m3fn else dtype),
        cache,
        cache,
        s((), jnp.int32),
        s((num_tokens,), jnp.int32),
        s((num_seqs + 1,), jnp.int32),
        s((num_seqs, pages_per_seq), jnp.int32),
        s((num_seqs,), jnp.int32),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_lowers_to_a_mosaic_custom_call_for_tpu(dtype):
    row_scales = dtype == jnp.float8_e4m3fn

    def attend(window, *args):
        scales = {}
        if row_scales:
            scales = {n: jnp.ones(args[1].shape[:4], jnp.float32) for n in ("k_scales", "v_scales")}
        return tpu.ragged_paged_attention(
            *args, scale=0.1, sliding_window=window, soft_cap=30.0, **scales
        )

    window = jax.ShapeDtypeStruct((), jnp.int32)
    exported = jax.export.export(jax.jit(attend), platforms=["tpu"])(window, *_abstract_args(dtype))
    text = exported.mlir_module()
    assert exported.platforms == ("tpu",)
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1
    assert "ragged_paged_attention_tpu" in text
    assert exported.out_avals[0].shape == (64, 8, 128)


@pytest.mark.parametrize(
    "num_tokens,num_seqs,num_heads,num_kv_heads",
    [(1, 1, 1, 1), (256, 64, 32, 8), (512, 16, 14, 2), (128, 128, 16, 16)],
)
def test_lowers_for_served_head_layouts(num_tokens, num_seqs, num_heads, num_kv_heads):
    # Llama-like 32/8, an odd group of 7 (14/2), no GQA with 16 heads, a single-token step.
    args = _abstract_args(jnp.bfloat16, num_tokens, num_seqs, 32, num_heads, num_kv_heads)
    exported = jax.export.export(
        jax.jit(lambda *a: tpu.ragged_paged_attention(*a, scale=0.1)), platforms=["tpu"]
    )(*args)
    assert exported.mlir_module().count("stablehlo.custom_call @tpu_custom_call") == 1


def test_traced_layer_inside_a_scan_over_layers():
    # The decoder scans its layers over the whole stacked cache; the layer is a traced scalar.
    rc = mixed_case(4, 2, layers=(0, 1))
    q, k, v, _, positions, q_starts, pages, lens = rc.args()

    def run(q, k, v):
        def body(x, layer):
            out = tpu.ragged_paged_attention(
                x, k, v, layer, positions, q_starts, pages, lens, scale=0.25, block_q=4,
                interpret=True,
            )  # fmt: skip
            return out, out

        return jax.lax.scan(body, q, jnp.arange(2, dtype=jnp.int32))[1]

    outs = jax.jit(run)(q, k, v)
    first = run_reference(q, k, v, jnp.int32(0), positions, q_starts, pages, lens, scale=0.25)
    second = run_reference(first, k, v, jnp.int32(1), positions, q_starts, pages, lens, scale=0.25)
    assert_matches(outs[0], first, rc.seen())
    assert_matches(outs[1], second, rc.seen())


def test_the_reference_lowers_without_a_mosaic_call():
    # The export above is not vacuous: the reference has no Mosaic call.
    exported = jax.export.export(
        jax.jit(lambda *a: reference.ragged_paged_attention(*a, scale=0.1)), platforms=["tpu"]
    )(*_abstract_args(jnp.float32))
    assert "tpu_custom_call" not in exported.mlir_module()


# The entry point: ops.ragged_attention(impl="pallas") runs this kernel (interpreted on CPU).


def test_entry_point_runs_the_kernel_with_per_tensor_scales(monkeypatch):
    calls = []
    kernel = tpu.ragged_paged_attention

    def spy(*args, **kwargs):
        calls.append(kwargs["interpret"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(tpu, "ragged_paged_attention", spy)
    rc = mixed_case(8, 2)
    kwargs = dict(scale=0.25, sliding_window=5, soft_cap=3.0, impl="pallas")
    f = jax.jit(
        lambda k_scale, *a: ops.ragged_attention(*a, k_scale=k_scale, v_scale=2.0, **kwargs)
    )
    out = f(jnp.float32(0.5), *rc.args())  # a traced k_scale: folded into a traced scale
    assert calls == [True]  # the TPU kernel ran, interpreted on CPU
    expected = 2.0 * run_reference(*rc.args(), scale=0.125, sliding_window=5, soft_cap=3.0)
    assert_matches(out, expected, rc.seen(5))


def test_entry_point_choice(monkeypatch):
    rc = mixed_case(8, 2)
    q, k, v = rc.args()[:3]
    assert ops.ragged_implementation("pallas", q, k, v, 7) == "pallas"
    with pytest.raises(ValueError, match="integer storage"):
        ops.ragged_implementation("pallas", q, to_stored(k, jnp.uint16), v, 7)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert ops.ragged_implementation("pallas", q, k, v, 7) == "pallas"
    # "auto" waits for the device check: TPU is not a kernel backend until it has passed.
    assert ops.ragged_implementation("auto", q, k, v, 7) == "reference"
    monkeypatch.setattr(ops, "KERNEL_BACKENDS", ("tpu", "gpu"))
    assert ops.ragged_implementation("auto", q, k, v, 7) == "pallas"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert ops.ragged_implementation("auto", q, k, v, 7) == "reference"  # no ragged GPU kernel
    with pytest.raises(ValueError, match="no Pallas kernel takes the ragged layout on 'gpu'"):
        ops.ragged_implementation("pallas", q, k, v, 7)


# The startup check (self_check.py), here in interpret mode.

SERVED = self_check.Served((2, 64, 4, 2, 16), jnp.float32, 8, jnp.float32, scale=0.25,
                           sliding_window=6, soft_cap=20.0)  # fmt: skip
BUCKETS = [self_check.Bucket(16, 4, 8), self_check.Bucket(24, 8, 16)]


@pytest.mark.parametrize(
    "cache_dtype,q_dtype", [(jnp.float32, jnp.float32), (jnp.float8_e4m3fn, jnp.bfloat16)]
)
def test_self_check_passes(cache_dtype, q_dtype):
    served = dataclasses.replace(SERVED, cache_dtype=cache_dtype, q_dtype=q_dtype)
    result = self_check.check_tpu_kernel(served, BUCKETS, interpret=True)
    assert result.ok, result.reason
    assert "compiled 2 buckets" in result.reason


def test_self_check_reports_a_shape_that_does_not_compile():
    served = dataclasses.replace(SERVED, cache_dtype=jnp.uint16)  # integer storage
    result = self_check.check_tpu_kernel(served, BUCKETS, interpret=True)
    assert not result.ok
    assert "did not compile: ValueError" in result.reason and "integer storage" in result.reason


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda out: out * 1.001, "differs from the reference"),
        (lambda out: out.at[-1].set(1.0), "padding) are not zero"),
        (lambda out: out.at[0, 0, 0].set(jnp.nan), "NaN"),
    ],
)
def test_self_check_reports_wrong_numbers(monkeypatch, damage, reason):
    kernel = tpu.ragged_paged_attention
    monkeypatch.setattr(tpu, "ragged_paged_attention", lambda *a, **k: damage(kernel(*a, **k)))
    result = self_check.check_tpu_kernel(SERVED, BUCKETS[:1], interpret=True)
    assert not result.ok and reason in result.reason
