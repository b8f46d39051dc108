"""GPTQ (4 and 8 bits) and AWQ (GEMM, 4 bits) tensors <-> ``HostPacked``: the re-layout done once
at load.

Both formats quantize an ``[in, out]`` weight in groups of ``group_size`` rows along ``in``
(``-1``: one group over all of ``in``) and dequantize as ``w = scales * (q - z)``, which is the
formula of ``formats`` with ``d = scales`` and ``z`` a uint8 group array. They differ only in how
the 4-bit codes sit in int32 words (nibble ``i`` of a word is bits ``4i .. 4i + 3``; 8-bit GPTQ
packs four codes per word the same way, byte ``i`` holding bits ``8i .. 8i + 7``):

| tensor | GPTQ (AutoGPTQ, GPTQModel, optimum) | AWQ GEMM (AutoAWQ, llm-awq) |
|---|---|---|
| ``qweight`` | int32 ``[in / 8, out]``; nibble i of row r: ``q[8r + i, n]`` | int32 ``[in, out / 8]``; nibble i of column c: ``q[k, 8c + ORDER[i]]`` |
| ``qzeros`` | int32 ``[groups, out / 8]``; nibble i of column c: ``z[g, 8c + i]`` (minus one in v1) | int32 ``[groups, out / 8]``, the same interleave as ``qweight`` |
| ``scales`` | float16 ``[groups, out]`` | float16 ``[groups, out]`` |
| ``g_idx`` | int32 ``[in]``, the group of each input row | - |

``ORDER = (0, 2, 4, 6, 1, 3, 5, 7)`` is AutoAWQ's ``order_map``, the interleave its CUDA
dequantizer wants. GPTQ's ``checkpoint_format`` "gptq" (v1, AutoGPTQ and the default that
transformers and GPTQModel write) stores each zero minus one; readers add one back per nibble
without masking (the ExLlama kernels and vLLM's ``zero_offset``), so v1 holds zeros 1..16 and
cannot hold 0. "gptq_v2" (GPTQModel) stores zeros as they are. ``g_idx`` other than
``arange(in) // group_size`` comes from act-order (``desc_act=True``) and is rejected: its rows
would need a permutation this layout does not carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import HostPacked

BITS = 4  # AWQ's only width, and GPTQ's usual one
GPTQ_BITS = (4, 8)
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble i holds column 8c + AWQ_ORDER[i]
GPTQ_FORMATS = ("gptq", "gptq_v2")


def _per_word(bits: int) -> int:
    """Codes per int32."""
    return 32 // bits


def _shifts(bits: int) -> np.ndarray:
    return np.arange(_per_word(bits), dtype=np.uint32) * bits


@dataclass
class GPTQTensors:
    """One linear layer's tensors as a GPTQ checkpoint stores them (``[in, out]`` orientation)."""

    qweight: np.ndarray  # int32 [in / 8, out]
    qzeros: np.ndarray  # int32 [groups, out / 8]
    scales: np.ndarray  # float16 [groups, out]
    g_idx: np.ndarray  # int32 [in]


@dataclass
class AWQTensors:
    """One linear layer's tensors as an AWQ GEMM checkpoint stores them."""

    qweight: np.ndarray  # int32 [in, out / 8]
    qzeros: np.ndarray  # int32 [groups, out / 8]
    scales: np.ndarray  # float16 [groups, out]


def from_gptq(
    qweight: np.ndarray,  # int32 [in / 8, out]
    qzeros: np.ndarray,  # int32 [groups, out / 8]
    scales: np.ndarray,  # float16 [groups, out]
    g_idx: np.ndarray | None,  # int32 [in], or None where the checkpoint has none
    *,
    bits: int,
    group_size: int,
    sym: bool = True,
    checkpoint_format: str = "gptq",
) -> HostPacked:  # codes [in, out], d = scales, z uint8 [groups, out]
    """A GPTQ linear (``desc_act=False``) as ``HostPacked``; ValueError for what it cannot hold.

    With ``sym`` every zero must be ``2 ** (bits - 1)``, as GPTQ's symmetric quantizer writes it
    (kernels such as Marlin assume it and never read ``qzeros``).
    """
    _check_bits(bits, GPTQ_BITS)
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"GPTQ checkpoint_format {checkpoint_format!r} is not one of {GPTQ_FORMATS}"
        )
    words = _words("qweight", qweight)
    k, n = words.shape[0] * _per_word(bits), words.shape[1]
    groups, _ = _groups(k, group_size)
    zeros = _unpack_columns(_words("qzeros", qzeros), "qzeros", (groups, n), bits)
    if checkpoint_format == "gptq":
        zeros = zeros + 1
        if np.any(zeros > 255):  # an 8-bit v1 zero of 256: nothing stores it
            raise ValueError("qzeros hold a zero point of 256, beyond 8 bits")
    if g_idx is not None:
        if np.shape(g_idx) != (k,):
            raise ValueError(f"g_idx has shape {np.shape(g_idx)}, expected ({k},)")
        check_g_idx(g_idx, group_size)
    if sym and np.any(zeros != 1 << (bits - 1)):
        raise ValueError(f"sym=True, but qzeros hold zero points other than {1 << (bits - 1)}")
    mask = (1 << bits) - 1
    codes = (words[:, None, :] >> _shifts(bits)[None, :, None]) & mask  # [in / w, w, out]
    return HostPacked(
        codes=codes.reshape(k, n).astype(np.uint8),
        bits=bits,
        d=_scales(scales, (groups, n)),
        z=zeros.astype(np.uint8),
    )


