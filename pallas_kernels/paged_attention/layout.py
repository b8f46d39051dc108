"""KV cache layout: one array for K and one for V, all layers stacked; float8 adds row scales.

``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``: a page holds ``page_size`` token
positions of one layer; writing one token touches one contiguous ``[num_kv_heads, head_dim]`` row.
Layers are stacked so a ``lax.scan`` over layers can carry the whole cache and update it in place
(slicing a layer out as a scan input would copy it every step).

A float8 (e4m3fn) cache also keeps one float32 scale per ``(token, kv head)`` row,
``[num_layers, num_pages, page_size, num_kv_heads]`` for K and for V (``kv_scale_shape``).
``write_cache`` sets each row's scale to its amax / 448 as it writes the row, so the row's largest
element lands on e4m3's largest finite value. This needs no calibration data and neither clips
outliers (K activations of some models exceed e4m3's +-448) nor flushes small rows to zero, which
one fixed per-tensor scale (vLLM's default of 1.0) does. The scales add 4 bytes per row: about 6%
of a head_dim 64 fp8 row, which stays under a third of float32's bytes.

Storage. On the CPU backend a bfloat16 or float8 cache keeps its bits in an unsigned integer
array of the same width (uint16, uint8; ``storage_dtype``). XLA:CPU has no native bfloat16 or
float8 scatter: its float normalization upcasts the KV write to a wider float, which converts the
whole donated cache, updates a few rows and converts it back, so a write costs time in proportion
to the cache (a one-token ``write_cache`` into 64 MiB bfloat16 K and V arrays: about 4.5 ms,
0.007 ms as uint16; ``tools/bench_kv_write.py``, BENCHMARKS.md). An integer scatter is done in
place. Bitcasting the whole cache around the scatter does not help (XLA:CPU copies it), so the
integer type is the storage itself and only small arrays are bitcast: the new rows before they
are scattered (``to_stored``), the gathered rows after they are read (``from_stored``).
Other backends keep the float dtype: XLA:GPU scatters bfloat16 and float8 in place (on an H200,
0.05 ms at any cache size, no convert in the compiled scatter), and the Pallas kernels read the
cache's float refs there. The mapping is fixed (uint16 holds bfloat16, uint8 holds
float8_e4m3fn; no cache stores integers), so an array's dtype says how to read it, float or
integer storage alike; ``KVCache.dtype`` is the float dtype either way.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

FP8 = jnp.dtype(jnp.float8_e4m3fn)  # the one quantized cache dtype: stored with row scales
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
SCALE_DTYPE = jnp.dtype(jnp.float32)
# Float cache dtypes XLA:CPU scatters by upcasting the whole array, and the integer type that
# holds their bits there instead (see the module docstring).
_BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16), FP8: jnp.dtype(jnp.uint8)}
_VALUES = {bits: value for value, bits in _BITS.items()}


def storage_dtype(dtype: jnp.dtype, backend: str | None = None) -> jnp.dtype:
    """The element type a cache of float ``dtype`` is stored as on ``backend`` (default: JAX's
    default backend): the same-width unsigned integer for bfloat16 and float8 on CPU, else
    ``dtype`` itself."""
    dtype = jnp.dtype(dtype)
    if (backend or jax.default_backend()) != "cpu":
        return dtype
    return _BITS.get(dtype, dtype)


def value_dtype(stored: jnp.dtype) -> jnp.dtype:
    """The float dtype whose values a cache array of element type ``stored`` holds."""
    stored = jnp.dtype(stored)
    return _VALUES.get(stored, stored)


def to_stored(x: jax.Array, stored: jnp.dtype) -> jax.Array:
    """``x`` rounded to the float dtype of a cache stored as ``stored``, in that element type."""
    values = x.astype(value_dtype(stored))
    return values if values.dtype == stored else lax.bitcast_convert_type(values, stored)


def from_stored(x: jax.Array) -> jax.Array:
    """Elements read from a cache array (gathered rows, not the whole cache) as their float
    values: integer storage is bitcast back, a float array is returned as it is."""
    dtype = value_dtype(x.dtype)
    return x if dtype == x.dtype else lax.bitcast_convert_type(x, dtype)


def kv_cache_shape(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """Shape of the K (and of the V) cache array."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return (num_layers, num_pages, page_size, num_kv_heads, head_dim)


