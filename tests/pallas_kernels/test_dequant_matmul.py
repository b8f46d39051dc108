"""The dequant-matmul reference against gguf's own dequantizer, and the Pallas kernel against the
reference, in interpret mode on CPU, for every GGUF block type and for GPTQ-style zero points.

GGUF bytes are either quantized from random floats (the 32-value types, with ``gguf.quants``) or
random bytes whose float16 scales are overwritten with small finite values (every type), so every
code, sub-scale and sign turns up. Shapes are odd on purpose: token counts that are not a tile,
``out`` that is not a power of two (or not even a multiple of 16), several steps along ``in``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T
from jax import export

from jax_llm_runtime.pallas_kernels.dequant_matmul import kernel, ops, reference, tuning
from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import HostPacked, PackedWeight
from jax_llm_runtime.pallas_kernels.dequant_matmul.gguf_blocks import DECODERS, from_gguf

TYPES = list(DECODERS)
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# Byte offsets of the float16 fields (d, and dmin or m) inside one block of each type.
F16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes]: random bytes with finite, small float16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 0.05, raw.shape[0]) * rng.choice([-1.0, 1.0], raw.shape[0])
        raw[:, offset : offset + 2] = scale.astype(np.float16)[:, None].view(np.uint8)
    return raw.reshape(rows, -1)


def gguf_bytes(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] of ``qtype``: quantized floats where gguf can, else random."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        return quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return random_blocks(qtype, rows, cols, rng)


def in_features(qtype: T) -> int:
    return 96 if GGML_QUANT_SIZES[qtype][0] == 32 else 512


def tokens(num_tokens: int, k: int, seed: int = 1, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((num_tokens, k)), dtype)


def run_kernel(x: jax.Array, w: PackedWeight, **kwargs) -> jax.Array:
    """The kernel, jitted, in interpret mode (this is the CPU suite)."""
    return jax.jit(lambda x, w: kernel.dequant_matmul(x, w, interpret=True, **kwargs))(x, w)


def assert_close(out: jax.Array, ref: jax.Array, rtol: float = 1e-5) -> None:
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.dtype == np.float32 and out.shape == ref.shape
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_dequantize_is_bit_exact_with_gguf(qtype):
    k = in_features(qtype)
    cases = [gguf_bytes(qtype, 96, k)]
    if qtype in QUANTIZABLE:  # random bytes reach codes the quantizer never writes
        cases.append(random_blocks(qtype, 96, k, np.random.default_rng(2)))
    for raw in cases:
        w = from_gguf(raw, qtype, k).to_device()
        expected = quants.dequantize(raw, qtype).astype(np.float32).T  # gguf: [out, in]
        assert np.isfinite(expected).all()
        np.testing.assert_array_equal(np.asarray(reference.dequantize(w)), expected)


def test_mxfp4_blocks_are_bit_exact_with_gguf():
    """GGUF MXFP4 blocks (gpt-oss's experts in llama.cpp's files) through ``from_gguf``: random
    codes under every exponent, one exponent per output row, against gguf's dequantization, on
    the host (exponents 0..254) and the device (3..254: XLA:CPU flushes the subnormal products
    of 0..2). Values compare equal (ggml's code 8 is +0.0, the E2M1 table's -0.0); exponent 255
    is NaN, the OCP format's reading, where ggml reads a scale of 2 ** 128."""
    from jax_llm_runtime.pallas_kernels.dequant_matmul.host import dequantize_host

    rows, cols = 256, 96
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = np.arange(rows, dtype=np.uint8)[:, None]
    raw = raw.reshape(rows, -1)
    packed = from_gguf(raw, T.MXFP4, cols)
    assert packed.codebook == "e2m1" and packed.codes.shape == (cols, rows)
    with np.errstate(over="ignore"):  # exponent 255 times the largest codes
        expected = quants.dequantize(raw, T.MXFP4).astype(np.float32).T  # gguf: [out, in]
    host = dequantize_host(packed)
    device = np.asarray(reference.dequantize(packed.to_device()))
    np.testing.assert_array_equal(host[:, :255], expected[:, :255])
    np.testing.assert_array_equal(device[:, 3:255], expected[:, 3:255])
    assert np.isnan(host[:, 255]).all() and np.isnan(device[:, 255]).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_matches_reference(qtype):
    # Token counts 1, 3 and 17 select the three tuning buckets' block shapes in turn.
    index = TYPES.index(qtype)
    num_tokens, out = (1, 3, 17)[index % 3], (96, 160)[index % 2]
    k = in_features(qtype)
    w = from_gguf(gguf_bytes(qtype, out, k, seed=index), qtype, k).to_device()
    x = tokens(num_tokens, k)
    assert_close(run_kernel(x, w), reference.dequant_matmul(x, w))


