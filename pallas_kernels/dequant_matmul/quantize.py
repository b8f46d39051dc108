"""Host-side GGUF quantizers: float rows -> the block bytes llama.cpp would store for them.

In-situ quantization turns a float checkpoint into GGUF blocks at load time, so the bytes follow
llama.cpp's reference quantizers (``quantize_row_*_ref`` in ggml-quants.c):

1. Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 come from ``gguf.quants.quantize``, which matches them byte for
   byte already.
2. Q2_K..Q6_K have no quantizer in ``gguf``. Each super-block of 256 is cut into sub-blocks of 16 or
   32; a per-sub-block search picks a float scale (and min) and codes (``make_qkx2_quants``,
   ``make_q3_quants``, ``make_qx_quants``); the sub-block scales are quantized against one float16
   super-block scale; and a last pass recomputes the codes from those rounded scales.
3. Everything is vectorized over all sub-blocks of a chunk of rows (chunks run in a thread
   pool). Arrays are laid out ``[element, sub_block]``: llama.cpp sums each sub-block left to
   right in float32, and a numpy reduction along axis 0 of a C-contiguous array adds the rows in
   that same order (one along the contiguous axis would sum pairwise), so the sums, and the
   choices made from them, round alike.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
QK_K = 256
_F32 = np.float32
_GROUP_MAX_EPS = _F32(1e-15)  # ggml-quants.c: a sub-block below this is all zeros
_CHUNK_BLOCKS = 2048  # super-blocks per vectorized step: ~2 MiB per float32 work array
_SHIFT_2BIT = np.arange(0, 8, 2, dtype=np.uint8)

QUANT_TYPES: dict[str, T] = {
    "q4_0": T.Q4_0,
    "q4_1": T.Q4_1,
    "q5_0": T.Q5_0,
    "q5_1": T.Q5_1,
    "q8_0": T.Q8_0,
    "q2k": T.Q2_K,
    "q3k": T.Q3_K,
    "q4k": T.Q4_K,
    "q5k": T.Q5_K,
    "q6k": T.Q6_K,
}


def quantize_rows(weight: np.ndarray, qtype: T, *, num_threads: int | None = None) -> np.ndarray:
    """Quantize ``weight`` (``[rows, cols]``, float) to GGUF blocks of ``qtype``.

    Returns ``[rows, cols // block_size * type_size]`` uint8: each row is its run of blocks along
    ``cols``, exactly as a GGUF file stores the tensor. ``cols`` must be a multiple of the type's
    block size (32, or 256 for the k-quants); the weight must be finite. The k-quants work on
    chunks of rows in ``num_threads`` threads (default: one per CPU); the bytes do not depend on it.
    """
    if qtype not in QUANT_TYPES.values():
        names = ", ".join(QUANT_TYPES)
        raise ValueError(f"cannot quantize to {qtype!r}; supported types: {names}")
    weight = np.asarray(weight)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [rows, cols], got shape {weight.shape}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = weight.shape
    if cols % block_size:
        raise ValueError(
            f"{qtype.name} needs cols divisible by {block_size}, got {cols}; pick another type"
        )
    x = np.ascontiguousarray(weight, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError(f"weight {weight.shape} has NaN or Inf values; fix the checkpoint first")
    out_shape = (rows, cols // block_size * type_size)
    if qtype not in _K_QUANTIZERS:
        return np.asarray(gguf.quants.quantize(x, qtype), dtype=np.uint8).reshape(out_shape)
    blocks = x.reshape(-1, QK_K)  # [num_blocks, 256]
    chunks = [blocks[i : i + _CHUNK_BLOCKS] for i in range(0, blocks.shape[0], _CHUNK_BLOCKS)]
    quantize = functools.partial(_quantize_chunk, _K_QUANTIZERS[qtype])
    workers = min(num_threads or os.cpu_count() or 1, len(chunks))
    if workers <= 1:
        parts = list(map(quantize, chunks))
    else:  # numpy drops the GIL inside each array operation, so chunks run in parallel
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(quantize, chunks))
    return np.concatenate(parts or [np.empty((0, type_size), np.uint8)]).reshape(out_shape)


def _quantize_chunk(fn: Callable[[np.ndarray], np.ndarray], blocks: np.ndarray) -> np.ndarray:
    # Zero scales and degenerate fits divide by zero on purpose; their results are masked out.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return fn(blocks)


# ---------------------------------------------------------------- shared helpers


def _nearest_int(v: np.ndarray) -> np.ndarray:  # float32 [...] -> int32 [...]
    """llama.cpp's ``nearest_int``: round half to even through the float32 mantissa.

    Exact ``np.rint`` for ``|v| < 2**22``; beyond that it wraps the way the C code does, which
    matters where an unbounded quotient is clamped afterwards.
    """
    bits = (v.astype(_F32, copy=False) + _F32(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def _round_clip(v: np.ndarray, lo: int, hi: int) -> np.ndarray:  # float32 -> float32, in place
    """``nearest_int`` then clamp, for arguments known to be small (the scale searches)."""
    np.rint(v, out=v)
    return np.clip(v, lo, hi, out=v)


def _by_element(blocks: np.ndarray, n: int) -> np.ndarray:  # [nb, 256] -> [n, nb * 256 // n]
    return np.ascontiguousarray(blocks.reshape(-1, n).T)


def _to_blocks(codes: np.ndarray, nb: int) -> np.ndarray:  # [n, nb * 256 // n] -> [nb, 256]
    return codes.T.reshape(nb, QK_K).astype(np.uint8)


def _f16_bytes(v: np.ndarray) -> np.ndarray:  # [nb] float16 -> [nb, 2] uint8
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _signed_absmax(v: np.ndarray, axis: int) -> np.ndarray:
    """The entry of largest magnitude along ``axis`` (the first on ties), sign kept."""
    idx = np.expand_dims(np.abs(v).argmax(axis=axis), axis)
    return np.take_along_axis(v, idx, axis).squeeze(axis)


def _quantize_scales(v: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative sub-block scales ``[nb, s]`` -> codes (int32, as a C uint8 cast) and fp16 d."""
    top = v.max(axis=1)
    top = np.where(top > 0, top, _F32(0))  # llama.cpp starts its running max at +0
    inv = np.where(top > 0, levels / np.where(top > 0, top, _F32(1)), _F32(0))
    return _nearest_int(inv[:, None] * v) & 0xFF, (top / _F32(levels)).astype(np.float16)


def _requantize(
    x: np.ndarray,  # [n, m]
    codes: np.ndarray,  # [n, m] codes from the search, kept where the sub-block scale is 0
    d: np.ndarray,  # [m] float32 sub-block scale after float16 rounding
    dm: np.ndarray | np.float32,  # [m] float32 sub-block min (0 for the symmetric types)
    lo: int,
    hi: int,
) -> np.ndarray:  # [n, m] int32 codes, shifted to start at 0
    """llama.cpp's last pass: the codes that the stored (rounded) scales call for."""
    live = d != 0
    q = _nearest_int((x + dm) / np.where(live, d, _F32(1)))
    return np.where(live, np.clip(q, lo, hi) - lo, codes)


def _pack_crumbs(codes: np.ndarray) -> np.ndarray:  # [nb, 256] 2-bit -> [nb, 64]
    crumbs = codes.reshape(-1, 2, 4, 32) << _SHIFT_2BIT[:, None]
    return np.bitwise_or.reduce(crumbs, axis=2).reshape(-1, 64)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:  # [nb, 256] 4-bit -> [nb, 128]
    c = codes.reshape(-1, 4, 2, 32)
    return (c[:, :, 0] | c[:, :, 1] << 4).reshape(-1, 128)


def _pack_bit_planes(bits: np.ndarray) -> np.ndarray:  # [nb, 256] 0/1 -> [nb, 32]
    """Byte ``j`` holds element ``32 * b + j`` at bit ``b`` (Q3_K's hmask, Q5_K's qh)."""
    planes = bits.reshape(-1, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]
    return np.bitwise_or.reduce(planes, axis=1)


# ---------------------------------------------------------------- sub-block searches


@dataclass(frozen=True)
class _AffineFit:
    scale: np.ndarray  # [m] float32
    min: np.ndarray  # [m] float32, subtracted: x ~ scale * code - min
    codes: np.ndarray  # [n, m] float32 codes in 0..nmax


def _fit_error(
    x: np.ndarray,  # [n, m]
    w: np.ndarray,  # [n, m]
    codes: np.ndarray,  # [n, m]
    scale: np.ndarray,  # [m]
    offset: np.ndarray,  # [m]
    use_mad: bool,
    out: np.ndarray,  # [n, m] scratch
) -> np.ndarray:  # [m]
    """``sum(w * |scale * codes + offset - x|)`` per sub-block, squared unless ``use_mad``."""
    np.multiply(codes, scale, out=out)
    out += offset
    out -= x
    if use_mad:
        np.abs(out, out=out)
    else:
        out *= out
    out *= w
    return out.sum(axis=0)


def _make_qkx2_quants(
    x: np.ndarray,  # [n, m]
    w: np.ndarray,  # [n, m] importance of each element
    nmax: int,
    rmin: float,
    nstep: int,
    use_mad: bool,
) -> _AffineFit:
    """``make_qkx2_quants``: try ``nstep + 1`` inverse scales, refit scale and min by weighted
    least squares for each, keep the fit of least weighted error. As in llama.cpp, each trial
    grid spans ``[best min so far, max]``, so an accepted fit moves the grids after it."""
    lo = x.min(axis=0)
    lo = np.where(lo > 0, _F32(0), lo)
    hi = x.max(axis=0)
    sum_w, sum_x = w.sum(axis=0), (w * x).sum(axis=0)
    flat = hi == lo
    iscale = nmax / np.where(flat, _F32(1), hi - lo)
    scale, offset = 1 / iscale, lo
    codes = _round_clip(iscale * (x - lo), 0, nmax)
    trial, wl, scratch = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    best = _fit_error(x, w, codes, scale, offset, use_mad, out=scratch)
    for step in range(nstep + 1):
        iscale = (_F32(rmin) + _F32(0.1) * _F32(step) + _F32(nmax)) / (hi - offset)
        np.subtract(x, offset, out=trial)
        trial *= np.where(flat, _F32(0), iscale)
        _round_clip(trial, 0, nmax)
        np.multiply(w, trial, out=wl)
        sum_l = wl.sum(axis=0)
        sum_l2 = np.multiply(wl, trial, out=scratch).sum(axis=0)
        sum_xl = np.multiply(wl, x, out=scratch).sum(axis=0)
        det = sum_w * sum_l2 - sum_l * sum_l
        t_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        t_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        t_scale = np.where(t_min > 0, sum_xl / sum_l2, t_scale)
        t_min = np.where(t_min > 0, _F32(0), t_min)
        err = _fit_error(x, w, trial, t_scale, t_min, use_mad, out=scratch)
        better = (det > 0) & (err < best)
        np.copyto(codes, trial, where=better)
        best = np.where(better, err, best)
        scale = np.where(better, t_scale, scale)
        offset = np.where(better, t_min, offset)
    codes[:, flat] = 0
    return _AffineFit(scale=np.where(flat, _F32(0), scale), min=-offset, codes=codes)


def _make_q3_quants(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [16, m] -> [m], [16, m]
    """``make_q3_quants(nmax=4, do_rmse=true)``: round with ``-4 / max``, then up to five passes
    of per-element moves that raise the x**2-weighted fit; returns the scale and codes 0..7."""
    nmax = 4
    peak = _signed_absmax(x, 0)
    zero = np.abs(peak) < _GROUP_MAX_EPS
    codes = _round_clip(-nmax / np.where(zero, _F32(1), peak) * x, -nmax, nmax - 1)
    w = x * x
    wx = w * x
    sumlx, suml2 = (wx * codes).sum(axis=0), (w * codes * codes).sum(axis=0)
    for _ in range(5):
        changed = False
        for i in range(x.shape[0]):
            li = codes[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - w[i] * li * li
            new = np.clip(_nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1).astype(_F32)
            new_slx = slx + wx[i] * new
            new_sl2 = sl2 + w[i] * new * new
            take = (slx > 0) & (new != li) & (new_sl2 > 0)
            take &= new_slx * new_slx * suml2 > sumlx * sumlx * new_sl2
            np.copyto(li, new, where=take)
            sumlx = np.where(take, new_slx, sumlx)
            suml2 = np.where(take, new_sl2, suml2)
            changed = changed or bool(take.any())
        if not changed:  # a pass that moves nothing leaves the state for the next one unchanged
            break
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, _F32(1)), _F32(0))
    codes += nmax
    codes[:, zero] = 0
    return np.where(zero, _F32(0), scale), codes


def _make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``make_qx_quants(rmse_type=1)`` without importance weights: round with
    ``-(nmax + 0.1 * k) / max`` for k in -9..9 and keep the best x**2-weighted least-squares fit.

    ``x`` is ``[n, m]``; returns the scale ``[m]`` and codes ``[n, m]`` in 0..2*nmax-1.
    """
    peak = _signed_absmax(x, 0)
    zero = np.abs(peak) < _GROUP_MAX_EPS
    peak = np.where(zero, _F32(1), peak)
    w = x * x
    wx = w * x

    def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        codes = _round_clip(iscale * x, -nmax, nmax - 1)
        return codes, (wx * codes).sum(axis=0), (w * codes * codes).sum(axis=0)

    codes, sumlx, suml2 = trial(-nmax / peak)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, _F32(1)), _F32(0))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        trial_codes, sumlx, suml2 = trial(-(_F32(nmax) + _F32(0.1) * _F32(step)) / peak)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        np.copyto(codes, trial_codes, where=better)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    codes += nmax
    codes[:, zero] = 0
    return np.where(zero, _F32(0), scale), codes


# ---------------------------------------------------------------- one function per k-quant
# Each takes super-blocks [nb, 256] float32 and returns their block bytes [nb, type_size].


def _quantize_q2k(blocks: np.ndarray) -> np.ndarray:  # -> [nb, 84]
    nb = blocks.shape[0]
    x = _by_element(blocks, 16)
    fit = _make_qkx2_quants(x, np.abs(x), nmax=3, rmin=-0.5, nstep=15, use_mad=True)
    ls, d = _quantize_scales(fit.scale.reshape(nb, 16), 15)
    lm, dmin = _quantize_scales(fit.min.reshape(nb, 16), 15)
    packed = (ls | lm << 4) & 0xFF  # [nb, 16]: scale in the low nibble, min in the high
    d_sub = d.astype(_F32)[:, None] * (packed & 0xF).astype(_F32)
    dm_sub = dmin.astype(_F32)[:, None] * (packed >> 4).astype(_F32)
    codes = _requantize(x, fit.codes, d_sub.reshape(-1), dm_sub.reshape(-1), 0, 3)
    qs = _pack_crumbs(_to_blocks(codes, nb))
    return np.concatenate([packed.astype(np.uint8), qs, _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _quantize_q3k(blocks: np.ndarray) -> np.ndarray:  # -> [nb, 110]
    nb = blocks.shape[0]
    x = _by_element(blocks, 16)
    scales, codes = _make_q3_quants(x)
    scales = scales.reshape(nb, 16)
    top = _signed_absmax(scales, 1)
    live = top != 0
    iscale = np.where(live, -32 / np.where(live, top, _F32(1)), _F32(0))
    ls = np.where(live[:, None], np.clip(_nearest_int(iscale[:, None] * scales), -32, 31) + 32, 0)
    d = np.where(live, 1 / iscale, _F32(0)).astype(np.float16)
    d_sub = d.astype(_F32)[:, None] * (ls - 32).astype(_F32)
    codes = _to_blocks(_requantize(x, codes, d_sub.reshape(-1), _F32(0), -4, 3), nb)
    high = codes > 3
    low = np.where(high, codes - 4, codes)
    # Low nibbles: sub-block j in byte j % 8 at bit 4 * (j // 8); top 2 bits: byte 8 + j % 4 at
    # bit 2 * (j // 4).
    lo_nib = (ls & 0xF).astype(np.uint8)
    hi_bits = (ls >> 4).astype(np.uint8).reshape(nb, 4, 4) << _SHIFT_2BIT[:, None]
    packed = np.concatenate(
        [lo_nib[:, :8] | lo_nib[:, 8:] << 4, np.bitwise_or.reduce(hi_bits, axis=1)], axis=1
    )
    planes = [_pack_bit_planes(high), _pack_crumbs(low), packed, _f16_bytes(d)]
    return np.concatenate(planes, axis=1)


@dataclass(frozen=True)
class _K4Blocks:
    """What Q4_K and Q5_K share: 8 sub-blocks of 32 with 6-bit scales and mins."""

    codes: np.ndarray  # [nb, 256] uint8 in 0..nmax
    head: np.ndarray  # [nb, 16] uint8: d, dmin (float16) and the 12 packed scale/min bytes


def _quantize_k4(blocks: np.ndarray, nmax: int, rmin: float, nstep: int) -> _K4Blocks:
    nb = blocks.shape[0]
    x = _by_element(blocks, 32)
    av_x = np.sqrt((x * x).sum(axis=0) / _F32(32))
    fit = _make_qkx2_quants(x, av_x + np.abs(x), nmax, rmin, nstep, use_mad=False)
    ls, d = _quantize_scales(fit.scale.reshape(nb, 8), 63)
    lm, dmin = _quantize_scales(fit.min.reshape(nb, 8), 63)
    ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    d_sub = d.astype(_F32)[:, None] * ls.astype(_F32)
    dm_sub = dmin.astype(_F32)[:, None] * lm.astype(_F32)
    codes = _requantize(x, fit.codes, d_sub.reshape(-1), dm_sub.reshape(-1), 0, nmax)
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    # Sub-blocks 0..3 keep 6 bits in bytes 0..7; 4..7 put their low nibbles in bytes 8..11 and
    # their top 2 bits in the spare top bits of bytes 0..7.
    packed = np.concatenate(
        [
            ls[:, :4] | (ls[:, 4:] >> 4) << 6,
            lm[:, :4] | (lm[:, 4:] >> 4) << 6,
            (ls[:, 4:] & 0xF) | (lm[:, 4:] & 0xF) << 4,
        ],
        axis=1,
    )
    head = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed], axis=1)
    return _K4Blocks(codes=_to_blocks(codes, nb), head=head)


def _quantize_q4k(blocks: np.ndarray) -> np.ndarray:  # -> [nb, 144]
    k4 = _quantize_k4(blocks, nmax=15, rmin=-1.0, nstep=20)
    return np.concatenate([k4.head, _pack_nibbles(k4.codes)], axis=1)


def _quantize_q5k(blocks: np.ndarray) -> np.ndarray:  # -> [nb, 176]
    k4 = _quantize_k4(blocks, nmax=31, rmin=-0.5, nstep=15)
    qh = _pack_bit_planes(k4.codes >> 4)
    return np.concatenate([k4.head, qh, _pack_nibbles(k4.codes & 0xF)], axis=1)


def _quantize_q6k(blocks: np.ndarray) -> np.ndarray:  # -> [nb, 210]
    nb = blocks.shape[0]
    x = _by_element(blocks, 16)
    scales, codes = _make_qx_quants(x, nmax=32)
    scales = scales.reshape(nb, 16)
    top = _signed_absmax(scales, 1)
    zero = np.abs(top) < _GROUP_MAX_EPS  # llama.cpp writes an all-zero block
    iscale = -128 / np.where(zero, _F32(1), top)
    d = (1 / iscale).astype(np.float16)
    sc = (np.minimum(_nearest_int(iscale[:, None] * scales), 127) & 0xFF).astype(np.uint8)
    d_sub = d.astype(_F32)[:, None] * sc.view(np.int8).astype(_F32)
    codes = _to_blocks(_requantize(x, codes, d_sub.reshape(-1), _F32(0), -32, 31), nb)
    c = (codes & 0xF).reshape(nb, 2, 4, 32)
    ql = (c[:, :, 0:2] | c[:, :, 2:4] << 4).reshape(nb, 128)
    out = np.concatenate([ql, _pack_crumbs(codes >> 4), sc, _f16_bytes(d)], axis=1)
    out[zero] = 0
    return out


_K_QUANTIZERS: dict[T, Callable[[np.ndarray], np.ndarray]] = {
    T.Q2_K: _quantize_q2k,
    T.Q3_K: _quantize_q3k,
    T.Q4_K: _quantize_q4k,
    T.Q5_K: _quantize_q5k,
    T.Q6_K: _quantize_q6k,
}
