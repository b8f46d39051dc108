"""``attention``: one paged-attention entry point; ``implementation`` decides what runs it.

Models call ``attention`` with ``impl="auto"`` and say whether native kernels may run where the
step runs (``native``: the CPU backend with the step on one device, since XLA's partitioner does
not split a custom call). ``implementation`` then picks, for the backend and the call's shapes:

- with ``native``: the native CPU kernel (``native.py``) where it is built, reads the cache's
  dtype and was measured faster than the reference on this CPU for the call's class (decode or
  prefill; ``cpu_choice.native_wins``), else the reference;
- otherwise the Pallas kernel on the backends in ``KERNEL_BACKENDS``, and the reference
  elsewhere. That tuple is empty until the kernel has compiled and matched the reference on a
  device (the GPU tests; none has run them yet). This kernel gathers K/V rows straight from HBM,
  which Mosaic TPU does not lower (see README.md); TPU's kernel (``tpu.py``) takes the ragged
  contract only, below.

Tests and tools force one: ``impl="pallas"`` (interpreted on CPU), ``"reference"``, ``"native"``
(the native kernel wherever it is built and reads the dtype, measured or not) or ``"cpu"`` (the
measured rule of ``native``).

``ragged_attention`` is the same choice for ``reference.ragged_paged_attention``'s contract (a
flat run of query rows mixing sequences, ``q_starts``), with these differences: its Pallas kernel
is the TPU one (``tpu.py``), so ``impl="pallas"`` runs it compiled on "tpu", interpreted (Pallas'
TPU interpreter) on "cpu", and raises elsewhere (no GPU kernel takes the ragged layout) or for a
cache in integer storage; "auto" runs it only on "tpu" and only once "tpu" is in
``KERNEL_BACKENDS`` (after the device check, ``self_check.py``), so a kernel backend without one
runs the reference; and the measured class is "decode" when the call has at most one row per
sequence, else "prefill".

Attention sinks (``sinks``, gpt-oss) run on the reference only: neither the Pallas nor the native
kernel takes them, so ``impl="pallas"`` or ``"native"`` with sinks raises, and the automatic and
measured choices pick the reference.

A call with an ``attention_chunk`` (Llama 4's chunked layers) runs the reference whatever
``impl`` says: neither the Pallas nor the native kernel has that mask. The layers of a model
are scanned as one, so a model with chunked layers runs all its attention on the reference.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jax_llm_runtime.pallas_kernels import cpu_choice
from jax_llm_runtime.pallas_kernels.paged_attention import kernel, reference, tpu
from jax_llm_runtime.pallas_kernels.paged_attention import native as native_kernel
from jax_llm_runtime.pallas_kernels.paged_attention.layout import value_dtype

IMPLS = ("auto", "pallas", "reference", "native", "cpu")
KERNEL_BACKENDS: tuple[str, ...] = ()  # add "gpu" once a device run of the kernel is recorded
# Backends whose Pallas kernel takes the ragged layout: TPU's compiled, CPU's interpreted.
RAGGED_PALLAS_BACKENDS = ("tpu", "cpu")


def implementation(
    impl: str,
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    native_ok: bool = False,
    sinks: bool = False,
) -> str:
    """Which implementation runs this call on this backend: "pallas", "native" or "reference"
    (see the module docstring for the rules); ``sinks``: the call has attention sinks."""
    call_class = cpu_choice.attention_class(q.shape[1])
    return _choose(impl, call_class, q, k_cache, v_cache, native_ok, sinks)


def ragged_implementation(
    impl: str,
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    k_cache: jax.Array,
    v_cache: jax.Array,
    num_seqs: int,
    native_ok: bool = False,
    sinks: bool = False,
) -> str:
    """Which implementation runs a ragged call on this backend: "pallas" (the TPU kernel),
    "native" or "reference" (see the module docstring); ``impl="pallas"`` raises ``ValueError``
    where the TPU kernel cannot run the call."""
    backend = jax.default_backend()
    if impl == "pallas" and backend not in RAGGED_PALLAS_BACKENDS:
        raise ValueError(
            f"no Pallas kernel takes the ragged layout on {backend!r} (the TPU kernel runs on "
            "'tpu', interpreted on 'cpu'): use impl='auto' or 'reference' for ragged_attention, "
            "or the padded attention for the Pallas kernel"
        )
    if impl == "pallas" and value_dtype(k_cache.dtype) != k_cache.dtype:
        raise ValueError(
            f"the TPU kernel reads float caches, not {k_cache.dtype} (integer storage, which only "
            "the CPU backend uses): use impl='native', 'cpu' or 'reference'"
        )
    rows_per_seq = -(-q.shape[0] // max(num_seqs, 1))
    call_class = cpu_choice.attention_class(rows_per_seq)
    chosen = _choose(impl, call_class, q, k_cache, v_cache, native_ok, sinks)
    if chosen == "pallas" and impl == "auto" and backend != "tpu":
        return "reference"
    return chosen


def _choose(
    impl: str,
    call_class: str,
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    native_ok: bool,
    sinks: bool = False,
) -> str:
    """The rules of the module docstring for a call of ``call_class`` ("decode", "prefill")."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if sinks:
        if impl in ("pallas", "native"):
            raise ValueError(f"the {impl} paged-attention kernel does not take attention sinks")
        return "reference"
    backend = jax.default_backend()
    if impl == "auto" and native_ok:
        impl = "cpu"
    if impl == "pallas" or (impl == "auto" and backend in KERNEL_BACKENDS):
        return "pallas"
    measured = impl == "cpu" and cpu_choice.native_wins("paged_attention", call_class)
    run_native = (
        (impl == "native" or measured)
        and backend == "cpu"
        and native_kernel.available()
        and native_kernel.supports(q, k_cache, v_cache)
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
    sinks: jax.Array | None = None,  # [num_heads] float, each head's sink logit
    attention_chunk: int | jax.Array | None = None,
    impl: str = "auto",
    native: bool = False,
) -> jax.Array:  # [num_seqs, q_len, num_heads, head_dim]
    """Paged attention with ``reference.paged_attention``'s contract, on the chosen implementation.

    ``k_scale`` and ``v_scale`` dequantise a float8 cache (``k * k_scale``, ``v * v_scale``); the
    reference path folds them into ``scale`` and the output, which is the same arithmetic.
    ``k_scales`` and ``v_scales`` are the per-row scales of a ``KVCache`` in float8. ``native``:
    native CPU kernels may run where this step runs (see the module docstring).
    """
    chosen = implementation(impl, q, k_cache, v_cache, native, sinks is not None)
    extra = _reference_only(sinks, attention_chunk)
    chosen = "reference" if attention_chunk is not None else chosen  # the chunk mask: reference
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
    out = (native_kernel.paged_attention if chosen == "native" else reference.paged_attention)(
        q, k_cache, v_cache, layer, positions, page_indices, kv_lens, scale=scale * k_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, k_scales=k_scales, v_scales=v_scales,
        **extra,
    )  # fmt: skip
    return out if isinstance(v_scale, float) and v_scale == 1.0 else (out * v_scale).astype(q.dtype)


