"""The host-side GGUF quantizers against gguf (the 32-value types) and llama.cpp (the k-quants).

- Q4_0..Q8_0: byte-identical to ``gguf.quants.quantize`` on random and adversarial rows.
- Q2_K..Q6_K: byte-identical to llama.cpp's ``quantize_row_*_ref`` on a fixed input, checked by
  digest (the input is built from integers only, so it is the same bits on every machine); and,
  so that a failure says more than a digest can, the reconstruction error through
  ``gguf.quants.dequantize`` is at llama.cpp's level and below a plain round-to-nearest baseline.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from jax_llm_runtime.pallas_kernels.dequant_matmul import quantize
from jax_llm_runtime.pallas_kernels.dequant_matmul.quantize import QUANT_TYPES, quantize_rows

SIMPLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_QUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)

# sha256 of the bytes that llama.cpp's quantize_row_q*_K_ref (the llama.cpp vendored by
# llama-cpp-python 0.3.36, built with gcc -O2, no FMA) writes for fixed_weight().
LLAMA_CPP_SHA256 = {
    T.Q2_K: "8def34ae4d50cb8c7293914e77572e95b4af430e06bf586078887782db14907b",
    T.Q3_K: "3defa23e6364c935776923c2cedef472915b47914b00e1b249d09c1dd85aaebc",
    T.Q4_K: "197805f08c19dcf9606d4bb57c6f7ebf7d849d35f5405a7ee784474d59c072fb",
    T.Q5_K: "62b2bbb30cb69cdb54b279363b462f90cd58878180eec02918d6c69f2b65bd3b",
    T.Q6_K: "ca0735913f88f3dd7470c7bffb59893bd20023f06b98d23f61704737b7e743de",
}

# Relative RMSE (rms error / rms value) of llama.cpp's own quantizers on gaussian(64, 2048),
# measured with the same reference build. The 4% margin admits differences in rounding details,
# not a quantizer that is measurably worse (plain round-to-nearest is 5-25% worse).
LLAMA_CPP_REL_RMSE = {
    T.Q2_K: 0.2970,
    T.Q3_K: 0.1509,
    T.Q4_K: 0.0716,
    T.Q5_K: 0.0363,
    T.Q6_K: 0.0177,
}

# (bits, group, affine) of the round-to-nearest baseline that each k-quant must beat.
BASELINE = {
    T.Q2_K: (2, 16, True),
    T.Q3_K: (3, 16, False),
    T.Q4_K: (4, 32, True),
    T.Q5_K: (5, 32, True),
    T.Q6_K: (6, 16, False),
}


def fixed_weight(rows: int = 32, cols: int = 1024) -> np.ndarray:
    """float32 [rows, cols], about N(0, 1/3) with adversarial rows, from integer arithmetic only."""
    z = np.arange(rows * cols, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # splitmix64
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    lanes = (z[:, None] >> np.arange(0, 64, 16, dtype=np.uint64)) & np.uint64(0xFFFF)
    # A sum of four uniform lanes, scaled by a power of two: every step is exact in float32.
    w = (lanes.sum(axis=1).astype(np.int64) - 2 * 65535).astype(np.float32) / np.float32(65536)
    w = w.reshape(rows, cols)
    w[0] = 0  # all-zero row
    w[1] = 0.75  # constant rows, positive and negative
    w[2] = -1.25
    w[3, 300] = 64  # one outlier
    w[4, :256] = 0  # one all-zero super-block, one all-zero sub-block
    w[4, 512:528] = 0
    w[5] *= np.float32(2.0**-20)  # tiny
    w[6] *= np.float32(2.0**12)  # large (float16 scales still finite)
    w[7] = np.abs(w[7])  # one-signed
    w[8] *= (z.reshape(rows, cols)[8] & np.uint64(7)) == 0  # sparse
    w[9] = np.round(w[9] * 4)  # few distinct values: ties everywhere
    w[10:] *= np.float32(2.0) ** (np.arange(rows - 10, dtype=np.float32) % 7 - 3)[:, None]
    return w


def gaussian(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def rel_rmse(weight: np.ndarray, qtype: T) -> float:
    recon = quants.dequantize(quantize_rows(weight, qtype), qtype).reshape(weight.shape)
    return float(np.sqrt(np.mean((recon - weight) ** 2) / np.mean(weight**2)))


def baseline_rel_rmse(weight: np.ndarray, bits: int, group: int, affine: bool) -> float:
    """Round to nearest with a float (unquantized) scale per group: max-min or absmax."""
    x = weight.reshape(-1, group).astype(np.float64)
    if affine:
        lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
        d = np.where(hi > lo, (hi - lo) / (2**bits - 1), 1)
        recon = np.clip(np.round((x - lo) / d), 0, 2**bits - 1) * d + lo
    else:
        amax = np.abs(x).max(axis=1, keepdims=True)
        d = np.where(amax > 0, amax / 2 ** (bits - 1), 1)
        recon = np.clip(np.round(x / d), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * d
    return float(np.sqrt(np.mean((recon - x) ** 2) / np.mean(x**2)))


# ---------------------------------------------------------------- the 32-value types


def adversarial_rows(cols: int = 256) -> np.ndarray:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((10, cols)).astype(np.float32)
    w[0] = 0
    w[1] = 3.5
    w[2] = -0.001
    w[3] *= 1e4
    w[4] *= 1e-30
    w[5, 17] = 500.0
    w[6, ::32] = -w[6, ::32] * 100  # every block's extreme is a negative outlier
    w[7] = np.round(w[7] * 8) / 8  # ties in the rounding
    w[8] = np.abs(w[8])
    w[9, :32] = 0
    return w


@pytest.mark.parametrize("qtype", SIMPLE, ids=lambda t: t.name)
@pytest.mark.parametrize("data", ["gaussian", "adversarial"])
def test_simple_types_match_gguf(qtype: T, data: str) -> None:
    weight = gaussian(64, 512) if data == "gaussian" else adversarial_rows()
    np.testing.assert_array_equal(quantize_rows(weight, qtype), quants.quantize(weight, qtype))


# ---------------------------------------------------------------- the k-quants


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quants_match_llama_cpp_bytes(qtype: T) -> None:
    digest = hashlib.sha256(quantize_rows(fixed_weight(), qtype).tobytes()).hexdigest()
    assert digest == LLAMA_CPP_SHA256[qtype]


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_error_at_llama_cpp_level(qtype: T) -> None:
    weight = gaussian(64, 2048)
    error = rel_rmse(weight, qtype)
    assert error < 1.04 * LLAMA_CPP_REL_RMSE[qtype]
    assert error < baseline_rel_rmse(weight, *BASELINE[qtype])


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_error_on_heavy_tails_and_scaled_rows(qtype: T) -> None:
    rng = np.random.default_rng(2)
    weight = rng.standard_t(3, (32, 1024)) * np.exp(rng.standard_normal((32, 1)))
    weight = weight.astype(np.float32)
    assert rel_rmse(weight, qtype) < 1.05 * baseline_rel_rmse(weight, *BASELINE[qtype])


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_zero_super_blocks_give_zero_bytes(qtype: T) -> None:
    type_size = GGML_QUANT_SIZES[qtype][1]
    weight = gaussian(3, 768)
    weight[0] = 0
    weight[2, 256:512] = 0
    out = quantize_rows(weight, qtype)
    assert not out[0].any()
    assert not out[2, type_size : 2 * type_size].any()
    assert out[1].any()


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_constant_rows_reconstruct(qtype: T) -> None:
    weight = np.repeat(np.float32([[0.5], [-2.0], [1e3]]), 512, axis=1)
    recon = quants.dequantize(quantize_rows(weight, qtype), qtype)
    np.testing.assert_allclose(recon, weight, rtol=2e-2)


def test_threads_and_chunks_do_not_change_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = fixed_weight()
    expected = {q: quantize_rows(weight, q, num_threads=1) for q in K_QUANTS}
    monkeypatch.setattr(
        quantize, "_CHUNK_BLOCKS", 5
    )  # 128 super-blocks -> 26 chunks, the last short
    for qtype in K_QUANTS:
        np.testing.assert_array_equal(quantize_rows(weight, qtype, num_threads=2), expected[qtype])


# ---------------------------------------------------------------- contract


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_shape_and_dtype(name: str) -> None:
    qtype = QUANT_TYPES[name]
    block, type_size = GGML_QUANT_SIZES[qtype]
    for rows in (0, 1, 5):
        out = quantize_rows(gaussian(rows, 512), qtype)
        assert out.dtype == np.uint8
        assert out.shape == (rows, 512 // block * type_size)


def test_accepts_other_float_dtypes() -> None:
    weight = gaussian(4, 256)
    for dtype in (np.float16, np.float64):
        cast = weight.astype(dtype)
        np.testing.assert_array_equal(
            quantize_rows(cast, T.Q4_K), quantize_rows(cast.astype(np.float32), T.Q4_K)
        )


@pytest.mark.parametrize(
    ("qtype", "cols"), [(T.Q4_0, 48), (T.Q8_0, 100), (T.Q4_K, 128), (T.Q6_K, 576)]
)
def test_cols_not_a_multiple_of_the_block_raise(qtype: T, cols: int) -> None:
    with pytest.raises(ValueError, match="divisible"):
        quantize_rows(np.zeros((2, cols), np.float32), qtype)


@pytest.mark.parametrize("qtype", [T.F16, T.F32, T.IQ2_XXS, T.Q8_K])
def test_unsupported_types_raise(qtype: T) -> None:
    with pytest.raises(ValueError, match="supported types"):
        quantize_rows(np.zeros((2, 256), np.float32), qtype)


def test_bad_weights_raise() -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(np.zeros(256, np.float32), T.Q4_K)
    weight = np.zeros((2, 256), np.float32)
    weight[1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        quantize_rows(weight, T.Q4_K)
