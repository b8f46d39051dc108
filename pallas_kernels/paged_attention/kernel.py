"""Pallas paged attention: the reference's signature and semantics, read page by page on-chip.

1. The wrapper lays the queries out per KV head: the ``group`` query heads that share one KV head
   become consecutive rows (``row = token * group + head``), so one K/V block serves all of them.
2. The grid is ``(sequence, kv head, row block, split)``. Each program finds the key range its rows
   can see (``kv_lens``, causality, the sliding window, its split) and loops over only that range,
   ``block_k`` keys at a time, gathering each key's row through ``page_indices``.
3. Each step is one flash-attention update in float32 (running max, running sum, rescaled
   accumulator). Masked scores and out-of-range values are *selected* away, never multiplied by
   zero, so NaN-filled stale pages cannot leak.
4. With ``num_splits > 1`` each split writes its normalised partial output and log-sum-exp, and a
   small jnp step combines them.
5. A float8 cache with row scales (``k_scales``/``v_scales``, see ``layout.py``) has each key's
   scale gathered with its row, and the row dequantised before it is used; a NaN scale of a
   masked key is selected away like a NaN value.
6. A cache in integer storage (bfloat16 or float8 bits on CPU, ``layout.storage_dtype``; only
   interpret mode meets one) has each gathered block bitcast to its float dtype.

A row that sees no key at all (a padding row) returns zeros.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_llm_runtime.pallas_kernels.paged_attention import reference, tuning
from jax_llm_runtime.pallas_kernels.paged_attention.layout import from_stored, value_dtype

_MASKED = -1e30  # finite: exp(_MASKED - _MASKED) is 1, not NaN, while a row has seen no key yet
_CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)


def _attention_kernel(
    scalars_ref,  # [2] int32: layer, sliding window (unused without one)
    scales_ref,  # [2] float32: k_scale, v_scale
    kv_lens_ref,  # [num_seqs] int32
    page_indices_ref,  # [padded_pages] int32, this sequence's page table
    positions_ref,  # [block_rows] int32, the position of each row's query token, -1 for padding
    q_ref,  # [block_rows, head_dim]
    k_ref,  # [num_layers, num_pages, page_size, head_dim], this KV head
    v_ref,  # [num_layers, num_pages, page_size, head_dim], this KV head
    *refs,  # ([k_scales, v_scales] with row scales), o, ([lse] with splits): see below
    scale: float,
    soft_cap: float | None,
    has_window: bool,
    page_size: int,
    block_k: int,
    keys_per_split: int,
    max_keys: int,
    row_scales: bool,
    narrow: bool = False,
):
    # k_scales, v_scales: [num_layers, num_pages, page_size] float32, this KV head's row scales
    k_scales_ref, v_scales_ref = refs[:2] if row_scales else (None, None)
    # o: [block_rows, head_dim]; lse: [block_rows] float32
    o_ref, *lse_refs = refs[2:] if row_scales else refs
    seq, split = pl.program_id(0), pl.program_id(3)
    layer, window = scalars_ref[0], scalars_ref[1]
    k_scale, v_scale = scales_ref[0], scales_ref[1]
    kv_len = jnp.minimum(kv_lens_ref[seq], max_keys)
    pos = positions_ref[...]
    # A 16-bit cache with queries of its dtype multiplies at that width, accumulating in
    # float32 (the tensor cores' rate); other caches multiply float32 at full precision.
    q = q_ref[...] if narrow else q_ref[...].astype(jnp.float32)
    precision = None if narrow else lax.Precision.HIGHEST
    block_rows, head_dim = q.shape

    # Keys any row of this block can see: [lo, hi), intersected with this split's share.
    last_pos = jnp.max(pos)
    hi = jnp.minimum(kv_len, last_pos + 1)
    lo = jnp.int32(0)
    if has_window:
        first_pos = jnp.min(jnp.where(pos >= 0, pos, last_pos))
        lo = jnp.maximum(first_pos - window + 1, 0)
    split_start = split * keys_per_split
    lo = jnp.maximum(lo, split_start)
    hi = jnp.minimum(hi, split_start + keys_per_split)
    first_block = lax.div(lo, block_k)
    num_blocks = jnp.maximum(lax.div(hi + block_k - 1, block_k) - first_block, 0)

    def step(j, carry):
        m, total, acc = carry  # running max, running sum, accumulator
        t = (first_block + j) * block_k + jnp.arange(block_k, dtype=jnp.int32)  # key positions
        page = page_indices_ref[lax.div(t, page_size)]
        offset = lax.rem(t, page_size)
        k = from_stored(k_ref[layer, page, offset, :])  # [block_k, head_dim]
        v = from_stored(v_ref[layer, page, offset, :])
        if not narrow:
            k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        if row_scales:
            k = k * k_scales_ref[layer, page, offset][:, None]
            v = v * v_scales_ref[layer, page, offset][:, None]
        s = lax.dot_general(
            q,
            k,
            (((1,), (1,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        ) * (scale * k_scale)  # [block_rows, block_k]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        in_range = t < kv_len  # [block_k]
        visible = in_range[None, :] & (t[None, :] <= pos[:, None])
        if has_window:
            visible &= t[None, :] > pos[:, None] - window
        s = jnp.where(visible, s, _MASKED)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_next)
        p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
        v = jnp.where(in_range[:, None], v, jnp.zeros((), v.dtype))  # 0 * NaN is NaN: zeros
        pv = lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return m_next, alpha * total + jnp.sum(p, axis=1), alpha[:, None] * acc + pv

    init = (
        jnp.full((block_rows,), _MASKED, jnp.float32),
        jnp.zeros((block_rows,), jnp.float32),
        jnp.zeros((block_rows, head_dim), jnp.float32),
    )
    m, total, acc = lax.fori_loop(0, num_blocks, step, init)
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    o_ref[...] = (acc / safe_total[:, None] * v_scale).astype(o_ref.dtype)
    if lse_refs:
        lse_refs[0][...] = jnp.where(seen, m + jnp.log(safe_total), _MASKED)


def _combine_splits(
    o: jax.Array,  # [num_splits, num_seqs, num_kv_heads, rows, head_dim] float32, normalised
    lse: jax.Array,  # [num_splits, num_seqs, num_kv_heads, rows] float32, _MASKED where empty
) -> jax.Array:  # [num_seqs, num_kv_heads, rows, head_dim] float32
    """Merge per-split softmax results by their log-sum-exp weights.

    The largest weight is exactly 1, so the total never vanishes; an empty split's weight
    underflows to 0, and a row empty in every split averages zeros.
    """
    weight = jnp.exp(lse - jnp.max(lse, axis=0)[None])
    return jnp.sum(weight[..., None] * o, axis=0) / jnp.sum(weight, axis=0)[..., None]


def _narrow(q_dtype: jnp.dtype, cache_dtype: jnp.dtype, row_scales: bool) -> bool:
    """Whether the kernel multiplies at 16 bits: a bfloat16 or float16 cache (no row scales)
    read by queries of the same dtype."""
    value = value_dtype(cache_dtype)
    return not row_scales and value == q_dtype and value in (jnp.bfloat16, jnp.float16)


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _validate(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    page_indices: jax.Array,
    kv_lens: jax.Array,
    sliding_window: int | jax.Array | None,
    soft_cap: float | None,
    num_splits: int,
    k_scales: jax.Array | None,
    v_scales: jax.Array | None,
) -> None:
    # The shape rules the reference checks; then what the kernel needs on top.
    reference._validate(q, k_cache, page_indices, kv_lens)
    reference._validate_scales(k_cache, v_cache, k_scales, v_scales)
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_layers, num_pages, page_size, num_kv_heads, "
            f"head_dim], got shapes {k_cache.shape} and {v_cache.shape}"
        )
    if k_cache.dtype != v_cache.dtype or value_dtype(k_cache.dtype) not in _CACHE_DTYPES:
        raise ValueError(
            f"k_cache and v_cache must share one of {[jnp.dtype(d).name for d in _CACHE_DTYPES]}, "
            f"got {k_cache.dtype} and {v_cache.dtype}"
        )
    if positions.shape != q.shape[:2]:
        raise ValueError(f"positions must be {list(q.shape[:2])}, got {positions.shape}")
    if page_indices.ndim != 2:
        raise ValueError(
            f"page_indices must be [num_seqs, pages_per_seq], got {page_indices.shape}"
        )
    if isinstance(sliding_window, int) and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static launch geometry of one call."""

    config: tuning.BlockConfig
    group: int  # query heads per KV head
    rows: int  # q_len * group: the query rows of one sequence and KV head
    num_row_blocks: int
    max_keys: int  # pages_per_seq * page_size
    keys_per_split: int  # a multiple of block_k
    padded_pages: int  # page-table width covering every split's last block
    num_splits: int

    @property
    def padded_rows(self) -> int:
        return self.num_row_blocks * self.config.block_rows


