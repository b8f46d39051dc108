"""Marlin-layout 4-bit tensors -> ``HostPacked``: the tile shuffle undone once at load.

Marlin (IST-DASLab's kernel, and vLLM's and candle-vllm's copies of it) stores a symmetric 4-bit
GPTQ weight ``[in, out]`` (codes ``q = round(w / s) + 8``) shuffled for its tensor-core loads:

| tensor | layout |
|---|---|
| ``B`` | int32 ``[in / 16, 2 * out]``: the weight cut into 16 x 16 tiles, each tile row of the grid laid out as one row of ``16 * out`` codes (tile after tile, each row-major), every run of 1024 codes (four tiles side by side) shuffled by ``WEIGHT_PERM``, then eight codes per word, low nibble first |
| ``s`` | float16 ``[groups, out]``: the scales, every run of 64 shuffled by ``SCALE_PERM`` when there are several groups, every run of 32 by ``SCALE_PERM_SINGLE`` when one group spans ``in`` |

There is no ``qzeros`` (every zero is 8) and no ``g_idx`` (act-order is not supported). The
shuffle: thread ``t`` of a warp (32 of them) owns, in each 16 x 16 tile, the elements at rows
``2 (t % 4) + (0, 1, 8, 9)`` of column ``t // 4`` and of column ``t // 4 + 8`` (the ``mma.m16n8k16``
B fragments of both 8-column halves); its eight codes of one tile go in the order
``(0, 2, 4, 6, 1, 3, 5, 7)`` so that the dequantizer's shifts pair them up, and a thread's four
tiles follow each other.

candle-vllm's ``convert_awq_marlin.py`` leaves an AWQ folder's ``qweight`` and ``scales`` as they
are and rewrites only ``qzeros``: the zero points of each 64-column run shuffled by ``SCALE_PERM``,
then packed with AWQ's own interleave. ``awq_zeros_from_marlin`` undoes that.
"""

from __future__ import annotations

import numpy as np

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.gptq import (
    AWQ_ORDER,
    BITS,
    _groups,
    _pack_columns,
    _scales,
    _unpack_columns,
    _words,
)

TILE = 16  # Marlin's tiles are 16 x 16 codes
ZERO = 1 << (BITS - 1)  # Marlin's implicit zero point
RUN = 4 * TILE * TILE  # codes shuffled together: four tiles side by side, 64 columns


def _weight_perm() -> np.ndarray:  # int64 [RUN]: position p of a run holds its code perm[p]
    thread = np.arange(32)
    col = thread // 4
    rows = 2 * (thread % 4)[:, None] + np.array([0, 1, 8, 9])  # [32, 4]
    half = np.array([0, 8])
    # [32 threads, 2 halves, 4 rows] offsets inside one tile, then the four tiles of a run.
    in_tile = TILE * rows[:, None, :] + col[:, None, None] + half[None, :, None]
    per_tile = in_tile.reshape(32, 1, 8) + TILE * TILE * np.arange(4)[None, :, None]
    return per_tile[:, :, AWQ_ORDER].reshape(RUN)


def _scale_perms() -> tuple[np.ndarray, np.ndarray]:  # int64 [64], int64 [32]
    grouped = np.arange(64).reshape(8, 8).T.reshape(64)  # i + 8 j, j fastest
    single = (2 * np.arange(4)[:, None] + np.array([0, 1, 8, 9, 16, 17, 24, 25])).reshape(32)
    return grouped, single


WEIGHT_PERM = _weight_perm()
SCALE_PERM, SCALE_PERM_SINGLE = _scale_perms()


def from_marlin(
    b: np.ndarray,  # int32 [in / 16, 2 * out]
    s: np.ndarray,  # float16 [groups, out]
    *,
    group_size: int,
) -> HostPacked:  # codes [in, out], d = scales, z = 8 per group and column
    """A Marlin linear as ``HostPacked`` (the same one its GPTQ original loads to)."""
    words = _words("B", b)
    k, n = words.shape[0] * TILE, words.shape[1] * 8 // TILE
    if words.shape[1] * 8 % TILE or n % (RUN // TILE):
        raise ValueError(
            f"B has shape {words.shape}; Marlin needs [in / 16, 2 * out] with out a multiple of 64"
        )
    groups, _ = _groups(k, group_size)
    shuffled = _unpack_columns(words, "B", (words.shape[0], TILE * n), BITS)
    runs = shuffled.reshape(-1, RUN)
    tiled = np.empty_like(runs)
    tiled[:, WEIGHT_PERM] = runs
    # [in / 16, out / 16, 16, 16] tile grid -> [in, out]
    codes = tiled.reshape(k // TILE, n // TILE, TILE, TILE).transpose(0, 2, 1, 3).reshape(k, n)
    perm = SCALE_PERM if groups > 1 else SCALE_PERM_SINGLE
    scales = _scales(s, (groups, n)).reshape(-1, perm.size)
    d = np.empty_like(scales)
    d[:, perm] = scales
    return HostPacked(
        codes=codes.astype(np.uint8),
        bits=BITS,
        d=d.reshape(groups, n),
        z=np.full((groups, n), ZERO, np.uint8),
    )


def awq_zeros_from_marlin(
    qzeros: np.ndarray,  # int32 [groups, out / 8], as convert_awq_marlin.py writes it
) -> np.ndarray:  # int32 [groups, out / 8], AWQ's own layout
    """AWQ ``qzeros`` in the layout AutoAWQ writes, from candle-vllm's Marlin-shuffled ones."""
    words = _words("qzeros", qzeros)
    shape = (words.shape[0], words.shape[1] * 8)
    if shape[1] % SCALE_PERM.size:
        raise ValueError(f"qzeros has shape {words.shape}; Marlin needs out a multiple of 64")
    runs = _unpack_columns(words, "qzeros", shape, BITS, AWQ_ORDER).reshape(-1, SCALE_PERM.size)
    zeros = np.empty_like(runs)
    zeros[:, SCALE_PERM] = runs
    return _pack_columns(zeros.reshape(shape), AWQ_ORDER, BITS)
