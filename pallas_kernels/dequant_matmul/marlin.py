"""Marlin-layout 4-bit tensors -> ``HostPacked``: the tile shuffle undone once at load.

Marlin (IST-DASLab's kernel, and vLLM's and candle-vllm's copies of it) stores a symmetric 4-bit
GPTQ weight ``[in, out]`` (codes ``q = round(w / s) + 8``) shuffled for its tensor-core loads:

| tensor | layout |
|---|---|
| ``B`` | int32 ``[in / 16, 2 * out]``: the weight cut into 16 x 16 tiles, each tile row of the grid laid out as one row of ``16 * out`` codes (tile after tile, each row-major), every run of 1024 codes (four tiles side by side, 64 columns) shuffled as below, then eight codes per word, low nibble first |
| ``s`` | float16 ``[groups, out]``: the scales, every run of 64 shuffled by ``SCALE_PERM`` when there are several groups, every run of 32 by ``SCALE_PERM_SINGLE`` when one group spans ``in`` |

There is no ``qzeros`` (every zero is 8) and no ``g_idx`` (act-order is not supported). The
shuffle: thread ``t`` of a warp (32 of them) owns, in each 16 x 16 tile, the elements at rows
``2 (t % 4) + (0, 1, 8, 9)`` of column ``t // 4`` and of column ``t // 4 + 8`` (the ``mma.m16n8k16``
B fragments of both 8-column halves); its eight codes of one tile go in the order
``(0, 2, 4, 6, 1, 3, 5, 7)`` so that the dequantizer's shifts pair them up, and a thread's four
tiles follow each other. So the 128 words of a run are indexed ``[column 8, t % 4, tile 4]`` and
a word's codes, in that order, ``[half 2, row / 8, row % 2]``: one transpose undoes it.

candle-vllm's ``convert_awq_marlin.py`` leaves an AWQ folder's ``qweight`` and ``scales`` as they
are and rewrites only ``qzeros``: the zero points of each 64-column run shuffled by ``SCALE_PERM``,
then packed with AWQ's own interleave. ``awq_zeros_from_marlin`` reads them back.
"""

from __future__ import annotations

import numpy as np

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.gptq import (
    AWQ_ORDER,
    BITS,
    _groups,
    _scales,
    _unpack_columns,
    _words,
)

TILE = 16  # Marlin's tiles are 16 x 16 codes
ZERO = 1 << (BITS - 1)  # Marlin's implicit zero point
RUN = 4 * TILE * TILE  # codes shuffled together: four tiles side by side, 64 columns
# Nibble q of a word holds the thread's code number AWQ_ORDER[q]; listed by code number:
CODE_SHIFTS = (4 * np.argsort(AWQ_ORDER)).astype(np.uint32)


def _scale_perms() -> tuple[np.ndarray, np.ndarray]:  # int64 [64], int64 [32]
    grouped = np.arange(64).reshape(8, 8).T.reshape(64)  # i + 8 j, j fastest
    single = (2 * np.arange(4)[:, None] + np.array([0, 1, 8, 9, 16, 17, 24, 25])).reshape(32)
    return grouped, single


SCALE_PERM, SCALE_PERM_SINGLE = _scale_perms()


def from_marlin(
    b: np.ndarray,  # int32 [in / 16, 2 * out]
    s: np.ndarray,  # float16 [groups, out]
    *,
    group_size: int,
) -> HostPacked:  # codes [in, out], d = scales, z = 8 per group and column
    """A Marlin linear as ``HostPacked`` (the same one its GPTQ original loads to)."""
    words = _words("B", b)
    # a tile row holds 16 * out codes, eight to a word: 2 * out words
    k, n = words.shape[0] * TILE, words.shape[1] * 8 // TILE
    if words.shape[1] % (2 * RUN // TILE):
        raise ValueError(
            f"B has shape {words.shape}; Marlin needs [in / 16, 2 * out] with out a multiple of 64"
        )
    groups, _ = _groups(k, group_size)
    words = words.reshape(k // TILE, n // 64, 8, 4, 4)  # [tile rows, runs, column, t % 4, tile]
    codes = np.empty((*words.shape, 8), np.uint8)  # [..., code (half, row / 8, row % 2)]
    for code, shift in enumerate(CODE_SHIFTS):  # a broadcast over 8 codes is 20x slower
        codes[..., code] = (words >> shift).astype(np.uint8) & 15
    codes = codes.reshape(*words.shape, 2, 2, 2)
    # in = 16 tile_row + 8 (row / 8) + 2 (t % 4) + row % 2; out = 64 run + 16 tile + 8 half + column
    codes = codes.transpose(0, 6, 3, 7, 1, 4, 5, 2).reshape(k, n)
    perm = SCALE_PERM if groups > 1 else SCALE_PERM_SINGLE
    scales = _scales(s, (groups, n)).reshape(-1, perm.size)
    d = np.empty_like(scales)
    d[:, perm] = scales
    return HostPacked(
        codes=codes,
        bits=BITS,
        d=d.reshape(groups, n),
        z=np.full((groups, n), ZERO, np.uint8),
    )


def awq_zeros_from_marlin(
    qzeros: np.ndarray,  # int32 [groups, out / 8], as convert_awq_marlin.py writes it
) -> np.ndarray:  # uint8 [groups, out]
    """The zero points of candle-vllm's Marlin-shuffled AWQ ``qzeros``, in column order."""
    words = _words("qzeros", qzeros)
    shape = (words.shape[0], words.shape[1] * 8)
    if shape[1] % SCALE_PERM.size:
        raise ValueError(f"qzeros has shape {words.shape}; Marlin needs out a multiple of 64")
    runs = _unpack_columns(words, "qzeros", shape, BITS, AWQ_ORDER).reshape(-1, SCALE_PERM.size)
    zeros = np.empty(runs.shape, np.uint8)
    zeros[:, SCALE_PERM] = runs
    return zeros.reshape(shape)