def _plan(
    q_shape: tuple[int, ...],
    cache_shape: tuple[int, ...],
    pages_per_seq: int,
    num_splits: int,
    overrides: dict[str, int | None],
) -> _Plan:
    """The table's block sizes with explicit overrides, shrunk (never below 16) for tiny calls."""
    _, q_len, num_heads, head_dim = q_shape
    page_size, num_kv_heads = cache_shape[2], cache_shape[3]
    group = num_heads // num_kv_heads
    rows = q_len * group
    max_keys = pages_per_seq * page_size
    split_keys = pl.cdiv(max_keys, num_splits)
    base = tuning.lookup(head_dim, page_size, q_len)
    chosen = tuning.BlockConfig(**{k: v or getattr(base, k) for k, v in overrides.items()})
    config = dataclasses.replace(
        chosen,
        block_rows=min(chosen.block_rows, max(16, _next_power_of_two(rows))),
        block_k=min(chosen.block_k, max(16, _next_power_of_two(split_keys))),
    )
    keys_per_split = pl.cdiv(split_keys, config.block_k) * config.block_k
    return _Plan(
        config=config,
        group=group,
        rows=rows,
        num_row_blocks=pl.cdiv(rows, config.block_rows),
        max_keys=max_keys,
        keys_per_split=keys_per_split,
        padded_pages=pl.cdiv(num_splits * keys_per_split, page_size),
        num_splits=num_splits,
    )


