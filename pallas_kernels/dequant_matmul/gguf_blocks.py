"""GGUF block bytes -> ``HostPacked``: the re-layout done once at load (see ``formats``).

GGUF stores a linear weight as rows of output channels, each row a run of blocks along the input
axis. ``from_gguf`` takes those bytes (``[..., rows, row_bytes]``, leading axes for experts) and
returns the codes and scales in the ``[..., in, out]`` orientation every linear here uses. The
decoding follows the block layouts of ggml's ``block_q*`` and ``block_mxfp4`` structs; tests check
the result against ``gguf.quants.dequantize`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import HostPacked

T = GGMLQuantizationType
QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:  # [n, 2] uint8 -> [n] float16
    return np.ascontiguousarray(raw).view(np.float16)[:, 0]


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[n, bytes] -> [n, 2 * bytes]: each run of ``run`` bytes gives its low nibbles, then its high."""
    n = qs.shape[0]
    parts = qs.reshape(n, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (parts & 0x0F).reshape(n, -1)


def _crumbs(qs: np.ndarray, run: int, bits: int) -> np.ndarray:
    """[n, bytes] -> codes of ``bits`` (1 or 2): each run of ``run`` bytes, shift by shift."""
    n, per = qs.shape[0], 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).reshape(1, 1, per, 1)
    parts = qs.reshape(n, -1, 1, run) >> shifts
    return (parts & ((1 << bits) - 1)).reshape(n, -1)


def _bits_of_u32(qh: np.ndarray) -> np.ndarray:  # [n, 4] uint8 -> [n, 32], bit j of a LE uint32
    words = np.ascontiguousarray(qh).view("<u4")
    return ((words >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> two [n, 8] uint8."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=1)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mins.reshape(n, 8)


# Each decoder: blocks [n, type_size] -> dict of per-block arrays (codes [n, block], groups [n, g]).
def _q4_0(b: np.ndarray) -> dict:
    return {"codes": _nibbles(b[:, 2:], 16), "d": _f16(b[:, :2])[:, None], "z": 8, "bits": 4}


def _q4_1(b: np.ndarray) -> dict:
    codes = _nibbles(b[:, 4:], 16)
    return {
        "codes": codes,
        "d": _f16(b[:, :2])[:, None],
        "mn": -_f16(b[:, 2:4])[:, None],
        "bits": 4,
    }


def _q5_0(b: np.ndarray) -> dict:
    codes = _nibbles(b[:, 6:], 16) | (_bits_of_u32(b[:, 2:6]) << 4)
    return {"codes": codes, "d": _f16(b[:, :2])[:, None], "z": 16, "bits": 5}


def _q5_1(b: np.ndarray) -> dict:
    codes = _nibbles(b[:, 8:], 16) | (_bits_of_u32(b[:, 4:8]) << 4)
    return {
        "codes": codes,
        "d": _f16(b[:, :2])[:, None],
        "mn": -_f16(b[:, 2:4])[:, None],
        "bits": 5,
    }


def _q8_0(b: np.ndarray) -> dict:
    codes = b[:, 2:] ^ np.uint8(0x80)  # int8 q -> q + 128
    return {"codes": codes, "d": _f16(b[:, :2])[:, None], "z": 128, "bits": 8}


def _q2_k(b: np.ndarray) -> dict:
    scales, qs = b[:, :16], b[:, 16:80]
    return {
        "codes": _crumbs(qs, 32, 2),
        "d": _f16(b[:, 80:82])[:, None],
        "sc": (scales & 0x0F).astype(np.int8),
        "mn": _f16(b[:, 82:84])[:, None],
        "m": scales >> 4,
        "bits": 2,
    }


def _q3_k(b: np.ndarray) -> dict:
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    n = b.shape[0]
    low = (scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 0x0F
    high = (scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)) & 3
    sc = (low.reshape(n, 16) | (high.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)
    codes = _crumbs(qs, 32, 2) | (_crumbs(hmask, 32, 1) << 2)
    return {"codes": codes, "d": _f16(b[:, 108:110])[:, None], "sc": sc, "z": 4, "bits": 3}


def _q4_k(b: np.ndarray) -> dict:
    sc, mins = _scale_min_k4(b[:, 4:16])
    return {
        "codes": _nibbles(b[:, 16:], 32),
        "d": _f16(b[:, :2])[:, None],
        "sc": sc.astype(np.int8),
        "mn": _f16(b[:, 2:4])[:, None],
        "m": mins,
        "bits": 4,
    }


def _q5_k(b: np.ndarray) -> dict:
    sc, mins = _scale_min_k4(b[:, 4:16])
    codes = _nibbles(b[:, 48:], 32) | (_crumbs(b[:, 16:48], 32, 1) << 4)
    return {
        "codes": codes,
        "d": _f16(b[:, :2])[:, None],
        "sc": sc.astype(np.int8),
        "mn": _f16(b[:, 2:4])[:, None],
        "m": mins,
        "bits": 5,
    }


def _q6_k(b: np.ndarray) -> dict:
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    codes = _nibbles(ql, 64) | (_crumbs(qh, 32, 2) << 4)
    sc = np.ascontiguousarray(scales).view(np.int8)
    return {"codes": codes, "d": _f16(b[:, 208:210])[:, None], "sc": sc, "z": 32, "bits": 6}


DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], dict]] = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}


