"""The native CPU dequant-matmul kernel against the pure-jnp reference, and its dispatch.

Weights are the reference tests' (``gguf_bytes``: quantized random floats or random blocks, every
GGUF type), GPTQ-style zero codes, and mixed-type stacks (``host.stack``: the widest code, the
finest groups, one zero code per matrix). Shapes are odd on purpose: 100 output columns (vectors
of 16 plus 4 columns the kernel computes one at a time), 1, 7 and 16 rows (one or two passes of
up to 8 rows). The kernel is compiled on first use (``pallas_kernels.native``); without a C++
compiler the numerics tests skip and the fallback tests still run.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedLayer, native, ops, reference
from jax_llm_runtime.pallas_kernels.dequant_matmul.gguf_blocks import from_gguf
from jax_llm_runtime.pallas_kernels.dequant_matmul.host import stack
from tests.pallas_kernels.test_dequant_matmul import (
    TYPES,
    assert_close,
    gguf_bytes,
    gptq_weight,
    in_features,
    tokens,
)

needs_kernel = pytest.mark.skipif(
    not native.available(), reason="the native kernel could not be built here (no C++ compiler?)"
)


def run_native(x, w, layer=None, int8=False) -> jax.Array:
    call = jax.jit(functools.partial(native.dequant_matmul, int8_activations=int8))
    if layer is None:
        return call(x, w)
    return call(x, w, jnp.int32(layer))


def host_weight(qtype: T, out: int = 100, seed: int = 0):
    k = in_features(qtype)
    return from_gguf(gguf_bytes(qtype, out, k, seed=seed), qtype, k)


@needs_kernel
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matches_reference(qtype, int8):
    # int8: integer dots over x rounded to int8 blocks of 32, i.e. the reference's rounded x
    # times the float32 weight up to the order of the sums. 33 rows: passes of 8, 8, 8, 8, 1.
    w = host_weight(qtype).to_device()
    for num_tokens in (1, 7, 16, 33):
        x = tokens(num_tokens, w.shape[0], seed=num_tokens)
        want = reference.dequant_matmul(x, w, int8_activations=int8)
        assert_close(run_native(x, w, int8=int8), want)
        if int8:  # the rounding is applied: not the float result, but within ~1% of it
            exact = np.asarray(reference.dequant_matmul(x, w))
            assert not np.allclose(np.asarray(want), exact, rtol=1e-5, atol=0)
            np.testing.assert_allclose(want, exact, atol=2e-2 * np.abs(exact).max())


@needs_kernel
def test_int8_activations_on_stacks_gptq_and_many_rows():
    stacked = stack([host_weight(t, seed=i) for i, t in enumerate((T.Q4_K, T.Q6_K))]).to_device()
    x = tokens(130, stacked.shape[-2])  # spread over the pool by column blocks
    for layer in range(2):
        matrix = PackedLayer(stacked, jnp.int32(layer)).matrix()
        want = reference.dequant_matmul(x, matrix, int8_activations=True)
        assert_close(run_native(x, stacked, layer, int8=True), want)
    for z_shape in ((2, 96), (1, 1)):
        w, _ = gptq_weight(z_shape)
        x = tokens(9, 256)
        want = reference.dequant_matmul(x, w, int8_activations=True)
        assert_close(run_native(x, w, int8=True), want)


@needs_kernel
def test_int8_activations_keep_non_finite_values():
    # A block holding an infinity or NaN has no finite scale: its rows' outputs are NaN, as the
    # reference's, and the other rows are untouched.
    w = host_weight(T.Q4_0).to_device()
    x = np.array(tokens(3, w.shape[0]))
    x[1, 40] = np.inf
    x[2, 3] = np.nan
    out = np.asarray(run_native(jnp.asarray(x), w, int8=True))
    want = np.asarray(reference.dequant_matmul(jnp.asarray(x), w, int8_activations=True))
    assert np.isnan(out[1:]).all() and np.isnan(want[1:]).all()
    assert_close(out[:1], want[:1])


def test_quantize_activations_rounds_blocks_of_32():
    x = np.array(tokens(2, 64))
    x[1, 32:] = 0.0  # an all-zero block stays zero
    rounded = np.asarray(reference.quantize_activations(jnp.asarray(x)))
    for row in range(2):
        for b in range(2):
            block, got = x[row, 32 * b : 32 * b + 32], rounded[row, 32 * b : 32 * b + 32]
            d = np.abs(block).max() / 127
            if d == 0:
                assert (got == 0).all()
                continue
            codes = got / np.float32(d)
            np.testing.assert_allclose(codes, np.round(codes), atol=1e-4)
            assert np.abs(codes).max() == pytest.approx(127, abs=1e-4)
            assert np.abs(got - block).max() <= d / 2 * (1 + 1e-5)
    with pytest.raises(ValueError, match="multiple of 32"):
        reference.quantize_activations(jnp.ones((1, 48)))


@needs_kernel
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K, T.Q5_K], ids=lambda t: t.name)
def test_calls_spread_over_the_thread_pool(qtype):
    # Past ~2M multiply-adds a call is split over the pool: one row by ranges of runs (partial
    # sums added at the end), several rows by blocks of columns; 1000 = 62 vectors + 8 columns.
    k, out = 1024, 1000
    w = from_gguf(gguf_bytes(qtype, out, k), qtype, k).to_device()
    for num_tokens in (1, 7):
        x = tokens(num_tokens, k, seed=num_tokens)
        assert_close(run_native(x, w), reference.dequant_matmul(x, w))


@needs_kernel
@pytest.mark.parametrize(
    "qtype", [T.Q8_0, T.Q4_1, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K], ids=lambda t: t.name
)
def test_a_lone_int8_row_over_a_wide_weight_equals_its_row_in_a_batch(qtype):
    # A lone row of int8 activations is walked run by run over chunks of columns (an LM head's
    # width: several chunks per worker), the rows of a batch column by column; the lone row's
    # outputs must be bit-equal to the same row's in a batch (a request's tokens never depend
    # on its batch) and match the reference. 16,456 columns: 8 past the last whole vector.
    k, out = in_features(qtype), 16456
    w = from_gguf(gguf_bytes(qtype, out, k), qtype, k).to_device()
    x = tokens(3, k, seed=5)
    lone = np.asarray(run_native(x[:1], w, int8=True))
    batch = np.asarray(run_native(x, w, int8=True))
    np.testing.assert_array_equal(lone[0], batch[0])
    assert_close(lone, reference.dequant_matmul(x[:1], w, int8_activations=True))


@needs_kernel
@pytest.mark.parametrize(
    "qtypes",
    [(T.Q4_K, T.Q6_K, T.Q4_K), (T.Q5_0, T.Q8_0, T.Q5_0), (T.Q4_1, T.Q4_0, T.Q8_0)],
    ids=["q4k_q6k", "q5_0_q8_0", "q4_1_q4_0_q8_0"],
)
def test_stacked_layers_read_in_place(qtypes):
    # Mixed stacks: 6-bit codes with 16-row sub-blocks and a mixed minimum; 8-bit codes with one
    # zero code per matrix ([layers, 1, 1]); 4- and 8-bit blocks of 32 with and without minimums.
    stacked = stack([host_weight(t, seed=i) for i, t in enumerate(qtypes)]).to_device()
    x = tokens(7, stacked.shape[-2])
    for layer in range(len(qtypes)):
        matrix = PackedLayer(stacked, jnp.int32(layer)).matrix()
        assert_close(run_native(x, stacked, layer), reference.dequant_matmul(x, matrix))


@needs_kernel
def test_layer_scan_calls_the_kernel_on_the_whole_stack():
    stacked = stack([host_weight(T.Q4_1, out=96, seed=i) for i in range(3)]).to_device()
    x = tokens(2, stacked.shape[-2])

    def scan(x, w):
        def body(carry, index):
            return carry, ops.dequant_matmul(x, PackedLayer(w, index))

        return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

    out = jax.jit(scan)(x, stacked)
    for layer in range(3):
        matrix = PackedLayer(stacked, jnp.int32(layer)).matrix()
        assert_close(out[layer], reference.dequant_matmul(x, matrix))
    hlo = jax.jit(scan).lower(x, stacked).compile().as_text()
    assert "runtime_dequant_matmul_" in hlo
    assert not re.search(r"= u8\[[^\n]* (dynamic-slice|copy)\(", hlo)  # no slice of the codes


@needs_kernel
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_a_group_call_gives_each_weight_its_own_result(qtype, int8):
    # Projections that share x (q, k, v of different widths) in one call: each result is the
    # one-weight call's, bit for bit, for a lone row (the float stream and int8 lone paths),
    # a batch and a prefill-sized call. The widest makes the calls spread over the pool (a
    # lone row too with the 256-row blocks), items of every weight taken in one sequence.
    ws = [host_weight(qtype, out=n, seed=i).to_device() for i, n in enumerate((96, 40, 2000))]
    group = jax.jit(functools.partial(native.dequant_matmul_group, int8_activations=int8))
    for num_tokens in (1, 16, 33):
        x = tokens(num_tokens, ws[0].shape[0], seed=num_tokens)
        outs = group(x, ws)
        assert [o.shape for o in outs] == [(num_tokens, w.shape[-1]) for w in ws]
        for out, w in zip(outs, ws, strict=True):
            np.testing.assert_array_equal(np.asarray(out), np.asarray(run_native(x, w, int8=int8)))


@needs_kernel
def test_a_layer_scan_groups_the_projections_of_one_format():
    # ops.dequant_matmul_group inside a layer scan: stacks of one format go in one group call;
    # a weight of another format is called on its own; every result matches the reference.
    q4 = [stack([host_weight(T.Q4_1, out=n, seed=10 * n + i) for i in range(2)]) for n in (64, 32)]
    q8 = stack([host_weight(T.Q8_0, out=48, seed=i) for i in range(2)])
    ws = [w.to_device() for w in (*q4, q8)]
    x = tokens(5, ws[0].shape[-2])

    def scan(x, ws):
        def body(carry, index):
            return carry, ops.dequant_matmul_group(x, [PackedLayer(w, index) for w in ws])

        return jax.lax.scan(body, 0, jnp.arange(2, dtype=jnp.int32))[1]

    outs = jax.jit(scan)(x, ws[:2])
    for layer in range(2):
        for out, w in zip(outs, ws[:2], strict=True):
            matrix = PackedLayer(w, jnp.int32(layer)).matrix()
            assert_close(out[layer], reference.dequant_matmul(x, matrix))
    hlo = jax.jit(scan).lower(x, ws[:2]).compile().as_text()
    assert hlo.count('custom_call_target="runtime_dequant_matmul_group_') == 1
    assert not native.groupable(ws[1:])
    mixed = jax.jit(scan)(x, ws[1:])
    for out, w in zip(mixed, ws[1:], strict=True):
        assert_close(out[1], reference.dequant_matmul(x, PackedLayer(w, jnp.int32(1)).matrix()))
    hlo = jax.jit(scan).lower(x, ws[1:]).compile().as_text()
    assert "runtime_dequant_matmul_group_" not in hlo


@needs_kernel
@pytest.mark.parametrize("z_shape", [(2, 96), (1, 1)], ids=["per_group", "one"])
def test_gptq_zero_points(z_shape):
    w, _ = gptq_weight(z_shape)
    for num_tokens in (1, 16):
        x = tokens(num_tokens, 256)
        assert_close(run_native(x, w), reference.dequant_matmul(x, w))


@needs_kernel
def test_narrow_outputs_and_bfloat16_activations():
    x = tokens(3, 96)
    for out in (10, 16, 48):  # no whole vector; one vector; a block of three vectors
        w = from_gguf(gguf_bytes(T.Q8_0, out, 96), T.Q8_0, 96).to_device()
        assert_close(run_native(x, w), reference.dequant_matmul(x, w))
    # bfloat16 activations are widened exactly and multiply the float32 weight.
    w = host_weight(T.Q4_K).to_device()
    xb = tokens(5, w.shape[0], dtype=jnp.bfloat16)
    expected = jnp.dot(
        xb.astype(jnp.float32), reference.dequantize(w), precision=jax.lax.Precision.HIGHEST
    )
    assert_close(run_native(xb, w), expected)


def test_supports_and_rejects():
    w = host_weight(T.Q4_0).to_device()
    x = tokens(2, w.shape[0])
    assert native.supports(x, w)
    assert not native.supports(x.astype(jnp.int32), w)
    eights = w.replace(d=jnp.repeat(w.d, 4, axis=0))  # a group of 8 rows
    assert not native.supports(x, eights)
    with pytest.raises(ValueError, match="does not read this call"):
        native.dequant_matmul(x, eights)
    with pytest.raises(ValueError, match="needs a layer index"):
        native.dequant_matmul(x, jax.tree.map(lambda a: a[None], w))
    with pytest.raises(ValueError, match=r"x must be \[num_tokens, 96\]"):
        native.dequant_matmul(x[:, :64], w)


@needs_kernel
def test_ops_dispatch(monkeypatch):
    stacked = stack([host_weight(T.Q6_K, seed=i) for i in range(2)]).to_device()
    layer = PackedLayer(stacked, jnp.int32(1))
    matrix = layer.matrix()
    k = stacked.shape[-2]
    small, large = tokens(4, k), tokens(ops.NATIVE_MAX_TOKENS + 1, k)
    assert_close(ops.dequant_matmul(small, layer), reference.dequant_matmul(small, matrix))
    native_out = ops.dequant_matmul(small, matrix, impl="native")
    np.testing.assert_array_equal(np.asarray(native_out), np.asarray(run_native(small, matrix)))
    # Past NATIVE_MAX_TOKENS rows, and for a plain PackedWeight under "auto": the reference.
    for x, w in ((large, layer), (small, matrix)):
        np.testing.assert_array_equal(
            np.asarray(ops.dequant_matmul(x, w)), np.asarray(reference.dequant_matmul(x, matrix))
        )
    # int8 activations take the kernel at any number of rows, and the reference's rounding
    # where the kernel is not asked for (a plain PackedWeight under "auto").
    np.testing.assert_array_equal(
        np.asarray(ops.dequant_matmul(large, layer, int8_activations=True)),
        np.asarray(run_native(large, stacked, 1, int8=True)),
    )
    np.testing.assert_array_equal(
        np.asarray(ops.dequant_matmul(large, matrix, int8_activations=True)),
        np.asarray(reference.dequant_matmul(large, matrix, int8_activations=True)),
    )
    # A matrix too large to stay in cache keeps the kernel up to NATIVE_MAX_TOKENS_LARGE rows.
    monkeypatch.setattr(ops, "LARGE_MATRIX_BYTES", 0)
    np.testing.assert_array_equal(
        np.asarray(ops.dequant_matmul(large, layer)),
        np.asarray(run_native(large, stacked, 1)),
    )


def test_falls_back_to_the_reference_without_the_library(monkeypatch):
    monkeypatch.setattr(native, "_targets", lambda: None)
    stacked = stack([host_weight(T.Q4_1, seed=i) for i in range(2)]).to_device()
    layer = PackedLayer(stacked, jnp.int32(0))
    x = tokens(3, stacked.shape[-2])
    expected = np.asarray(reference.dequant_matmul(x, layer.matrix()))
    np.testing.assert_array_equal(np.asarray(ops.dequant_matmul(x, layer)), expected)
    np.testing.assert_array_equal(
        np.asarray(ops.dequant_matmul(x, layer.matrix(), impl="native")), expected
    )
    with pytest.raises(RuntimeError, match="unavailable"):
        native.dequant_matmul(x, stacked, 0)
    other = PackedLayer(stacked, jnp.int32(1))
    grouped = ops.dequant_matmul_group(x, [layer, other])
    np.testing.assert_array_equal(np.asarray(grouped[0]), expected)
    np.testing.assert_array_equal(
        np.asarray(grouped[1]), np.asarray(reference.dequant_matmul(x, other.matrix()))
    )
    with pytest.raises(RuntimeError, match="unavailable"):
        native.dequant_matmul_group(x, [stacked, stacked], 0)