@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_kernel_shapes_with_small_blocks(num_tokens):
    # block_k = 32 is below every k-quant group (one row per step) and above Q2_K's 16-value
    # sub-blocks (two rows per step); block_m = 16 makes 17 tokens two token tiles.
    config = tuning.BlockConfig(block_m=16, block_n=16, block_k=32)
    w = from_gguf(gguf_bytes(T.Q2_K, 160, 512), T.Q2_K, 512).to_device()
    x = tokens(num_tokens, 512)
    assert_close(run_kernel(x, w, config=config), reference.dequant_matmul(x, w))


def test_out_without_a_power_of_two_tile_uses_the_reference_for_its_tail():
    w = from_gguf(gguf_bytes(T.Q6_K, 100, 256), T.Q6_K, 256).to_device()  # 100 = 96 + 4
    x = tokens(3, 256)
    assert_close(run_kernel(x, w), reference.dequant_matmul(x, w))
    small = from_gguf(gguf_bytes(T.Q8_0, 10, 96), T.Q8_0, 96).to_device()  # no kernel tile
    assert_close(run_kernel(x[:, :96], small), reference.dequant_matmul(x[:, :96], small))


def test_bfloat16_tokens_multiply_bfloat16_tiles():
    w = from_gguf(gguf_bytes(T.Q4_K, 96, 512), T.Q4_K, 512).to_device()
    x = tokens(17, 512, dtype=jnp.bfloat16)
    out = run_kernel(x, w)
    tile = reference.dequantize(w).astype(jnp.bfloat16).astype(jnp.float32)
    expected = jnp.dot(x.astype(jnp.float32), tile, precision=jax.lax.Precision.HIGHEST)
    assert_close(out, expected)
    assert_close(out, reference.dequant_matmul(x, w), rtol=2e-2)


def test_ops_entry_point():
    w = from_gguf(gguf_bytes(T.Q5_K, 160, 512), T.Q5_K, 512).to_device()
    x = tokens(6, 512).reshape(2, 3, 512)
    ref = reference.dequant_matmul(x.reshape(6, 512), w).reshape(2, 3, 160)
    np.testing.assert_array_equal(np.asarray(ops.dequant_matmul(x, w, impl="reference")), ref)
    np.testing.assert_array_equal(np.asarray(ops.dequant_matmul(x, w)), ref)  # auto on CPU
    assert_close(ops.dequant_matmul(x, w, impl="pallas"), ref)
    with pytest.raises(ValueError, match="impl must be one of"):
        ops.dequant_matmul(x, w, impl="triton")