def _to_rows(
    q: jax.Array,  # [num_seqs, q_len, num_heads, head_dim]
    positions: jax.Array,  # [num_seqs, q_len] int32
    num_kv_heads: int,
    plan: _Plan,
) -> tuple[jax.Array, jax.Array]:  # [num_seqs, num_kv_heads, padded_rows, head_dim], [s, rows]
    """Query rows per KV head, token-major and head-minor, so one block holds a whole group."""
    num_seqs, q_len, _, head_dim = q.shape
    pad = plan.padded_rows - plan.rows
    q_rows = q.reshape(num_seqs, q_len, num_kv_heads, plan.group, head_dim)
    q_rows = q_rows.transpose(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, plan.rows, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, pad), (0, 0)))
    row_positions = jnp.repeat(positions.astype(jnp.int32), plan.group, axis=1)
    return q_rows, jnp.pad(row_positions, ((0, 0), (0, pad)), constant_values=-1)


def _from_rows(
    out: jax.Array,  # [num_seqs, num_kv_heads, padded_rows, head_dim]
    q_shape: tuple[int, ...],
    plan: _Plan,
) -> jax.Array:  # [num_seqs, q_len, num_heads, head_dim]
    num_seqs, q_len, num_heads, head_dim = q_shape
    out = out[:, :, : plan.rows].reshape(num_seqs, -1, q_len, plan.group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(num_seqs, q_len, num_heads, head_dim)


def _compiler_params(config: tuning.BlockConfig, interpret: bool) -> object | None:
    """Triton on GPU: the default Mosaic GPU lowering of ``pallas_call`` has no matmul rule."""
    if interpret or jax.default_backend() != "gpu":
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def _launch(
    kernel_body: Callable[..., None],
    plan: _Plan,
    out_dtype: jnp.dtype,
    inputs: tuple[jax.Array, ...],  # the kernel's inputs in its argument order; 10 with scales
    interpret: bool,
) -> list[jax.Array]:  # o [num_splits, s, kv_heads, padded_rows, d] (+ lse without head_dim)
    """The ``pallas_call``: grid ``(sequence, kv head, row block, split)`` and its BlockSpecs."""
    num_seqs, num_kv_heads, padded_rows, head_dim = inputs[5].shape
    cache_shape = inputs[6].shape
    row_scales = len(inputs) > 8
    block_rows, splits = plan.config.block_rows, plan.num_splits
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    cache_spec = pl.BlockSpec(
        (*cache_shape[:3], None, head_dim), lambda s, h, r, k: (0, 0, 0, h, 0)
    )
    scales_spec = pl.BlockSpec((*cache_shape[:3], None), lambda s, h, r, k: (0, 0, 0, h))
    out_shape = [
        jax.ShapeDtypeStruct((splits, num_seqs, num_kv_heads, padded_rows, head_dim), out_dtype)
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, block_rows, head_dim), lambda s, h, r, k: (k, s, h, r, 0))
    ]
    if splits > 1:
        out_shape.append(jax.ShapeDtypeStruct(out_shape[0].shape[:-1], jnp.float32))
        out_specs.append(
            pl.BlockSpec((None, None, None, block_rows), lambda s, h, r, k: (k, s, h, r))
        )
    return pl.pallas_call(
        kernel_body,
        grid=(num_seqs, num_kv_heads, plan.num_row_blocks, splits),
        in_specs=[
            whole((2,)),  # layer, window
            whole((2,)),  # k_scale, v_scale
            whole((num_seqs,)),  # kv_lens
            pl.BlockSpec((None, plan.padded_pages), lambda s, h, r, k: (s, 0)),
            pl.BlockSpec((None, block_rows), lambda s, h, r, k: (s, r)),
            pl.BlockSpec((None, None, block_rows, head_dim), lambda s, h, r, k: (s, h, r, 0)),
            cache_spec,
            cache_spec,
            *([scales_spec, scales_spec] if row_scales else []),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(plan.config, interpret),
        interpret=interpret,
        name="paged_attention",
    )(*inputs)


def _kernel_inputs(
    q: jax.Array,
    positions: jax.Array,
    page_indices: jax.Array,
    kv_lens: jax.Array,
    scalars: tuple[object, object, object, object],  # layer, sliding_window, k_scale, v_scale
    caches: tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None],
    plan: _Plan,
) -> tuple[jax.Array, ...]:
    """The kernel's operands in ``_attention_kernel``'s order: (layer, window), the two scales,
    KV lengths, padded page table, row positions, query rows, the caches (and row scales)."""
    layer, sliding_window, k_scale, v_scale = scalars
    k_cache, v_cache, k_scales, v_scales = caches
    num_layers, num_pages = k_cache.shape[:2]
    q_rows, row_positions = _to_rows(q, positions, k_cache.shape[3], plan)
    # Clipped so that a stale index in an unused slot cannot address memory outside the cache.
    pages = jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1)
    pages = jnp.pad(pages, ((0, 0), (0, plan.padded_pages - page_indices.shape[1])))
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    scales = jnp.stack([jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)])
    inputs = (
        jnp.stack([layer, window]),
        scales,
        kv_lens.astype(jnp.int32),
        pages,
        row_positions,
        q_rows,
        k_cache,
        v_cache,
    )
    if k_scales is not None:
        inputs += (k_scales.astype(jnp.float32), v_scales.astype(jnp.float32))
    return inputs


