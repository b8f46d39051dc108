"""Native CPU dequant-matmul: ``reference.dequant_matmul``'s contract as an XLA FFI call.

XLA:CPU does not fuse the dequantization into its dot, so the reference writes every weight's
float32 matrix on every call. The kernel (``pallas_kernels/native/dequant_matmul.cc``, built by
``pallas_kernels.native``) unpacks a ``[128, 32]`` panel of the weight at a time into a buffer
that stays in L1 and multiplies it into float32 accumulators held in registers, for every
format of ``formats.py`` (one formula, any bit planes, optional ``sc``, ``z``, ``mn``, ``m``),
in blocks of 32 output columns spread over XLA's CPU thread pool.

A stacked weight (``[layers, in, out]`` on every array) goes in whole with the layer index as an
operand, so the decoder's layer scan copies no per-layer slice (the scan's dynamic slice of an
operand of a custom call is a copy; XLA fuses it into the reference's dequantization instead).

``available()`` builds and registers the kernel once (False without a compiler or with
``RUNTIME_NATIVE_KERNELS=0``); ``supports(x, w)`` says whether it reads this weight. Results
match the reference to float32 rounding: the panel is the reference's formula with the final
multiply and subtract fused, and only the order of the sums differs. Activations are multiplied
in float32 (bfloat16 or float16 ones are widened exactly, and the weight is not rounded to their
dtype as the reference does).

``dequant_matmul_group`` multiplies one x by several weights of one format in one call (a
layer's q, k and v; gate and up): x is rounded once and the pool wakes once, and each result
has the bits of its weight's own call.

``int8_activations=True`` (``--matmul-dtype int8``) rounds x in the kernel exactly as
``reference.quantize_activations`` does (int8 codes, one scale per 32 values) and multiplies with
integer dot products: with AVX512-VNNI one instruction adds 64 code products where the float
loop adds 16, so prefill chunks and batched decode run in the kernel at any number of rows.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.pallas_kernels import native
from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import PLANES, RUN, PackedWeight

_SOURCE = Path(native.__file__).resolve().parent / "dequant_matmul.cc"
_X_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))
_GROUP_FIELDS = ("d", "sc", "z", "mn", "m")
MIN_GROUP = 16  # the finest group the kernel reads
# The dtypes the kernel reads each group array in (those of ``formats.PackedWeight``).
_GROUP_DTYPES = {
    name: jnp.dtype(t)
    for name, t in (
        ("d", jnp.float16),
        ("sc", jnp.int8),
        ("z", jnp.uint8),
        ("mn", jnp.float16),
        ("m", jnp.uint8),
    )
}


@functools.cache
def _targets() -> tuple[str, str] | None:
    """The registered FFI targets' names (one weight, a group of weights), or None when the
    library is unavailable."""
    library = native.load("dequant_matmul")
    if library is None:
        return None
    # The names follow the source, so an executable in the persistent compilation cache can
    # never call a handler built from another version of it.
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    names = (f"runtime_dequant_matmul_{digest}", f"runtime_dequant_matmul_group_{digest}")
    for name, handler in zip(
        names, (library.DequantMatmul, library.DequantMatmulGroup), strict=True
    ):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
    return names


def _required() -> tuple[str, str]:
    """``_targets()``; raises when the library is unavailable."""
    targets = _targets()
    if targets is None:
        raise RuntimeError(
            "the native dequant-matmul kernel is unavailable (see the log); "
            "call reference.dequant_matmul instead"
        )
    return targets


def available() -> bool:
    """Whether the native kernel is built and registered (building it on first call)."""
    return _targets() is not None


def _group_sizes(w: PackedWeight) -> list[int]:
    """Input features per row of each group array (a ``[1, 1]`` zero code is not a group)."""
    k = w.shape[-2]
    sizes = []
    for name in _GROUP_FIELDS:
        a = getattr(w, name)
        if a is None or (name == "z" and a.shape[-2:] == (1, 1)):
            continue
        rows = a.shape[-2]
        sizes.append(k // rows if rows and k % rows == 0 else 0)
    return sizes


def supports(x: jax.Array, w: PackedWeight) -> bool:
    """Whether the kernel reads this call: float activations, a weight of one matrix or one
    stack of them, bit planes of ``formats.PLANES`` and groups of 16 rows (k-quants' sub-blocks)
    or multiples of 32."""
    if jnp.dtype(x.dtype) not in _X_DTYPES or w.planes[0].ndim not in (2, 3):
        return False
    if w.codebook is not None:  # MXFP4: the reference only
        return False
    if w.bits not in PLANES or len(w.planes) != len(PLANES[w.bits]):
        return False
    for name in _GROUP_FIELDS:
        a = getattr(w, name)
        if a is not None and (
            jnp.dtype(a.dtype) != _GROUP_DTYPES[name] or a.ndim != w.planes[0].ndim
        ):
            return False
    return all(s == MIN_GROUP or (s > 0 and s % RUN == 0) for s in _group_sizes(w))


def dequant_matmul(
    x: jax.Array,  # [num_tokens, in] float32, bfloat16 or float16
    w: PackedWeight,  # [in, out], or [layers, in, out] with ``layer``
    layer: jax.Array | int | None = None,  # [] int32: the matrix of a stacked weight
    *,
    int8_activations: bool = False,
) -> jax.Array:  # [num_tokens, out] float32
    """``x @ dequantize(w)`` (of ``w``'s matrix ``layer`` when stacked) in the native kernel;
    raises if the kernel is unavailable or does not read the weight (``supports``). With
    ``int8_activations`` x is rounded as ``reference.quantize_activations`` rounds it and the
    products are integer dots (VNNI where the CPU has it)."""
    _check(x, w, layer)
    call = jax.ffi.ffi_call(
        _required()[0], jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), jnp.float32)
    )
    return call(
        x.astype(jnp.float32),
        jnp.asarray(0 if layer is None else layer, jnp.int32),
        *_arrays(w),
        **_attributes(w, int8_activations),
    )


def _check(x: jax.Array, w: PackedWeight, layer: jax.Array | int | None) -> None:
    """Raise unless the kernel reads ``x @ w`` (see ``dequant_matmul``)."""
    stacked = w.planes[0].ndim == 3
    if stacked != (layer is not None):
        raise ValueError(
            f"a stacked weight needs a layer index and a single matrix none; got weight shape "
            f"{w.shape} with layer {layer!r}"
        )
    if x.ndim != 2 or x.shape[-1] != w.shape[-2]:
        raise ValueError(f"x must be [num_tokens, {w.shape[-2]}], got shape {x.shape}")
    if not supports(x, w):
        raise ValueError(
            f"the native kernel does not read this call (x {x.dtype}, weight {w.shape} of "
            f"{w.bits} bits with groups of {_group_sizes(w)} rows); use the reference"
        )


def groupable(ws: list[PackedWeight]) -> bool:
    """Whether ``dequant_matmul_group`` takes these weights together: one format (bit planes
    and zero code), the same input width and all stacked or none."""
    first = ws[0]
    return all(
        w.bits == first.bits
        and w.zero == first.zero
        and w.shape[-2] == first.shape[-2]
        and w.planes[0].ndim == first.planes[0].ndim
        for w in ws
    )


def dequant_matmul_group(
    x: jax.Array,  # [num_tokens, in]
    ws: list[PackedWeight],  # each [in, out_i], or [layers, in, out_i] with ``layer``
    layer: jax.Array | int | None = None,
    *,
    int8_activations: bool = False,
) -> list[jax.Array]:  # [num_tokens, out_i] float32 each
    """``dequant_matmul`` of each weight in one kernel call (``groupable`` weights): x is
    rounded once and the pool wakes once for all of them. Each result is the one
    ``dequant_matmul`` gives for its weight alone."""
    if not ws or not groupable(ws):
        raise ValueError("a group call takes one or more weights of one format and input width")
    for w in ws:
        _check(x, w, layer)
    results = [jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), jnp.float32) for w in ws]
    call = jax.ffi.ffi_call(_required()[1], results)
    arrays = [a for w in ws for a in _arrays(w)]
    out = call(
        x.astype(jnp.float32),
        jnp.asarray(0 if layer is None else layer, jnp.int32),
        *arrays,
        **_attributes(ws[0], int8_activations),
    )
    return list(out)


def _arrays(w: PackedWeight) -> list[jax.Array]:
    """The weight's seven arrays in the kernel's order, [0]-shaped where it has none."""
    none_u8 = jnp.zeros((0,), jnp.uint8)
    return [
        w.planes[0],
        w.planes[1] if len(PLANES[w.bits]) > 1 else none_u8,
        w.d,
        jnp.zeros((0,), jnp.int8) if w.sc is None else w.sc,
        none_u8 if w.z is None else w.z,
        jnp.zeros((0,), jnp.float16) if w.mn is None else w.mn,
        none_u8 if w.m is None else w.m,
    ]


def _attributes(w: PackedWeight, int8_activations: bool) -> dict[str, np.int64]:
    planes = PLANES[w.bits]
    return {
        "bits0": np.int64(planes[0]),
        "bits1": np.int64(planes[1] if len(planes) > 1 else 0),
        "zero": np.int64(w.zero),
        "int8_x": np.int64(int8_activations),
    }