def _reference_only(sinks: jax.Array | None, attention_chunk: Any) -> dict[str, Any]:
    """The arguments only the references take (attention sinks, Llama 4's chunk mask), as
    keywords for the call where they are set."""
    given = (("sinks", sinks), ("attention_chunk", attention_chunk))
    return {name: value for name, value in given if value is not None}


def ragged_attention(
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    k_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer: jax.Array,  # [] int32
    positions: jax.Array,  # [num_tokens] int32, absolute position of each query token
    q_starts: jax.Array,  # [num_seqs + 1] int32, sequence s owns rows q_starts[s]:q_starts[s+1]
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
    sinks: jax.Array | None = None,  # [num_heads] float, each head's sink logit
    attention_chunk: int | jax.Array | None = None,
    impl: str = "auto",
    native: bool = False,
) -> jax.Array:  # [num_tokens, num_heads, head_dim]
    """Paged attention with ``reference.ragged_paged_attention``'s contract, on the TPU kernel,
    the native kernel or the reference (``ragged_implementation``; a chunked call always on the
    reference); the arguments are ``attention``'s."""
    num_seqs, has_sinks = page_indices.shape[0], sinks is not None
    chosen = ragged_implementation(impl, q, k_cache, v_cache, num_seqs, native, has_sinks)
    chosen = "reference" if attention_chunk is not None else chosen  # the chunk mask: reference
    extra = _reference_only(sinks, attention_chunk)
    run = {
        "pallas": functools.partial(
            tpu.ragged_paged_attention, interpret=jax.default_backend() == "cpu"
        ),
        "native": native_kernel.ragged_paged_attention,
    }.get(chosen, reference.ragged_paged_attention)
    out = run(
        q,
        k_cache,
        v_cache,
        layer,
        positions,
        q_starts,
        page_indices,
        kv_lens,
        scale=scale * k_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scales=k_scales,
        v_scales=v_scales,
        **extra,
    )
    return out if isinstance(v_scale, float) and v_scale == 1.0 else (out * v_scale).astype(q.dtype)
