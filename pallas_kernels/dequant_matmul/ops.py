"""``dequant_matmul``: one entry point; ``implementation`` decides whether the native CPU kernel,
the Pallas kernel or the reference runs it, and ``packed_head`` whether a packed LM head pays.

Models call it with ``impl="auto"`` and say whether native kernels may run where the step runs
(``native``; a ``PackedLayer`` implies it). Then:

- a ``PackedLayer`` (one layer of a stack; the decoder hands its layer scans' weights over this
  way only where native kernels may run: the CPU backend without a device mesh), or any weight
  with ``native``, goes to the
  native CPU kernel (``native.py``) when it is built, reads the weight's format, and the call has
  at most ``NATIVE_MAX_TOKENS`` rows (``NATIVE_MAX_TOKENS_LARGE`` for a matrix too large to stay
  in cache): it unpacks the weight in registers instead of writing its float32 matrix, and
  reads the layer inside the stack, so nothing is copied per layer. Longer calls (prefill
  chunks, 16-sequence decode) run the reference, whose dot is faster there. Within those
  bounds a call class goes native only where ``cpu_choice.native_wins`` says the kernel was
  measured faster on this CPU (``pallas_kernels.native.calibration``);
- otherwise the Pallas kernel on the backends in ``KERNEL_BACKENDS``, and the reference
  elsewhere. That tuple is empty until the kernel has compiled and matched the reference on a
  GPU (``tests/pallas_kernels/test_dequant_matmul.py``'s GPU test; no GPU has run it yet): a
  quantized model must not stop serving on a kernel nobody has run there.

With ``int8_activations`` (``--matmul-dtype int8``) the native kernel takes a call at any
number of rows (its integer dots outrun XLA's float dot there too); every other path multiplies
``reference.quantize_activations(x)``, the same rounded values, in float32.

``impl="native"`` (tests and tools) is ``native=True``; ``impl="pallas"`` always runs the Pallas kernel
(interpreted on CPU); ``impl="reference"`` the reference. On XLA:CPU the reference is the fastest
XLA formulation measured (BENCHMARKS.md, "Quantized weights"): dequantize the matrix, then one
dot.
"""

from __future__ import annotations

import jax

from jax_llm_runtime.pallas_kernels import cpu_choice
from jax_llm_runtime.pallas_kernels.dequant_matmul import kernel, reference
from jax_llm_runtime.pallas_kernels.dequant_matmul import native as native_kernel
from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import PackedLayer, PackedWeight

IMPLS = ("auto", "native", "pallas", "reference")
KERNEL_BACKENDS: tuple[str, ...] = ()  # add "gpu" once a GPU run of the kernel is recorded
# Rows up to which the native kernel beats the reference on CPU (BENCHMARKS.md, "Native
# dequant-matmul"). The reference writes the weight's float32 matrix and then runs one dot: a
# matrix that stays in cache (SmolLM2's projections, up to 3.5 MB) is cheap to read again, and
# past 8 rows XLA's dot outruns the kernel's multiply-adds; a large one (the 113 MB LM head)
# costs the reference a trip through memory, and the kernel stays ahead up to 128 rows.
NATIVE_MAX_TOKENS = 8
NATIVE_MAX_TOKENS_LARGE = 128
LARGE_MATRIX_BYTES = 16 * 2**20  # float32 bytes of a matrix that no longer stays in cache