# Programs a launch should have at least: a few per streaming multiprocessor of a large GPU
# (an H100 has 132), so that a decode of one sequence does not run on 8 of them.
MIN_PROGRAMS = 512


def auto_splits(
    q_shape: tuple[int, ...],
    cache_shape: tuple[int, ...],
    pages_per_seq: int,
    block_k: int | None = None,
) -> int:
    """Key-range splits (split-K, "flash decoding") for a call: enough that the grid has about
    ``MIN_PROGRAMS`` programs, never more than one ``block_k`` block of keys per split. An H100
    trace ran a one-sequence decode of 8 KV heads without splits at 14 GB/s (BENCHMARKS.md)."""
    num_seqs, q_len, num_heads, head_dim = q_shape
    page_size, num_kv_heads = cache_shape[2], cache_shape[3]
    base = tuning.lookup(head_dim, page_size, q_len)
    rows = q_len * (num_heads // num_kv_heads)
    block_rows = min(base.block_rows, max(16, _next_power_of_two(rows)))
    programs = num_seqs * num_kv_heads * pl.cdiv(rows, block_rows)
    blocks = pl.cdiv(pages_per_seq * page_size, block_k or base.block_k)
    return int(max(1, min(pl.cdiv(MIN_PROGRAMS, programs), blocks)))


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
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    k_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    v_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    num_splits: int | None = None,
    block_rows: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [num_seqs, q_len, num_heads, head_dim]
    """Causal paged attention as a Pallas kernel; same contract as ``reference.paged_attention``.

    Key ``t`` is visible to query position ``p`` iff ``t < kv_lens[s]``, ``t <= p`` and, with a
    window ``w`` (a static int or a traced int32 scalar), ``t > p - w``. The cache may be float8
    (e4m3fn or e5m2): it is dequantised in-kernel as ``k * k_scale`` and ``v * v_scale``, and
    with ``k_scales``/``v_scales`` also by each row's own scale (``KVCache``'s float8 layout).
    ``num_splits`` splits each sequence's key range across programs (split-K, for long contexts
    and few sequences); by default ``auto_splits`` picks it from the grid's size (compiled
    kernels; 1 when interpreted). Block sizes
    default to ``tuning.lookup``; ``interpret=True`` runs the kernel on CPU. Rows that see no key
    return zeros.
    """
    if num_splits is None:  # interpreted programs run one after another: no splits there
        splits = auto_splits(q.shape, k_cache.shape, page_indices.shape[1], block_k)
        num_splits = 1 if interpret else splits
    _validate(
        q,
        k_cache,
        v_cache,
        positions,
        page_indices,
        kv_lens,
        sliding_window,
        soft_cap,
        num_splits,
        k_scales,
        v_scales,
    )
    page_size, head_dim = k_cache.shape[2], k_cache.shape[4]
    if not interpret and not tuning.is_power_of_two(head_dim):
        raise ValueError(
            f"the compiled kernel needs a power-of-two head_dim (Triton blocks), got {head_dim}; "
            "use the reference (ops.attention(impl='reference')) for this model"
        )
    overrides = dict(
        block_rows=block_rows, block_k=block_k, num_warps=num_warps, num_stages=num_stages
    )
    plan = _plan(q.shape, k_cache.shape, page_indices.shape[1], num_splits, overrides)
    kernel_body = functools.partial(
        _attention_kernel,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        has_window=sliding_window is not None,
        page_size=page_size,
        block_k=plan.config.block_k,
        keys_per_split=plan.keys_per_split,
        max_keys=plan.max_keys,
        row_scales=k_scales is not None,
        narrow=_narrow(q.dtype, k_cache.dtype, k_scales is not None),
    )
    scalars = (layer, sliding_window, k_scale, v_scale)
    caches = (k_cache, v_cache, k_scales, v_scales)
    inputs = _kernel_inputs(q, positions, page_indices, kv_lens, scalars, caches, plan)
    split = num_splits > 1
    outs = _launch(kernel_body, plan, jnp.float32 if split else q.dtype, inputs, interpret)
    out = _combine_splits(outs[0], outs[1]) if split else outs[0][0]
    return _from_rows(out, q.shape, plan).astype(q.dtype)