def kv_scale_shape(cache_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the row scales of a float8 cache array: one per ``(token, kv head)`` row."""
    if len(cache_shape) != 5:
        raise ValueError(
            "cache_shape must be [num_layers, num_pages, page_size, num_kv_heads, head_dim], "
            f"got {cache_shape}"
        )
    return tuple(cache_shape[:4])


def _is_scaled(dtype: jnp.dtype, shape: tuple[int, ...]) -> bool:
    """Whether an array of this dtype and shape carries row scales (a zero-width one has none)."""
    return value_dtype(dtype) == FP8 and shape[-1] > 0


def kv_cache_bytes(k_shape: tuple[int, ...], v_shape: tuple[int, ...], dtype: jnp.dtype) -> int:
    """Bytes of a cache with these K and V shapes stored as ``dtype``, row scales included."""
    dtype = jnp.dtype(dtype)
    total = 0
    for shape in (k_shape, v_shape):
        total += math.prod(shape) * dtype.itemsize
        if _is_scaled(dtype, shape):
            total += math.prod(kv_scale_shape(shape)) * SCALE_DTYPE.itemsize
    return total


def quantize_rows(
    x: jax.Array,  # [..., head_dim]
) -> tuple[jax.Array, jax.Array]:  # e4m3fn [..., head_dim], float32 scales [...]
    """Each row as e4m3fn values times one float32 scale (its amax / 448; 0 for a zero row)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / FP8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    # The clip catches amax / (amax / 448) rounding a hair past 448, which e4m3fn cannot hold.
    values = jnp.clip(x / safe[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return values, scale


def _slots(
    num_pages: int,
    page_size: int,
    positions: jax.Array,  # [num_seqs, q_len] int32
    q_lens: jax.Array,  # [num_seqs] int32
    page_indices: jax.Array,  # [num_seqs, pages_per_seq] int32
) -> tuple[jax.Array, jax.Array]:  # page, offset: [num_seqs, q_len] int32
    """Where each token goes; padding tokens point past the last page (dropped by the scatter)."""
    q_len = positions.shape[1]
    logical_page = positions // page_size  # [num_seqs, q_len]
    page = jnp.take_along_axis(
        page_indices, jnp.clip(logical_page, 0, page_indices.shape[1] - 1), 1
    )
    valid = jnp.arange(q_len)[None, :] < q_lens[:, None]  # [num_seqs, q_len]
    page = jnp.where(valid, page, num_pages)
    return page, positions % page_size


def write_kv(
    k_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer: jax.Array,  # [] int32
    k: jax.Array,  # [num_seqs, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [num_seqs, q_len, num_kv_heads, head_dim]
    positions: jax.Array,  # [num_seqs, q_len] int32
    q_lens: jax.Array,  # [num_seqs] int32, valid query tokens per sequence
    page_indices: jax.Array,  # [num_seqs, pages_per_seq] int32
) -> tuple[jax.Array, jax.Array]:
    """Scatter the new tokens' K and V into their pages; padding tokens write nothing.

    Token j of sequence s goes to page ``page_indices[s, positions[s, j] // page_size]`` at offset
    ``positions[s, j] % page_size``. Tokens with ``j >= q_lens[s]`` are dropped (their page index is
    pointed past the end of the cache and the scatter runs with ``mode="drop"``). Values are cast
    to the cache's float dtype as they are (``to_stored``: a cache in integer storage gets their
    bits); a float8 cache goes through ``write_cache``, which scales.
    """
    page, offset = _slots(k_cache.shape[1], k_cache.shape[2], positions, q_lens, page_indices)
    k_cache = k_cache.at[layer, page, offset].set(to_stored(k, k_cache.dtype), mode="drop")
    v_cache = v_cache.at[layer, page, offset].set(to_stored(v, v_cache.dtype), mode="drop")
    return k_cache, v_cache


@struct.dataclass
class KVCache:
    """The paged K and V arrays of all layers; donated to every step and returned updated.

    ``k_scales``/``v_scales`` exist only for a float8 cache (``v_scales`` not for a zero-width V,
    MLA's); row ``r`` of K holds ``from_stored(k[r]).astype(float32) * k_scales[r]``.

    ``dtype`` is the cache's float dtype. ``k`` and ``v`` may hold its bits in integer storage
    (``storage_dtype``; what ``zeros`` makes on CPU): read them through ``from_stored`` and
    write them through ``write_cache``, never as plain arrays.
    """

    k: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    k_scales: jax.Array | None = None  # [num_layers, num_pages, page_size, num_kv_heads] float32
    v_scales: jax.Array | None = None  # [num_layers, num_pages, page_size, num_kv_heads] float32

    @property
    def dtype(self) -> jnp.dtype:
        """The float dtype of the cached K and V, whatever element type stores them."""
        return value_dtype(self.k.dtype)

    @classmethod
    def zeros(
        cls, shape: tuple[int, ...], dtype: jnp.dtype, v_shape: tuple[int, ...] | None = None
    ) -> KVCache:
        """A zeroed cache; V has K's shape unless ``v_shape`` says otherwise (MLA's empty V).

        ``dtype`` float8_e4m3fn adds zeroed row scales; other 1-byte dtypes are refused. K and
        V are stored as ``storage_dtype(dtype)`` (integers for bfloat16 and float8 on CPU).
        """
        dtype = jnp.dtype(dtype)
        v_shape = v_shape or shape
        if dtype.itemsize == 1 and dtype != FP8:
            raise ValueError(f"a {dtype.name} KV cache is not supported; use {FP8.name} or a float")

        def scales(s: tuple[int, ...]) -> jax.Array | None:
            return jnp.zeros(kv_scale_shape(s), SCALE_DTYPE) if _is_scaled(dtype, s) else None

        stored = storage_dtype(dtype)
        return cls(
            k=jnp.zeros(shape, stored),
            v=jnp.zeros(v_shape, stored),
            k_scales=scales(shape),
            v_scales=scales(v_shape),
        )


def write_cache(
    cache: KVCache,
    layer: jax.Array,  # [] int32
    k: jax.Array,  # [num_seqs, q_len, num_kv_heads, head_dim]
    v: jax.Array,  # [num_seqs, q_len, num_kv_heads, v_head_dim]
    positions: jax.Array,  # [num_seqs, q_len] int32
    q_lens: jax.Array,  # [num_seqs] int32, valid query tokens per sequence
    page_indices: jax.Array,  # [num_seqs, pages_per_seq] int32
) -> KVCache:
    """``write_kv`` on a ``KVCache``: a float8 cache stores each row quantized with its scale.

    A float cache takes exactly ``write_kv``'s path. A float8 cache's zero-width V (MLA) is
    returned unchanged.
    """
    page, offset = _slots(cache.k.shape[1], cache.k.shape[2], positions, q_lens, page_indices)
    return _write_rows(cache, layer, k, v, page, offset)


def write_cache_ragged(
    cache: KVCache,
    layer: jax.Array,  # [] int32
    k: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [num_tokens, num_kv_heads, v_head_dim]
    positions: jax.Array,  # [num_tokens] int32
    seq_ids: jax.Array,  # [num_tokens] int32, each token's sequence (row of page_indices)
    valid: jax.Array,  # [num_tokens] bool, False for padding tokens (they write nothing)
    page_indices: jax.Array,  # [num_seqs, pages_per_seq] int32
) -> KVCache:
    """``write_cache`` for a ragged run of tokens (``models.batch.StepBatch``): token ``t``
    goes to page ``page_indices[seq_ids[t], positions[t] // page_size]`` at offset
    ``positions[t] % page_size``."""
    num_pages, page_size = cache.k.shape[1], cache.k.shape[2]
    logical_page = jnp.clip(positions // page_size, 0, page_indices.shape[1] - 1)
    seq = jnp.clip(seq_ids, 0, page_indices.shape[0] - 1)
    page = jnp.where(valid, jnp.asarray(page_indices)[seq, logical_page], num_pages)
    return _write_rows(cache, layer, k, v, page, positions % page_size)


def _write_rows(
    cache: KVCache,
    layer: jax.Array,  # [] int32
    k: jax.Array,  # [..., num_kv_heads, head_dim]
    v: jax.Array,  # [..., num_kv_heads, v_head_dim]
    page: jax.Array,  # [...] int32, past the last page for rows that write nothing
    offset: jax.Array,  # [...] int32
) -> KVCache:
    """Scatter rows of K and V to (page, offset); a float8 cache quantizes each row first."""
    if cache.k_scales is None:
        k_cache = cache.k.at[layer, page, offset].set(to_stored(k, cache.k.dtype), mode="drop")
        v_cache = cache.v.at[layer, page, offset].set(to_stored(v, cache.v.dtype), mode="drop")
        return cache.replace(k=k_cache, v=v_cache)

    def put(values: jax.Array, scales: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        xq, xs = quantize_rows(x)
        return (
            values.at[layer, page, offset].set(to_stored(xq, values.dtype), mode="drop"),
            scales.at[layer, page, offset].set(xs, mode="drop"),
        )

    k_cache, k_scales = put(cache.k, cache.k_scales, k)
    if cache.v_scales is None:
        return cache.replace(k=k_cache, k_scales=k_scales)
    v_cache, v_scales = put(cache.v, cache.v_scales, v)
    return KVCache(k=k_cache, v=v_cache, k_scales=k_scales, v_scales=v_scales)