def gptq_weight(z_shape: tuple[int, int], k: int = 256, n: int = 96, group: int = 128):
    """A 4-bit HostPacked with per-group float16 scales and uint8 zero codes, by hand."""
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (k, n), dtype=np.uint8)
    d = rng.uniform(-0.05, 0.05, (k // group, n)).astype(np.float16)
    z = rng.integers(0, 16, z_shape, dtype=np.uint8)
    host = HostPacked(codes=codes, bits=4, d=d, z=z)
    rows = np.arange(k) // group
    z_full = z[rows] if z_shape[0] > 1 else np.broadcast_to(z, (k, n))
    expected = d[rows].astype(np.float32) * (codes.astype(np.int32) - z_full).astype(np.float32)
    return host.to_device(), expected


@pytest.mark.parametrize("z_shape", [(2, 96), (1, 1)], ids=["per_group", "one"])
@pytest.mark.parametrize("num_tokens", [3, 17])  # block_k 256 (two groups per step), then 64
def test_gptq_zero_points(z_shape, num_tokens):
    w, expected = gptq_weight(z_shape)
    assert w.z.shape == z_shape
    np.testing.assert_array_equal(np.asarray(reference.dequantize(w)), expected)
    x = tokens(num_tokens, 256)
    assert_close(run_kernel(x, w), reference.dequant_matmul(x, w))


def test_rejects_bad_arguments():
    w = from_gguf(gguf_bytes(T.Q8_0, 96, 96), T.Q8_0, 96).to_device()
    x = tokens(2, 96)
    with pytest.raises(ValueError, match="x has 64 input features"):
        kernel.dequant_matmul(x[:, :64], w, interpret=True)
    with pytest.raises(ValueError, match=r"x must be \[num_tokens, in\]"):
        kernel.dequant_matmul(x[None], w, interpret=True)
    with pytest.raises(ValueError, match="x must be one of"):
        kernel.dequant_matmul(x.astype(jnp.int32), w, interpret=True)
    with pytest.raises(ValueError, match="bits must be one of"):
        kernel.dequant_matmul(x, w.replace(bits=7), interpret=True)
    with pytest.raises(ValueError, match="bit planes"):
        kernel.dequant_matmul(x, w.replace(bits=6), interpret=True)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), w)
    with pytest.raises(ValueError, match=r"one \[in, out\] matrix"):
        kernel.dequant_matmul(x, stacked, interpret=True)
    with pytest.raises(ValueError, match="groups of 48"):
        kernel.dequant_matmul(x, w.replace(d=w.d[:2]), interpret=True)


def test_tuning_table_lookup():
    assert tuning.lookup(1, 4) == tuning.TUNING[(16, 4)]
    assert tuning.lookup(17, 6) == tuning.TUNING[(64, 6)]
    assert tuning.lookup(5000, 8) == tuning.TUNING[(256, 8)]
    assert tuning.lookup(1, 7) == tuning.DEFAULT
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        tuning.BlockConfig(block_m=16, block_n=24, block_k=64)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 32"):
        tuning.BlockConfig(block_m=16, block_n=16, block_k=16)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q3_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_triton_for_cuda(monkeypatch, qtype, dtype):
    # Lowering for CUDA runs the Pallas Triton lowering here, without a GPU: every primitive in the
    # kernel needs a Triton rule and every loaded block a power-of-two size. PTX is not built.
    from jax.experimental.pallas import triton as pltriton

    monkeypatch.setattr(
        kernel, "_compiler_params", lambda config, interpret: pltriton.CompilerParams()
    )
    k = in_features(qtype)
    w = from_gguf(gguf_bytes(qtype, 96, k), qtype, k).to_device()
    exported = export.export(
        jax.jit(kernel.dequant_matmul),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(tokens(17, k, dtype=dtype), w)
    assert "xla.gpu.triton" in exported.mlir_module()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU to compile the kernel")
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_kernel_on_gpu(qtype, dtype):
    w = from_gguf(gguf_bytes(qtype, 1000, 1024), qtype, 1024).to_device()
    for num_tokens in (1, 100):
        x = tokens(num_tokens, 1024, dtype=dtype)
        out = jax.jit(kernel.dequant_matmul)(x, w)
        # The kernel multiplies float32 in IEEE precision; XLA's GPU dots default to TF32.
        with jax.default_matmul_precision("highest"):
            ref = reference.dequant_matmul(x, w)
        assert_close(out, ref, rtol=1e-5 if dtype == jnp.float32 else 2e-2)
