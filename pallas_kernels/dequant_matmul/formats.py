"""Packed weight formats: every supported block quantization as one pytree, ``PackedWeight``.

All the formats share one dequantization formula, evaluated in float32 per element of an
``[..., in, out]`` weight (``k`` along ``in``, ``n`` along ``out``)::

    w[k, n] = (d[k // gd, n] * sc[k // gs, n]) * (q[k, n] - z) - mn[k // gm, n] * m[k // gm', n]

- ``q``: unsigned integer codes of ``bits`` bits, stored in bit planes (``PLANES``);
- ``d``: the float16 block scale; ``sc``: an optional integer sub-block scale (k-quants);
- ``z``: the code of zero, a constant of the format (8 for Q4_0) or a per-group array (GPTQ/AWQ);
- ``mn``: an optional float16 block minimum; ``m``: an optional integer sub-block minimum.

A factor that a format lacks is left out of the product, not multiplied in as 1, so the float32
arithmetic is the same as each format's own dequantizer and the result is bit-exact with
``gguf.quants.dequantize`` (the sub-scale products ``d * sc`` are exact in float32, so nothing
rounds where the GGUF code does not). The table of how each GGUF type maps onto the formula:

| type | bits | d per | sc | z | mn, m |
|---|---|---|---|---|---|
| Q4_0, Q5_0, Q8_0 | 4, 5, 8 | 32 | - | 8, 16, 128 | - |
| Q4_1, Q5_1 | 4, 5 | 32 | - | 0 | ``mn = -min`` per 32 |
| Q2_K | 2 | 256 | uint4 per 16 | 0 | ``dmin`` per 256, uint4 per 16 |
| Q3_K | 3 | 256 | int6 - 32 per 16 | 4 | - |
| Q4_K, Q5_K | 4, 5 | 256 | uint6 per 32 | 0 | ``dmin`` per 256, uint6 per 32 |
| Q6_K | 6 | 256 | int8 per 16 | 32 | - |
| GPTQ / AWQ 4-bit | 4 | group | - | uint4 per group | - |

One format is not affine: MXFP4 (OCP Microscaling, gpt-oss's experts) has ``codebook``
"e2m1", whose 4-bit codes index the FP4 E2M1 values (``CODEBOOKS``: sign, two exponent bits, one
mantissa bit), and its ``d`` is one uint8 E8M0 exponent per 32 codes, the scale ``2 ** (d - 127)``
(255 is NaN)::

    w[k, n] = 2 ** (d[k // 32, n] - 127) * E2M1[q[k, n]]

Both factors are powers of two times a value of two significant bits, so the float32 product is
exact wherever it is a normal float32, as in the format's own dequantizer (exponent 0, a
subnormal 2 ** -127, is zero where the backend flushes subnormals, as XLA:CPU does).

Bit planes: codes of 8, 6, 5, 4, 3 and 2 bits are split into planes of (8), (4, 2), (4, 1), (4),
(2, 1) and (2) bits. A plane of ``b`` bits packs each run of 32 codes along ``in`` into ``4 * b``
bytes; byte ``j`` of a run holds codes ``j + s * 4 * b`` at bit ``s * b``. Unpacking is shifts and
a reshape, with no gathers, and a tile of whole runs along ``in`` unpacks on its own (kernels).

Device bytes per weight: Q4_0 4.5 bits, Q4_1 5, Q8_0 8.5, Q4_K 4.625 (GGUF packs its 6-bit
sub-scales and mins into 12 bytes, 4.5; here they are one byte each so that no kernel has to
unpick them), Q6_K 6.5625.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

RUN = 32  # codes per packed run along ``in``
PLANES = {8: (8,), 6: (4, 2), 5: (4, 1), 4: (4,), 3: (2, 1), 2: (2,)}
# Code -> value tables of the non-affine formats (see the module docstring).
CODEBOOKS = {
    "e2m1": (
        0.0,
        0.5,
        1.0,
        1.5,
        2.0,
        3.0,
        4.0,
        6.0,
        -0.0,
        -0.5,
        -1.0,
        -1.5,
        -2.0,
        -3.0,
        -4.0,
        -6.0,
    ),
}
E8M0_BIAS, E8M0_NAN = 127, 255


@struct.dataclass
class PackedWeight:
    """A quantized ``[..., in, out]`` weight; leading axes (layers, experts) stack like a float one.

    Each group array is ``[..., in // group, out]``; ``z`` may also be ``[..., 1, 1]`` (one zero
    code per stacked matrix, for layers of different GGUF types stacked together).
    """

    planes: tuple[jax.Array, ...]  # uint8 [..., in * bits_i // 8, out] per plane
    d: jax.Array  # float16 [..., in // gd, out]
    sc: jax.Array | None = None  # int8 [..., in // gs, out]
    z: jax.Array | None = None  # uint8 [..., in // gz, out] or [..., 1, 1]; None: ``zero``
    mn: jax.Array | None = None  # float16 [..., in // gm, out]
    m: jax.Array | None = None  # uint8 [..., in // gm', out]
    bits: int = struct.field(pytree_node=False, default=4)
    zero: int = struct.field(pytree_node=False, default=0)
    # The dtype callers round activations to before ``dequant_matmul`` (which rounds the weight
    # to the activations' dtype); None keeps the activations' own dtype.
    operand_dtype: str | None = struct.field(pytree_node=False, default=None)
    # A key of ``CODEBOOKS``: codes index its values and ``d`` is uint8 E8M0 (MXFP4); None: the
    # affine formula.
    codebook: str | None = struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        lead, packed, out = (
            self.planes[0].shape[:-2],
            self.planes[0].shape[-2],
            self.planes[0].shape[-1],
        )
        return (*lead, packed * 8 // PLANES[self.bits][0], out)

    @property
    def nbytes(self) -> int:
        """Device bytes of every array of the weight."""
        arrays = (*self.planes, self.d, self.sc, self.z, self.mn, self.m)
        return sum(a.size * a.dtype.itemsize for a in arrays if a is not None)


@struct.dataclass
class PackedLayer:
    """Matrix ``index`` of a stacked ``[layers, in, out]`` ``PackedWeight``, not sliced out.

    Inside a layer scan, XLA copies a stacked operand's per-layer slice before a custom call;
    the native CPU kernel reads the matrix in the whole stack instead. Every other
    implementation dequantizes ``matrix()``, a slice XLA fuses into its dequantization.
    """

    stack: PackedWeight  # [layers, in, out]
    index: jax.Array  # [] int32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]

    @property
    def operand_dtype(self) -> str | None:
        return self.stack.operand_dtype

    def matrix(self) -> PackedWeight:  # [in, out]
        """The one matrix, sliced out of the stack."""
        return jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, self.index, 0, False), self.stack
        )


@dataclass
class HostPacked:
    """``PackedWeight``'s host form before packing: codes one per byte, arrays in numpy."""

    codes: np.ndarray  # uint8 [..., in, out]
    bits: int
    d: np.ndarray  # float16 [..., in // gd, out]
    sc: np.ndarray | None = None  # int8
    z: np.ndarray | int = 0  # uint8 group array, or the format's constant
    mn: np.ndarray | None = None  # float16
    m: np.ndarray | None = None  # uint8
    codebook: str | None = None  # see ``PackedWeight.codebook`` (``d`` is then uint8 E8M0)

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> HostPacked:
        """``fn`` applied to every array (a constant ``z`` stays as it is)."""
        get = lambda a: None if a is None else fn(a)  # noqa: E731
        z = self.z if isinstance(self.z, int) else fn(self.z)
        return HostPacked(
            fn(self.codes), self.bits, fn(self.d), get(self.sc), z, get(self.mn), get(self.m),
            self.codebook,
        )  # fmt: skip

    def __getitem__(self, index) -> HostPacked:
        """Indexed on the leading (layer, expert) axes, like the float array it stands for."""
        return self.map(lambda a: a[index])

    def to_device(
        self, operand_dtype: str | None = None, memory: jax.memory.Space | None = None
    ) -> PackedWeight:
        """Pack the codes into bit planes and move every array to the default device, into its
        ``memory`` (``jax.memory.Space.Host``: its pinned host memory; default: device memory)."""
        move = jnp.asarray if memory is None else lambda a: jax.device_put(a, memory)
        put = lambda a: None if a is None else move(a)  # noqa: E731
        constant = isinstance(self.z, int)
        return PackedWeight(
            planes=tuple(move(p) for p in pack_planes(self.codes, self.bits)),
            d=put(self.d),
            sc=put(self.sc),
            z=None if constant else put(self.z),
            mn=put(self.mn),
            m=put(self.m),
            bits=self.bits,
            zero=self.z if constant else 0,
            operand_dtype=operand_dtype,
            codebook=self.codebook,
        )


