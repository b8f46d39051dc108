"""``attention``: one paged-attention entry point that picks an implementation.

``impl="auto"`` runs the Pallas kernel on GPU and the pure-jnp reference elsewhere. TPU stays on
the reference because this kernel gathers K/V rows straight from HBM, which Mosaic TPU does not
lower (see README.md). ``impl="pallas"`` always runs the kernel, interpreted on CPU;
``impl="reference"`` always runs the reference. ``impl="native"`` runs the native CPU kernel
(``native.py``) on CPU when it is built and reads the cache's dtype, else the reference;
``impl="cpu"`` does the same where ``cpu_choice.native_wins`` says the kernel was measured faster
than the reference on this CPU for the call's class (decode or prefill), else runs the
reference. Only a caller that knows the step is not split over a device mesh asks for either
(XLA's partitioner does not split a custom call).
"""

from __future__ import annotations

import jax

from jax_llm_runtime.pallas_kernels import cpu_choice
from jax_llm_runtime.pallas_kernels.paged_attention import kernel, native, reference

IMPLS = ("auto", "pallas", "reference", "native", "cpu")


def implementation(impl: str, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> str:
    """Which implementation ``attention(impl=...)`` runs for these operands on this backend:
    "pallas", "native" or "reference" (see the module docstring for the rules)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    backend = jax.default_backend()
    if impl == "pallas" or (impl == "auto" and backend == "gpu"):
        return "pallas"
    measured = impl == "cpu" and cpu_choice.native_wins(
        "paged_attention", cpu_choice.attention_class(q.shape[1])
    )
    run_native = (
        (impl == "native" or measured)
        and backend == "cpu"
        and native.available()
        and native.supports(q, k_cache, v_cache)
    )
    return "native" if run_native else "reference"


def attention(
    q: jax.Array,  # [num_seqs, q_len, num_heads, head_dim]
    k_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer: jax.Array,  # [] int32
    positions: jax.Array,  # [num_seqs, q_len] int32, absolute position of each query token
    page_indices: jax.Array,  # [num_seqs, pages_per_seq] int32
    kv_lens: jax.Array,  # [num_seqs] int32, valid KV positions (including this step's tokens)
    *,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    k_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    v_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    impl: str = "auto",
) -> jax.Array:  # [num_seqs, q_len, num_heads, head_dim]
    """Paged attention with ``reference.paged_attention``'s contract, on the chosen implementation.

    ``k_scale`` and ``v_scale`` dequantise a float8 cache (``k * k_scale``, ``v * v_scale``); the
    reference path folds them into ``scale`` and the output, which is the same arithmetic.
    ``k_scales`` and ``v_scales`` are the per-row scales of a ``KVCache`` in float8.
    """
    chosen = implementation(impl, q, k_cache, v_cache)
    if chosen == "pallas":
        return kernel.paged_attention(
            q,
            k_cache,
            v_cache,
            layer,
            positions,
            page_indices,
            kv_lens,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            k_scales=k_scales,
            v_scales=v_scales,
            interpret=jax.default_backend() == "cpu",
        )
    out = (native.paged_attention if chosen == "native" else reference.paged_attention)(
        q,
        k_cache,
        v_cache,
        layer,
        positions,
        page_indices,
        kv_lens,
        scale=scale * k_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scales=k_scales,
        v_scales=v_scales,
    )
    return out if isinstance(v_scale, float) and v_scale == 1.0 else (out * v_scale).astype(q.dtype)