def from_awq(
    qweight: np.ndarray,  # int32 [in, out / 8]
    qzeros: np.ndarray,  # int32 [groups, out / 8]
    scales: np.ndarray,  # float16 [groups, out]
    *,
    bits: int,
    group_size: int,
) -> HostPacked:  # codes [in, out], d = scales, z uint8 [groups, out]
    """An AWQ GEMM linear as ``HostPacked``; ValueError for what it cannot hold."""
    _check_bits(bits, (BITS,))
    words = _words("qweight", qweight)
    k, n = words.shape[0], words.shape[1] * _per_word(bits)
    groups, _ = _groups(k, group_size)
    codes = _unpack_columns(words, "qweight", (k, n), bits, AWQ_ORDER)
    d = _scales(scales, (groups, n))
    zeros = _unpack_columns(_words("qzeros", qzeros), "qzeros", (groups, n), bits, AWQ_ORDER)
    return HostPacked(codes=codes.astype(np.uint8), bits=bits, d=d, z=zeros.astype(np.uint8))


def pack_gptq(
    codes: np.ndarray,  # integer [in, out], values < 2**bits
    zeros: np.ndarray,  # integer [groups, out]
    scales: np.ndarray,  # float16 [groups, out]
    *,
    group_size: int,
    bits: int = BITS,
    checkpoint_format: str = "gptq",
) -> GPTQTensors:
    """The GPTQ tensors of integer codes and zeros (the inverse of ``from_gptq``).

    v1 ("gptq") zeros must be 1..2**bits, v2 zeros 0..2**bits - 1.
    """
    _check_bits(bits, GPTQ_BITS)
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"GPTQ checkpoint_format {checkpoint_format!r} is not one of {GPTQ_FORMATS}"
        )
    k, n = codes.shape
    groups, group = _groups(k, group_size)
    top, per_word = (1 << bits) - 1, _per_word(bits)
    _check_codes("codes", codes, 0, top)
    if checkpoint_format == "gptq":
        _check_codes("zeros (v1 stores zero - 1)", zeros, 1, top + 1)
        zeros = np.asarray(zeros, np.int64) - 1
    else:
        _check_codes("zeros", zeros, 0, top)
    if k % per_word or n % per_word or zeros.shape != (groups, n):
        raise ValueError(
            f"codes {codes.shape} and zeros {zeros.shape} do not fit groups of {group}"
        )
    rows = np.asarray(codes, np.uint32).reshape(k // per_word, per_word, n)
    return GPTQTensors(
        qweight=_or_codes(rows, 1, bits),
        qzeros=_pack_columns(zeros, np.arange(per_word), bits),
        scales=_scales(scales, (groups, n)),
        g_idx=(np.arange(k) // group).astype(np.int32),
    )


def pack_awq(
    codes: np.ndarray,  # integer [in, out], values < 16
    zeros: np.ndarray,  # integer [groups, out], values < 16
    scales: np.ndarray,  # float16 [groups, out]
    *,
    group_size: int,
    bits: int = BITS,
) -> AWQTensors:
    """The AWQ GEMM tensors of integer codes and zeros (the inverse of ``from_awq``)."""
    _check_bits(bits, (BITS,))
    k, n = codes.shape
    groups, group = _groups(k, group_size)
    _check_codes("codes", codes, 0, 15)
    _check_codes("zeros", zeros, 0, 15)
    if n % _per_word(bits) or zeros.shape != (groups, n):
        raise ValueError(
            f"codes {codes.shape} and zeros {zeros.shape} do not fit groups of {group}"
        )
    return AWQTensors(
        qweight=_pack_columns(codes, AWQ_ORDER, bits),
        qzeros=_pack_columns(zeros, AWQ_ORDER, bits),
        scales=_scales(scales, (groups, n)),
    )


def _check_bits(bits: int, supported: tuple[int, ...]) -> None:
    if bits not in supported:
        widths = " and ".join(map(str, supported))
        raise ValueError(f"only {widths}-bit weights are supported here, got bits={bits}")


def _groups(k: int, group_size: int) -> tuple[int, int]:
    """(number of groups, rows per group) of ``k`` input rows."""
    group = k if group_size == -1 else group_size
    if group <= 0 or k % group:
        raise ValueError(f"group_size {group_size} does not divide the {k} input features")
    return k // group, group


def _words(name: str, a: np.ndarray) -> np.ndarray:  # uint32 view of an int32 [rows, cols]
    a = np.asarray(a)
    if a.ndim != 2 or a.dtype not in (np.int32, np.uint32):
        raise ValueError(
            f"{name} must be a 2-D int32 array (32-bit packing), got {a.dtype} {a.shape}"
        )
    return np.ascontiguousarray(a).view(np.uint32)


def _unpack_columns(
    words: np.ndarray,  # uint32 [rows, cols / w], w codes per word
    name: str,
    shape: tuple[int, int],
    bits: int,
    order: np.ndarray | None = None,
) -> np.ndarray:  # uint32 [rows, cols]: code i of word c is column w * c + order[i]
    per_word = _per_word(bits)
    if words.shape != (shape[0], shape[1] // per_word) or shape[1] % per_word:
        raise ValueError(
            f"{name} has shape {words.shape}, expected {(shape[0], shape[1] // per_word)}"
        )
    codes = (words[:, :, None] >> _shifts(bits)) & ((1 << bits) - 1)  # [rows, cols / w, w]
    if order is not None:
        codes = codes[:, :, np.argsort(order)]
    return codes.reshape(shape)


def _pack_columns(
    values: np.ndarray,  # integer [rows, cols]
    order: np.ndarray,
    bits: int,
) -> np.ndarray:  # int32 [rows, cols / w]
    rows, mask = values.shape[0], (1 << bits) - 1
    grouped = (np.asarray(values, np.int64) & mask).astype(np.uint32)
    return _or_codes(grouped.reshape(rows, -1, _per_word(bits))[:, :, order], 2, bits)


def _or_codes(codes: np.ndarray, axis: int, bits: int) -> np.ndarray:  # int32, ``axis`` folded
    shifts = _shifts(bits).reshape([-1 if a == axis else 1 for a in range(codes.ndim)])
    return np.ascontiguousarray(np.bitwise_or.reduce(codes << shifts, axis=axis)).view(np.int32)


def _check_codes(name: str, a: np.ndarray, low: int, high: int) -> None:
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.integer) or (a.size and (a.min() < low or a.max() > high)):
        raise ValueError(f"{name} must be integers in {low}..{high}")


def check_g_idx(
    g_idx: np.ndarray,  # integer [in]
    group_size: int,
) -> None:
    """ValueError unless ``g_idx`` is ``arange(in) // group_size``, the order without act-order."""
    g_idx = np.asarray(g_idx)
    if g_idx.ndim != 1:
        raise ValueError(f"g_idx must be 1-D, got shape {g_idx.shape}")
    _, group = _groups(g_idx.shape[0], group_size)
    if np.any(g_idx != np.arange(g_idx.shape[0]) // group):
        raise ValueError(
            "g_idx reorders the input rows (act-order, desc_act=True), which is not supported; "
            "use a checkpoint quantized with desc_act=False"
        )


def _scales(scales: np.ndarray, shape: tuple[int, int]) -> np.ndarray:  # float16 [groups, out]
    """The scales as float16; other float dtypes only where float16 holds them exactly."""
    scales = np.asarray(scales)
    if scales.shape != shape:
        raise ValueError(f"scales has shape {scales.shape}, expected {shape}")
    if scales.dtype == np.float16:
        return np.ascontiguousarray(scales)
    half = scales.astype(np.float16)
    if not np.array_equal(half.astype(np.float32), scales.astype(np.float32)):
        raise ValueError(f"scales of dtype {scales.dtype} do not fit float16 exactly")
    return half