def pack_planes(
    codes: np.ndarray,  # uint8 [..., in, out], values < 2**bits
    bits: int,
) -> list[np.ndarray]:  # uint8 [..., in * b // 8, out] per plane of b bits
    """Split codes into the bit planes of ``PLANES[bits]`` (see the module docstring)."""
    if bits not in PLANES:
        raise ValueError(f"bits must be one of {sorted(PLANES)}, got {bits}")
    *lead, k, n = codes.shape
    if k % RUN:
        raise ValueError(f"the in dimension ({k}) must be a multiple of {RUN}")
    planes, shift = [], 0
    for b in PLANES[bits]:
        part = (codes >> shift) & ((1 << b) - 1)
        per_byte = 8 // b
        runs = part.reshape(*lead, k // RUN, per_byte, RUN // per_byte, n)
        packed = np.zeros((*lead, k // RUN, RUN // per_byte, n), np.uint8)
        for s in range(per_byte):
            packed |= (runs[..., s, :, :] << (s * b)).astype(np.uint8)
        planes.append(packed.reshape(*lead, k * b // 8, n))
        shift += b
    return planes


def unpack_planes(
    planes: tuple[jax.Array, ...],  # uint8 [..., in * b // 8, out] per plane
    bits: int,
) -> jax.Array:  # int32 [..., in, out]
    """The codes of ``pack_planes``, as int32."""
    codes, shift = None, 0
    for plane, b in zip(planes, PLANES[bits], strict=True):
        *lead, rows, n = plane.shape
        per_byte = 8 // b
        runs = plane.astype(jnp.int32).reshape(
            *lead, rows // (RUN // per_byte), 1, RUN // per_byte, n
        )
        shifts = (jnp.arange(per_byte, dtype=jnp.int32) * b).reshape(per_byte, 1, 1)
        part = ((runs >> shifts) & ((1 << b) - 1)).reshape(*lead, rows * per_byte, n)
        codes = part if codes is None else codes | (part << shift)
        shift += b
    return codes


def evaluate(
    xp,  # numpy or jax.numpy
    q,  # int32 [..., in, out] codes
    d,  # float16 [..., in // gd, out]
    sc=None,  # int [..., in // gs, out]
    z=None,  # uint8 [..., in // gz, out] or [..., 1, 1]
    zero: int = 0,  # the zero code when ``z`` is None
    mn=None,  # float16 [..., in // gm, out]
    m=None,  # int [..., in // gm', out]
    codebook: str | None = None,  # a key of CODEBOOKS: ``d`` is uint8 E8M0, the rest unused
):  # float32 [..., in, out]
    """The module docstring's formula in float32, with ``xp`` arrays: the one definition that
    the device reference, the kernel's tiles and the host loader all evaluate."""
    if codebook is not None:
        return _evaluate_codebook(xp, q, d, codebook)
    *lead, k, n = q.shape
    groups = max(a.shape[-2] for a in (d, sc, z, mn, m) if a is not None)

    def per_group(a):  # [..., g, out] -> [..., groups, 1, out] (or a broadcastable 1)
        if a.shape[-2] not in (1, groups):
            a = xp.repeat(a, groups // a.shape[-2], axis=-2)
        return a[..., :, None, :]

    q = q.reshape(*lead, groups, k // groups, n)
    if z is not None:
        q = q - per_group(z).astype(xp.int32)
    elif zero:
        q = q - zero
    scale = per_group(d).astype(xp.float32)
    if sc is not None:
        scale = scale * per_group(sc).astype(xp.float32)
    out = scale * q.astype(xp.float32)
    if mn is not None:
        low = per_group(mn).astype(xp.float32)
        if m is not None:
            low = low * per_group(m).astype(xp.float32)
        out = out - low
    return out.reshape(*lead, k, n)


def _evaluate_codebook(
    xp,  # numpy or jax.numpy
    q,  # int32 [..., in, out] codes
    d,  # uint8 [..., in // group, out] E8M0 exponents
    codebook: str,
):  # float32 [..., in, out]
    """``2 ** (d - 127) * CODEBOOKS[codebook][q]`` (the module docstring's MXFP4)."""
    *lead, k, n = q.shape
    groups = d.shape[-2]
    values = xp.asarray(CODEBOOKS[codebook], dtype=xp.float32)[q]
    # 255 (NaN) is replaced below; the minimum only keeps it out of ldexp.
    exponent = xp.minimum(d.astype(xp.int32), E8M0_NAN - 1) - E8M0_BIAS
    scale = xp.where(d == E8M0_NAN, xp.nan, xp.ldexp(xp.ones_like(exponent, xp.float32), exponent))
    scale = scale.astype(xp.float32)[..., :, None, :]  # [..., groups, 1, out]
    with _overflow_ok(xp):  # 6 * 2 ** 127 is inf, as in the format's own dequantizer
        out = scale * values.reshape(*lead, groups, k // groups, n)
    return out.reshape(*lead, k, n)


def _overflow_ok(xp):
    return np.errstate(over="ignore") if xp is np else contextlib.nullcontext()
