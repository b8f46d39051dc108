"""Native CPU paged attention: ``reference.paged_attention``'s and
``reference.ragged_paged_attention``'s contracts as XLA FFI calls.

XLA:CPU runs the reference as a gather of every sequence's pages into new buffers before small
matmuls, and large writes are what a CPU step pays for most. Pallas has no CPU lowering, so the
kernel is C++ (``pallas_kernels/native/paged_attention.cc``, built by ``pallas_kernels.native``):
each (sequence, KV head, block of query tokens) walks the keys its queries can see, reads their
rows through ``page_indices`` inside the whole cache and keeps an online softmax in float32, on
XLA's CPU thread pool. The ragged call (``ragged_paged_attention``) is the same kernel over a flat
run of query rows: a work item is (sequence, KV heads, block of that sequence's rows from
``q_starts``), so a decode row and a long prefill chunk in one call each cost what they read.
The whole cache and the layer index go in as operands, so inside the
decoder's layer scan no per-layer slice is copied, and the donated cache is still updated in
place by the KV write.

A bfloat16 or float8 cache in integer storage (uint16, uint8 on CPU: ``layout.storage_dtype``)
goes in as it is, and the kernel reads its elements as the float dtype whose bits they are.

``available()`` builds and registers the kernel once (False without a compiler or with
``RUNTIME_NATIVE_KERNELS=0``); ``supports(...)`` says whether a call's dtypes are ones it reads.
Callers pick it through ``ops.attention(impl="native")`` (``ops.ragged_attention``), which
falls back to the reference.
A row that sees no key (padding) returns zeros, where the reference returns a finite average;
every other row agrees with the reference to float32 rounding.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.pallas_kernels import native
from jax_llm_runtime.pallas_kernels.paged_attention.layout import value_dtype
from jax_llm_runtime.pallas_kernels.paged_attention.reference import (
    _validate,
    _validate_ragged,
    _validate_scales,
)

CACHE_DTYPES = tuple(
    jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
)
QUERY_BLOCK = 8  # query tokens per work item of a prefill chunk (a decode step has one)
_SOURCE = Path(native.__file__).resolve().parent / "paged_attention.cc"


@functools.cache
def _register(handler: str, name: str) -> str | None:
    """The registered FFI target's name for ``handler`` (a symbol of the library), or None when
    the library is unavailable."""
    library = native.load("paged_attention")
    if library is None:
        return None
    # The name follows the source, so an executable in the persistent compilation cache can
    # never call a handler built from another version of it.
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    target = f"runtime_{name}_{digest}"
    capsule = jax.ffi.pycapsule(getattr(library, handler))
    jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    return target


def _target() -> str | None:
    """The padded call's FFI target, or None when the library is unavailable."""
    return _register("PagedAttention", "paged_attention")


def _ragged_target() -> str | None:
    """The ragged call's FFI target, or None when the library is unavailable."""
    return _register("RaggedPagedAttention", "ragged_paged_attention")


def available() -> bool:
    """Whether the native kernel is built and registered (building it on first call)."""
    return _target() is not None


def supports(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> bool:
    """Whether the kernel reads this cache: K and V of one dtype whose values are in
    ``CACHE_DTYPES`` (directly or in integer storage), same shape."""
    return (
        k_cache.dtype == v_cache.dtype
        and value_dtype(k_cache.dtype) in CACHE_DTYPES
        and k_cache.shape == v_cache.shape
        and q.dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
    )


def paged_attention(
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
    k_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    v_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    query_block: int = QUERY_BLOCK,
) -> jax.Array:  # [num_seqs, q_len, num_heads, head_dim]
    """``reference.paged_attention`` in the native kernel; raises if it is unavailable.

    Rows that see at least one key match the reference; rows that see none are zeros.
    """
    _validate(q, k_cache, page_indices, kv_lens)
    _validate_scales(k_cache, v_cache, k_scales, v_scales)
    target = _checked(_target(), "paged_attention", q, k_cache, v_cache, sliding_window, soft_cap)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        *_operands(q, k_cache, v_cache, layer, scale, sliding_window, k_scales, v_scales),
        positions.astype(jnp.int32),
        page_indices.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        query_block=np.int64(query_block),
        soft_cap=np.float32(soft_cap or 0.0),
    )
    return out.astype(q.dtype)


def ragged_paged_attention(
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
    k_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    v_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    query_block: int = QUERY_BLOCK,
) -> jax.Array:  # [num_tokens, num_heads, head_dim]
    """``reference.ragged_paged_attention`` in the native kernel; raises if it is unavailable.

    Padding rows (outside ``[q_starts[0], q_starts[num_seqs])``) and rows that see no key are
    zeros, like the reference's; the kernel clamps ``q_starts`` into the rows and makes it
    non-decreasing, so no value of it reads or writes out of bounds.
    """
    _validate_ragged(q, k_cache, positions, q_starts, page_indices, kv_lens)
    _validate_scales(k_cache, v_cache, k_scales, v_scales)
    target = _checked(
        _ragged_target(), "ragged_paged_attention", q, k_cache, v_cache, sliding_window, soft_cap
    )
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        *_operands(q, k_cache, v_cache, layer, scale, sliding_window, k_scales, v_scales),
        positions.astype(jnp.int32),
        q_starts.astype(jnp.int32),
        page_indices.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        query_block=np.int64(query_block),
        soft_cap=np.float32(soft_cap or 0.0),
    )
    return out.astype(q.dtype)


def _checked(
    target: str | None,
    name: str,
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    sliding_window: int | jax.Array | None,
    soft_cap: float | None,
) -> str:
    """``target`` after the checks both calls share (dtypes, window, soft-cap, a built library);
    ``name`` is the call, for the message."""
    if not supports(q, k_cache, v_cache):
        raise ValueError(
            f"the native kernel reads caches of {[d.name for d in CACHE_DTYPES]} with K and V "
            f"alike, got K {k_cache.dtype}{k_cache.shape}, V {v_cache.dtype}{v_cache.shape}"
        )
    if isinstance(sliding_window, int) and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    if target is None:
        raise RuntimeError(
            f"the native paged-attention kernel is unavailable (see the log); "
            f"call reference.{name} instead"
        )
    return target


def _operands(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    scale: float,
    sliding_window: int | jax.Array | None,
    k_scales: jax.Array | None,
    v_scales: jax.Array | None,
) -> tuple[jax.Array, ...]:
    """The operands both handlers take first: scaled q, the caches, their scales ([0] for
    none), the layer, and the window (0 for none)."""
    no_scales = jnp.zeros((0,), jnp.float32)
    window = 0 if sliding_window is None else sliding_window
    return (
        q.astype(jnp.float32) * jnp.float32(scale),
        k_cache,
        v_cache,
        no_scales if k_scales is None else k_scales.astype(jnp.float32),
        no_scales if v_scales is None else v_scales.astype(jnp.float32),
        jnp.asarray(layer, jnp.int32),
        jnp.asarray(window, jnp.int32),
    )
