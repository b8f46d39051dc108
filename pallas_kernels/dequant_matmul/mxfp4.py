"""MXFP4 checkpoint tensors (OCP Microscaling FP4, as gpt-oss stores its experts) -> ``HostPacked``.

A checkpoint keeps a ``[..., out, in]`` matrix as two tensors:

- ``blocks``: uint8 ``[..., out, in // 32, 16]``, two FP4 E2M1 codes per byte, the even input
  feature in the low nibble;
- ``scales``: uint8 ``[..., out, in // 32]``, one E8M0 exponent per 32 input features.

They become the ``[..., in, out]`` codes and exponents of ``formats``' "e2m1" codebook, so that
``reference.dequantize`` evaluates ``2 ** (scale - 127) * E2M1[code]`` per element.
"""

from __future__ import annotations

import numpy as np

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import RUN, HostPacked

BYTES_PER_BLOCK = RUN // 2


def from_mxfp4(
    blocks: np.ndarray,  # uint8 [..., out, in // 32, 16]
    scales: np.ndarray,  # uint8 [..., out, in // 32]
) -> HostPacked:  # [..., in, out]
    """One MXFP4 matrix (or stack of them) as ``HostPacked``; ValueError for mismatched
    shapes or dtypes, naming them."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.ndim < 3 or blocks.shape[-1] != BYTES_PER_BLOCK or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks must be [..., out, in // 32, {BYTES_PER_BLOCK}] and scales "
            f"[..., out, in // 32]; got {blocks.shape} and {scales.shape}"
        )
    *lead, out, groups, _ = blocks.shape
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*lead, out, groups * RUN)
    return HostPacked(
        codes=np.ascontiguousarray(np.swapaxes(codes, -1, -2)),
        bits=4,
        d=np.ascontiguousarray(np.swapaxes(scales, -1, -2)),
        codebook="e2m1",
    )
