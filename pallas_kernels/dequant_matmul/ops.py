"""``dequant_matmul``: one entry point that picks the Pallas kernel or the reference.

``impl="auto"`` runs the Pallas kernel on the backends in ``KERNEL_BACKENDS`` and the reference
elsewhere. That tuple is empty until the kernel has compiled and matched the reference on a GPU
(``tests/pallas_kernels/test_dequant_matmul.py``'s GPU test; no GPU has run it yet): a quantized
model must not stop serving on a kernel nobody has run there. ``impl="pallas"`` always runs it
(interpreted on CPU). On CPU the reference is
the fastest XLA formulation measured (BENCHMARKS.md, "Quantized weights"): dequantize the matrix,
then one dot. XLA:CPU does not fuse the widening into its dot, but one layer's dequantized matrix
stays in cache, so a decode step reads the packed bytes from memory instead of float32 ones.
Multiply-and-reduce without the float copy, and column-tiled dequantization, were both slower.
"""

from __future__ import annotations

import jax

from pallas_kernels.dequant_matmul import kernel, reference
from pallas_kernels.dequant_matmul.formats import PackedWeight

IMPLS = ("auto", "pallas", "reference")
KERNEL_BACKENDS: tuple[str, ...] = ()  # add "gpu" once a GPU run of the kernel is recorded


def dequant_matmul(
    x: jax.Array,  # [..., in]
    w: PackedWeight,  # [in, out]
    *,
    impl: str = "auto",
) -> jax.Array:  # [..., out] float32
    """``x @ dequantize(w)`` accumulated in float32, on the chosen implementation."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    backend = jax.default_backend()
    if impl == "pallas" or (impl == "auto" and backend in KERNEL_BACKENDS):
        out = kernel.dequant_matmul(flat, w, interpret=backend == "cpu")
    else:
        out = reference.dequant_matmul(flat, w)
    return out.reshape(*lead, out.shape[-1])