def dequant_matmul(
    x: jax.Array,  # [..., in]
    w: PackedWeight | PackedLayer,  # [in, out]
    *,
    impl: str = "auto",
    int8_activations: bool = False,
    native: bool = False,
) -> jax.Array:  # [..., out] float32
    """``x @ dequantize(w)`` accumulated in float32, on the chosen implementation; with
    ``int8_activations``, ``reference.quantize_activations(x) @ dequantize(w)``. ``native``:
    native CPU kernels may run where this step runs (see the module docstring)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    chosen = implementation(impl, flat, w, int8_activations, native)
    if chosen == "native":
        stack, index = (w.stack, w.index) if isinstance(w, PackedLayer) else (w, None)
        out = native_kernel.dequant_matmul(flat, stack, index, int8_activations=int8_activations)
    else:
        if int8_activations:
            flat = reference.quantize_activations(flat)
        matrix = w.matrix() if isinstance(w, PackedLayer) else w
        if chosen == "pallas":
            out = kernel.dequant_matmul(flat, matrix, interpret=jax.default_backend() == "cpu")
        else:
            out = reference.dequant_matmul(flat, matrix)
    return out.reshape(*lead, out.shape[-1])


def dequant_matmul_group(
    x: jax.Array,  # [..., in]
    ws: list[PackedWeight | PackedLayer],  # each [in, out_i]
    *,
    impl: str = "auto",
    int8_activations: bool = False,
    native: bool = False,
) -> list[jax.Array]:  # [..., out_i] float32 each
    """``dequant_matmul`` of each weight on the same ``x``. Where the native kernel takes every
    one of them and they share a format (``native.groupable``; the layers of one stack), one
    kernel call runs them all: x is rounded once and the CPU pool wakes once (a layer's q, k and
    v, or gate and up). Each result is the one ``dequant_matmul`` gives alone."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if len(ws) > 1 and all(
        implementation(impl, flat, w, int8_activations, native) == "native" for w in ws
    ):
        stacks = [w.stack if isinstance(w, PackedLayer) else w for w in ws]
        index = ws[0].index if isinstance(ws[0], PackedLayer) else None
        same_index = all((w.index if isinstance(w, PackedLayer) else None) is index for w in ws)
        if same_index and native_kernel.groupable(stacks):
            outs = native_kernel.dequant_matmul_group(
                flat, stacks, index, int8_activations=int8_activations
            )
            return [out.reshape(*lead, out.shape[-1]) for out in outs]
    return [
        dequant_matmul(x, w, impl=impl, int8_activations=int8_activations, native=native)
        for w in ws
    ]


def implementation(
    impl: str,
    x: jax.Array,  # [rows, in]
    w: PackedWeight | PackedLayer,
    int8_activations: bool = False,
    native: bool = False,
) -> str:
    """Which implementation runs this call on this backend: "native", "pallas" or "reference"
    (see the module docstring for the rules)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    backend = jax.default_backend()
    wants_native = impl == "native" or (impl == "auto" and (native or isinstance(w, PackedLayer)))
    if wants_native and _native_runs(x, w, backend, int8_activations):
        return "native"
    if impl == "pallas" or (impl == "auto" and backend in KERNEL_BACKENDS):
        return "pallas"
    return "reference"


def packed_head(rows: int, tied: bool, int8_activations: bool) -> bool:
    """Whether a packed LM head (where native kernels may run) takes a call of ``rows`` rows, by
    the measured verdicts: one row where the kernel wins one row; more where it wins the large
    class too, or where there is no float head to use instead (an untied head is kept one way
    only). int8 activations take one path for every row count, so that a request's tokens do not
    depend on its batch: the packed one where the kernel wins one row and, with int8
    activations, the large class (``large_int8``)."""
    one_row = cpu_choice.native_wins("dequant_matmul", "one_row")
    if int8_activations:
        return one_row and cpu_choice.native_wins("dequant_matmul", "large_int8")
    if rows == 1 and tied:
        return one_row
    return one_row and cpu_choice.native_wins("dequant_matmul", "large")


def _native_runs(
    x: jax.Array, w: PackedWeight | PackedLayer, backend: str, int8_activations: bool
) -> bool:
    """Whether the native kernel takes this call (see the module docstring)."""
    stack = w.stack if isinstance(w, PackedLayer) else w
    k, n = w.shape[-2:]
    large = k * n * 4 > LARGE_MATRIX_BYTES
    rows = x.shape[0]
    return (
        backend == "cpu"
        and (
            (int8_activations and cpu_choice.native_wins("dequant_matmul", "int8"))
            or (
                rows <= (NATIVE_MAX_TOKENS_LARGE if large else NATIVE_MAX_TOKENS)
                and cpu_choice.native_wins("dequant_matmul", cpu_choice.dequant_class(rows, large))
            )
        )
        and native_kernel.supports(x, stack)
        and native_kernel.available()
    )
