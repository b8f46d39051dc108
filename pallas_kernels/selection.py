"""Which implementation of each kernel serves a model, chosen once at startup.

On GPU and TPU the Pallas kernels (paged attention, dequant-matmul) are taken only where they
are safe: ``auto`` runs each once on the device, on a small case shaped like the served model
(its heads, head size, KV cache dtype, window and soft-cap; one of its own packed weights), and
compares it with the jnp reference, then times both on a decode case of the model's shape
(``speed_check``). Where they agree and the kernel is not slower the op's ``KERNEL_BACKENDS``
gains the backend, so every step's call of that op takes the kernel; where the kernel fails to
compile, raises, disagrees or loses, the reference serves and one warning line says why. ``--attention-backend``
and ``--matmul-backend`` force ``pallas`` or ``reference``.

On CPU the native kernels and XLA's formulations are chosen per call class by measurement
(``pallas_kernels.native.calibration``); ``reference`` forces XLA's formulations for that
kernel, and ``pallas`` is refused (the Pallas kernels only interpret on CPU, far slower).
"""

from __future__ import annotations

import logging
import time
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
NO_PACKED = "the model has no packed weights"
# The speed check's decode case: sequences and positions each (a served batch's attention).
SPEED_SEQS, SPEED_CONTEXT = 16, 1024


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
            if ok:
                ok, why = speed_check(kernel, model_config, weights, kv_dtype, backend)
            if not ok:
                level = logging.INFO if why == NO_PACKED else logging.WARNING
                logger.log(
                    level,
                    "%s: the Pallas kernel is not used (%s); the reference serves",
                    kernel,
                    why,
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
                return False, NO_PACKED
            got, want = case
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    except Exception as e:  # a kernel that cannot compile or run here falls back
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    if not np.all(np.isfinite(got)):
        return False, "non-finite outputs on the check's case"
    if not np.allclose(got, want, atol=ATOL, rtol=RTOL):
        return False, f"differs from the reference by up to {np.max(np.abs(got - want)):.3g}"
    return True, "matches the reference"


def speed_check(
    kernel: str, model_config: Any, weights: Any, kv_dtype: Any, backend: str | None = None
) -> tuple[bool, str]:
    """Whether ``kernel``'s Pallas implementation is at least as fast as the reference on a
    decode case shaped like the served model (attention: ``SPEED_SEQS`` sequences of
    ``SPEED_CONTEXT`` positions; dequant-matmul: one row through the model's first packed
    matrix), timed on this process's device: (faster, the two times). A kernel that agrees but
    loses serves nothing (an H100 ran the Triton paged-attention kernel 7x slower than the
    reference inside a step, BENCHMARKS.md). Only the device JAX runs on can be timed: for
    another ``backend`` (the tests name one) the check passes untimed. TPU attention (the
    ragged kernel serves every layout there) is not timed either."""
    backend = backend or jax.default_backend()
    if backend != jax.default_backend() or (kernel == "attention" and backend == "tpu"):
        return True, "not timed"
    try:
        if kernel == "attention":
            run, args = attention_speed_case(model_config.attention, kv_dtype)
        else:
            run, args = _dequant_speed_case(weights)
        kernel_ms, reference_ms = time_implementations(run, args)
    except Exception as e:  # the numerics check passed; a failure here is the device's
        return False, f"timing failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    times = f"{kernel_ms:.3f} ms against the reference's {reference_ms:.3f} ms"
    if kernel_ms > reference_ms:
        return False, f"slower than the reference: {times}"
    return True, times


def time_implementations(run: Any, args: tuple, rounds: int = 7, calls: int = 5) -> tuple:
    """Median ms per call of ``run("pallas")`` and ``run("reference")`` on ``args``, compiled
    first, then timed in alternating rounds of ``calls`` calls."""
    fns = {impl: jax.jit(run(impl)) for impl in ("pallas", "reference")}
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {impl: [] for impl in fns}
    for _ in range(rounds):
        for impl, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            times[impl].append((time.perf_counter() - start) / calls * 1e3)
    return float(np.median(times["pallas"])), float(np.median(times["reference"]))


def attention_speed_case(
    attention: Any, kv_dtype: Any, seqs: int | None = None, context: int | None = None
) -> tuple[Any, tuple]:
    """``(run, args)``: ``run(impl)`` attends one decode token of each of ``seqs`` sequences
    (default ``SPEED_SEQS``) over ``context`` positions each (``SPEED_CONTEXT``) with the heads,
    window and soft-cap of ``attention`` (an ``AttentionConfig``); the queries in a 16-bit
    cache's dtype (a model served in it), else float32."""
    seqs, context = seqs or SPEED_SEQS, context or SPEED_CONTEXT
    heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    page_size = 16
    pages = -(-context // page_size)
    cache_shape = (1, seqs * pages, page_size, kv_heads, dim)
    key = jax.random.PRNGKey(0)
    k = jax.random.normal(key, cache_shape, jnp.float32).astype(kv_dtype)
    v = jax.random.normal(jax.random.fold_in(key, 1), cache_shape, jnp.float32).astype(kv_dtype)
    q_dtype = kv_dtype if jnp.dtype(kv_dtype) in (jnp.bfloat16, jnp.float16) else jnp.float32
    q = jax.random.normal(jax.random.fold_in(key, 2), (seqs, 1, heads, dim), q_dtype)
    kv_lens = jnp.full((seqs,), context, jnp.int32)
    positions = kv_lens[:, None] - 1
    page_indices = jnp.arange(seqs * pages, dtype=jnp.int32).reshape(seqs, pages)
    kw = dict(scale=dim**-0.5, soft_cap=getattr(attention, "soft_cap", None))
    if attention.sliding_window is not None:
        kw["sliding_window"] = jnp.int32(attention.sliding_window)

    def run(impl: str) -> Any:
        return lambda *a: attention_ops.attention(*a, impl=impl, **kw)

    return run, (q, k, v, jnp.int32(0), positions, page_indices, kv_lens)


def _dequant_speed_case(weights: Any) -> tuple[Any, tuple]:
    packed = _first_packed(weights)
    x = jnp.ones((1, packed.shape[0]), jnp.float32)

    def run(impl: str) -> Any:
        return lambda x, w: dequant_ops.dequant_matmul(x, w, impl=impl)

    return run, (x, packed)


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
    packed = _first_packed(weights)
    if packed is None:
        return None
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, packed.shape[0])), jnp.float32)
    run = lambda impl: jax.jit(lambda x, w: dequant_ops.dequant_matmul(x, w, impl=impl))(x, packed)  # noqa: E731
    return run("pallas"), run("reference")


def _first_packed(weights: Any) -> PackedWeight | None:
    """The first packed matrix of the served weights (a stack's first layer or expert)."""
    leaves = jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, PackedWeight))
    packed = next((w for w in leaves if isinstance(w, PackedWeight)), None)
    while packed is not None and len(packed.shape) > 2:
        packed = jax.tree.map(lambda a: a[0] if a.ndim > 2 else a, packed)
    return packed