def _mxfp4(b: np.ndarray) -> dict:
    # ggml's block_mxfp4: one E8M0 exponent, then 32 E2M1 codes as 16 bytes (element j in the
    # low nibble of byte j, element j + 16 in its high nibble). ggml scales its doubled E2M1
    # table by half the exponent's power of two, the same product as 2 ** (e - 127) * E2M1
    # (except exponent 255: NaN here, as the OCP format has it; ggml reads it as 2 ** 128).
    return {"codes": _nibbles(b[:, 1:], 16), "d": b[:, :1], "bits": 4, "codebook": "e2m1"}


# The non-affine types: ``formats.CODEBOOKS`` codes with a uint8 E8M0 ``d`` (the reference
# dequantizer reads them; the Pallas and native kernels read affine codes only).
CODEBOOK_DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], dict]] = {T.MXFP4: _mxfp4}
PACKABLE = (*DECODERS, *CODEBOOK_DECODERS)


def row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    """Bytes of one GGUF row of ``cols`` values of ``qtype``."""
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} rows must be a multiple of {block} values, got {cols}")
    return cols // block * size


def from_gguf(
    raw: np.ndarray,  # uint8 [..., rows, row_bytes]: GGUF rows of output channels
    qtype: GGMLQuantizationType,
    cols: int,  # values per row (the input width)
) -> HostPacked:  # [..., cols, rows]
    """Decode GGUF block bytes into ``HostPacked`` in the ``[..., in, out]`` orientation."""
    decoder = DECODERS.get(qtype) or CODEBOOK_DECODERS.get(qtype)
    if decoder is None:
        raise ValueError(
            f"{qtype.name} cannot stay packed; supported: {', '.join(t.name for t in PACKABLE)}"
        )
    *lead, rows, nbytes = raw.shape
    if nbytes != row_bytes(qtype, cols):
        raise ValueError(f"{qtype.name}: {nbytes} bytes per row do not hold {cols} values")
    block, size = GGML_QUANT_SIZES[qtype]
    parts = decoder(np.ascontiguousarray(raw).reshape(-1, size))
    per_row = cols // block

    def orient(a: np.ndarray) -> np.ndarray:  # [n_blocks, g] -> [..., cols // (block // g), rows]
        return np.swapaxes(a.reshape(*lead, rows, per_row * a.shape[-1]), -1, -2).copy()

    def group(name: str) -> np.ndarray | None:
        return orient(parts[name]) if name in parts else None

    return HostPacked(
        codes=orient(parts["codes"]).astype(np.uint8),
        bits=parts["bits"],
        d=group("d"),
        sc=group("sc"),
        z=parts.get("z", 0),
        mn=group("mn"),
        m=group("m"),
        codebook=parts.get("codebook"),
    )
