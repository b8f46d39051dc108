"""Which implementation of each kernel serves a model, chosen once at startup.

On GPU and TPU the Pallas kernels (paged attention, dequant-matmul) are taken only where they
are safe: ``auto`` runs each once on the device, on a small case shaped like the served model
(its heads, head size, KV cache dtype, window and soft-cap; one of its own packed weights), and
compares it with the jnp reference. Where they agree the op's ``KERNEL_BACKENDS`` gains the
backend, so every step's call of that op takes the kernel; where the kernel fails to compile,
raises or disagrees, the reference serves and one warning line says why. ``--attention-backend``
and ``--matmul-backend`` force ``pallas`` or ``reference``.

On CPU the native kernels and XLA's formulations are chosen per call class by measurement
(``pallas_kernels.native.calibration``); ``reference`` forces XLA's formulations for that
kernel, and ``pallas`` is refused (the Pallas kernels only interpret on CPU, far slower).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.pallas_kernels import cpu_choice
from jax_llm_runtime.pallas_kernels.dequant_matmul import ops as dequant_ops
from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import PackedWeight
from jax_llm_runtime.pallas_kernels.paged_attention import ops as attention_ops
from jax_llm_runtime.pallas_kernels.paged_attention import self_check as tpu_check

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "pallas", "reference")
KERNELS = {"attention": attention_ops, "dequant_matmul": dequant_ops}
FLAGS = {"attention": "--attention-backend", "dequant_matmul": "--matmul-backend"}
_CALIBRATED = {"attention": "paged_attention", "dequant_matmul": "dequant_matmul"}
# How far the kernel may stray from the reference on the check's case (float32 sums in a
# different order; a bfloat16 cache or weight rounds the same values on both sides).
ATOL, RTOL = 2e-2, 2e-2


def choose_kernels(
    model_config: Any,
    weights: Any,
    kv_dtype: Any,
    forced: dict[str, str],
    backend: str | None = None,
) -> dict[str, str]:
    """The implementation of each kernel for this model on ``backend`` (default: JAX's), with
    ``forced`` (``{"attention": ..., "dequant_matmul": ...}``, each one of ``BACKENDS``) applied;
    ``{kernel: implementation}``, also logged. Raises ValueError for ``pallas`` on CPU."""
    backend = backend or jax.default_backend()
    choices = {}
    for kernel, ops in KERNELS.items():
        want = forced.get(kernel, "auto")
        if want not in BACKENDS:
            raise ValueError(f"{kernel} backend must be one of {BACKENDS}, got {want!r}")
        if backend == "cpu":
            choices[kernel] = _cpu_choice(kernel, want)
            continue
        ok, why = (True, "forced") if want == "pallas" else (False, "forced")
        if want == "auto":
            ok, why = self_check(kernel, model_config, weights, kv_dtype, backend)
            if not ok:
                logger.warning(
                    "%s: the Pallas kernel is not used (%s); the reference serves", kernel, why
                )
        _enable(ops, backend, ok)
        choices[kernel] = "pallas" if ok else "reference"
    logger.info("kernels on %s: %s", backend, ", ".join(f"{k} {v}" for k, v in choices.items()))
    return choices


def _cpu_choice(kernel: str, want: str) -> str:
    if want == "pallas":
        raise ValueError(
            f"{FLAGS[kernel]} pallas runs on GPU and TPU; on CPU use auto (native kernels where "
            "measured faster) or reference"
        )
    if want == "reference":  # every call class, and int8 activations' calls, off the kernel
        name = _CALIBRATED[kernel]
        classes = (*cpu_choice.KERNELS[name], "int8")
        cpu_choice.set_verdicts({(name, c): False for c in classes})
        return "reference"
    return "native-or-xla"  # per call class, as measured (the startup log gives each)


def _enable(ops: Any, backend: str, on: bool) -> None:
    """Add ``backend`` to (or take it out of) the op's ``KERNEL_BACKENDS``."""
    others = tuple(b for b in ops.KERNEL_BACKENDS if b != backend)
    ops.KERNEL_BACKENDS = (*others, backend) if on else others


def self_check(
    kernel: str, model_config: Any, weights: Any, kv_dtype: Any, backend: str | None = None
) -> tuple[bool, str]:
    """Run ``kernel``'s Pallas implementation once on a small case shaped like the model and
    compare it with the reference: (agrees, why not). Never raises for the kernel's sake. On TPU
    attention is the ragged TPU kernel, which takes every step layout there
    (``models.layers.attention.step_attention``), checked by ``self_check.check_tpu_kernel``."""
    backend = backend or jax.default_backend()
    if kernel == "attention" and backend == "tpu":
        return _tpu_attention_check(model_config, kv_dtype)
    try:
        if kernel == "attention":
            got, want = _attention_case(model_config, kv_dtype)
        else:
            case = _dequant_case(weights)
            if case is None:
                return False, "the model has no packed weights"
            got, want = case
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    except Exception as e:  # a kernel that cannot compile or run here falls back
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    if not np.all(np.isfinite(got)):
        return False, "non-finite outputs on the check's case"
    if not np.allclose(got, want, atol=ATOL, rtol=RTOL):
        return False, f"differs from the reference by up to {np.max(np.abs(got - want)):.3g}"
    return True, "matches the reference"


def _tpu_attention_check(model_config: Any, kv_dtype: Any) -> tuple[bool, str]:
    """The TPU ragged kernel on the served model's heads and cache dtype (one small bucket)."""
    attention = model_config.attention
    if not hasattr(attention, "num_kv_heads"):
        return False, "multi-head latent attention runs the reference"
    served = tpu_check.Served(
        cache_shape=(1, 16, 16, attention.num_kv_heads, attention.head_dim),
        cache_dtype=kv_dtype,
        num_heads=attention.num_heads,
        q_dtype=jnp.float32,
        scale=attention.head_dim**-0.5,
        sliding_window=attention.sliding_window,
        soft_cap=getattr(attention, "soft_cap", None),
    )
    result = tpu_check.check_tpu_kernel(served, [tpu_check.Bucket(32, 4, 4)])
    return result.ok, result.reason[:300]


def _attention_case(model_config: Any, kv_dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Two sequences at 37 and 50 positions, each with a 3-token chunk, over shuffled pages of
    a cache in the served dtype; the model's heads, window and soft-cap."""
    attention = model_config.attention
    if not hasattr(attention, "num_kv_heads"):
        raise ValueError("multi-head latent attention runs the reference")
    heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    rng = np.random.default_rng(0)
    page_size, pages = 16, 8
    cache_shape = (1, 2 * pages, page_size, kv_heads, dim)
    k = jnp.asarray(rng.standard_normal(cache_shape), kv_dtype)
    v = jnp.asarray(rng.standard_normal(cache_shape), kv_dtype)
    q = jnp.asarray(rng.standard_normal((2, 3, heads, dim)), jnp.float32)
    kv_lens = jnp.asarray([37, 50], jnp.int32)
    positions = kv_lens[:, None] - 3 + jnp.arange(3, dtype=jnp.int32)[None]
    page_indices = jnp.asarray(rng.permutation(2 * pages).reshape(2, pages), jnp.int32)
    kw = dict(
        scale=dim**-0.5,
        soft_cap=getattr(attention, "soft_cap", None),
        sliding_window=None
        if attention.sliding_window is None
        else jnp.int32(attention.sliding_window),
    )
    args = (q, k, v, jnp.int32(0), positions, page_indices, kv_lens)
    run = lambda impl: jax.jit(lambda *a: attention_ops.attention(*a, impl=impl, **kw))(*args)  # noqa: E731
    return run("pallas"), run("reference")


def _dequant_case(weights: Any) -> tuple[jax.Array, jax.Array] | None:
    """Eight rows through the first packed matrix of the served weights (its own format and
    scales), or None without one."""
    leaves = jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, PackedWeight))
    packed = next((w for w in leaves if isinstance(w, PackedWeight)), None)
    if packed is None:
        return None
    while len(packed.shape) > 2:  # a stack of layers or experts: its first matrix
        packed = jax.tree.map(lambda a: a[0] if a.ndim > 2 else a, packed)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, packed.shape[0])), jnp.float32)
    run = lambda impl: jax.jit(lambda x, w: dequant_ops.dequant_matmul(x, w, impl=impl))(x, packed)  # noqa: E731
    return run("pallas"), run("reference")
