"""Ragged paged attention for TPU: a Pallas (Mosaic) kernel with ``reference.ragged_paged_attention``'s
contract, reading our cache layout in place.

JAX ships a TPU kernel for this job (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``),
but it does not fit our contract, so it is not used:

- its cache is one array of interleaved K and V heads, ``[num_pages, page_size, 2 * num_kv_heads,
  head_dim]``, for one layer; ours is two arrays with every layer stacked (``layout.py``). Feeding it
  would copy a layer of the cache into its layout on every call, which costs more than the
  attention;
- it places each sequence's queries at the end of its KV (``kv_len - q_len + i``) instead of taking
  ``positions``, requires ``q_len <= kv_len``, and leaves rows past the last sequence (the padding of
  a bucketed step) undefined, where ours are zeros;
- it scales K/V by one float per cache and has no per-row scales.

This kernel, step by step:

1. The wrapper works out, per query row, the key range it may see, ``[lo, hi)`` (its sequence's
   ``kv_lens``, its position, the sliding window, the page table's length; empty for padding), and
   per block of ``block_q`` query tokens the sequences it overlaps. These go to SMEM as scalar
   prefetch with the layer, ``q_starts``, and the flattened ``page_indices``; ``lo``, ``hi`` and the
   row's sequence also go to VMEM, one per (token, query head of a group) row.
2. The grid is one program per query block, for all heads. A program walks the block's sequences;
   for each it takes the union of its rows' key ranges and copies those pages, ``pages_per_block``
   at a time, from the K and V caches in HBM (``pl.ANY``) into VMEM with async copies, all KV heads
   of a page at once (a page of one layer is contiguous). Buffers are doubled: the next step's
   pages are copied while the current step's are used (within a sequence; a sequence's first
   step waits for its copy).
3. Per KV head (a static loop), its keys are a strided load of the copied rows and its ``group``
   query heads are rows of one matrix, so one K/V block serves the group (GQA). Each step is a
   flash-attention update in float32 with ``HIGHEST`` precision; keys outside a row's range and
   rows of other sequences are selected away, so NaN in stale pages or in the unused tail of a
   page never reaches the output. A row that sees no key returns zeros.

Supported: float32, bfloat16, float16 and float8 caches, float8 with row scales
(``k_scales``/``v_scales``: each page's scales are copied beside it and each row is dequantised
before use; per-tensor ``k_scale``/``v_scale`` are folded in by ``ops``), GQA, causal chunks after
cached pages, static or traced sliding windows, soft-capping. Not supported, raising
``ValueError``: caches in integer storage (only the CPU backend stores caches so, where the native
kernel or the reference read them; ``ops.ragged_attention(impl="pallas")`` raises for them too).

Checked on CPU only: numerics in Pallas' TPU interpret mode, and lowering to a Mosaic custom call
with ``jax.export`` for ``tpu``. Mosaic's own compiler (layouts, VMEM limits) has not run it: no
TPU was available. ``self_check`` is the startup test a TPU must pass before ``ops`` picks it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_llm_runtime.pallas_kernels.paged_attention import reference

_MASKED = -1e30  # finite: a row that has seen no key keeps exp(m - m) = 1 instead of NaN
_LANES = 128  # the running max and sum keep one row per query row, broadcast over a lane tile
CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static shapes of one call."""

    num_tokens: int  # query tokens, padded to whole blocks
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    page_size: int
    pages_per_seq: int
    block_q: int  # query tokens per program
    pages_per_block: int  # pages copied and attended per step
    row_scales: bool  # a float8 cache with k_scales/v_scales

    @property
    def rows(self) -> int:  # query rows of one KV head in a block
        return self.block_q * self.group


def key_ranges(
    positions: jax.Array,  # [num_tokens] int32
    q_starts: jax.Array,  # [num_seqs + 1] int32
    kv_lens: jax.Array,  # [num_seqs] int32
    max_keys: int,  # pages_per_seq * page_size
    sliding_window: int | jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # lo, hi, seq: [num_tokens] int32 each
    """Each row's visible keys ``[lo, hi)`` and its sequence (``-1`` for padding, whose range is
    empty)."""
    seq, valid = reference.sequence_ids(q_starts, positions.shape[0])
    hi = jnp.minimum(jnp.minimum(kv_lens[seq], positions + 1), max_keys)
    lo = jnp.zeros_like(hi)
    if sliding_window is not None:
        lo = jnp.maximum(positions - sliding_window + 1, 0)
    hi = jnp.where(valid, jnp.maximum(hi, lo), lo)
    return lo.astype(jnp.int32), hi.astype(jnp.int32), jnp.where(valid, seq, -1).astype(jnp.int32)


def block_sequences(
    q_starts: jax.Array,  # [num_seqs + 1] int32
    num_blocks: int,
    block_q: int,
) -> tuple[jax.Array, jax.Array]:  # first, end: [num_blocks] int32
    """Per query block ``[b * block_q, (b + 1) * block_q)``, the sequences whose rows it holds:
    ``first <= s < end``."""
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    first = jnp.searchsorted(q_starts[1:], starts, side="right")
    end = jnp.searchsorted(q_starts[:-1], starts + block_q, side="left")
    return first.astype(jnp.int32), jnp.maximum(end, first).astype(jnp.int32)


def _seq_key_range(row_lo_ref, row_hi_ref, start, end, max_keys: int):
    """The union ``[lo, hi)`` of the key ranges of rows ``start..end-1`` (SMEM scalars); empty
    ranges (rows that see no key) add nothing."""

    def widen(row, bounds):
        lo, hi = bounds
        row_lo, row_hi = row_lo_ref[row], row_hi_ref[row]
        seen = row_hi > row_lo
        return (
            jnp.where(seen, jnp.minimum(lo, row_lo), lo),
            jnp.where(seen, jnp.maximum(hi, row_hi), hi),
        )

    return lax.fori_loop(start, end, widen, (jnp.int32(max_keys), jnp.int32(0)))


def _page_copies(plan: Plan, refs: dict, seq, first_page, last_page, slot) -> list:
    """The copies of logical pages ``first_page ..`` (``pages_per_block`` of them) of ``seq``
    from the caches (and row scales) into buffer ``slot``; positions past ``last_page`` get a
    copy of ``first_page`` (never used), so every copy reads a page the sequence owns."""
    layer = refs["layer"][0]
    copies = []
    for i in range(plan.pages_per_block):
        logical = jnp.where(first_page + i < last_page, first_page + i, first_page)
        page = refs["page_indices"][seq * plan.pages_per_seq + logical]
        rows = pl.ds(i * plan.page_size, plan.page_size)
        for j, name in enumerate(("k", "v", "ks", "vs")[: 4 if plan.row_scales else 2]):
            copies.append(
                pltpu.make_async_copy(
                    refs[name + "_hbm"].at[layer, page],
                    refs[name + "_buf"].at[slot, rows],
                    refs["sems"].at[slot, j],
                )
            )
    return copies


def _attend(plan: Plan, refs: dict, seq, first_key, keys, slot, *, scale, soft_cap):
    """One flash-attention update of every KV head's rows with the keys in buffer ``slot`` (key
    ``first_key + i`` in buffer row ``i``), for the rows of sequence ``seq`` only; ``keys`` is
    the ``[lo, hi)`` range of the sequence that some row sees (every key in it is written)."""
    num_keys = plan.pages_per_block * plan.page_size
    shape = (plan.rows, num_keys)
    key = first_key + lax.broadcasted_iota(jnp.int32, shape, 1)
    visible = (refs["seq"][...] == seq) & (key >= refs["lo"][...]) & (key < refs["hi"][...])
    # Values of keys outside the range (stale pages, a page's unused tail) may be NaN, and
    # 0 * NaN is NaN: they are selected away before the matmuls, not only masked in the scores.
    key_col = first_key + lax.broadcasted_iota(jnp.int32, (num_keys, 1), 0)
    key_used = (key_col >= keys[0]) & (key_col < keys[1])
    g = plan.group
    for h in range(plan.num_kv_heads):
        k = refs["k_buf"][slot, :, h, :].astype(jnp.float32)  # [num_keys, head_dim]
        v = refs["v_buf"][slot, :, h, :].astype(jnp.float32)
        if plan.row_scales:  # dequantised before the select: a stale row's scale may be NaN
            k = k * refs["ks_buf"][slot, :, h : h + 1]
            v = v * refs["vs_buf"][slot, :, h : h + 1]
        k, v = jnp.where(key_used, k, 0.0), jnp.where(key_used, v, 0.0)
        q = refs["q"][:, h * g : (h + 1) * g, :].astype(jnp.float32).reshape(plan.rows, -1)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        ) * scale  # fmt: skip
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible, s, _MASKED)
        m_prev = refs["m"][h][:, :1]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_next), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        refs["l"][h] = jnp.broadcast_to(
            alpha * refs["l"][h][:, :1] + jnp.sum(p, axis=1, keepdims=True), (plan.rows, _LANES)
        )
        refs["m"][h] = jnp.broadcast_to(m_next, (plan.rows, _LANES))
        pv = jnp.dot(p, v, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        refs["acc"][h] = alpha * refs["acc"][h] + pv


_SCALAR_NAMES = ("layer", "q_starts", "page_indices", "row_lo", "row_hi", "first_seq", "end_seq")


def _ref_names(row_scales: bool) -> tuple[str, ...]:
    """The kernel's refs in order: scalar prefetch, inputs, output, scratch."""
    scales_in, scales_buf = (("ks_hbm", "vs_hbm"), ("ks_buf", "vs_buf")) if row_scales else ((), ())
    return (
        *_SCALAR_NAMES,
        "q", "lo", "hi", "seq", "k_hbm", "v_hbm", *scales_in,
        "o",
        "k_buf", "v_buf", "sems", "m", "l", "acc", *scales_buf,
    )  # fmt: skip


def _kernel(*all_refs, plan: Plan, scale: float, soft_cap: float | None):
    """One query block of ``block_q`` tokens, all heads.

    SMEM: layer [1], q_starts [num_seqs + 1], page_indices [num_seqs * pages_per_seq], row_lo and
    row_hi [num_tokens], first_seq and end_seq [num_blocks]. VMEM blocks: q and o [block_q,
    num_heads, head_dim]; lo, hi, seq [rows, 1] int32. HBM: k_hbm, v_hbm, the whole caches.
    Scratch: k_buf, v_buf [2, pages_per_block * page_size, num_kv_heads, head_dim]; m, l
    [num_kv_heads, rows, 128] and acc [num_kv_heads, rows, head_dim] float32. With row scales
    also ks_hbm, vs_hbm [num_layers, num_pages, page_size, num_kv_heads] (HBM) and ks_buf, vs_buf
    [2, pages_per_block * page_size, num_kv_heads] float32 (scratch); sems [2, 2 or 4] DMA.
    """
    refs = dict(zip(_ref_names(plan.row_scales), all_refs, strict=True))
    block = pl.program_id(0)
    block_start = block * plan.block_q
    refs["m"][...] = jnp.full(refs["m"].shape, _MASKED, jnp.float32)
    refs["l"][...] = jnp.zeros(refs["l"].shape, jnp.float32)
    refs["acc"][...] = jnp.zeros(refs["acc"].shape, jnp.float32)
    ps, per_block = plan.page_size, plan.pages_per_block
    max_keys = plan.pages_per_seq * ps

    def one_sequence(seq, carry):
        start = jnp.maximum(refs["q_starts"][seq], block_start)
        end = jnp.minimum(refs["q_starts"][seq + 1], block_start + plan.block_q)
        keys = _seq_key_range(refs["row_lo"], refs["row_hi"], start, end, max_keys)
        # lax.div truncates (the values are >= 0): jnp's floor division asks for the TPU's
        # generation while lowering, which a lowering without a TPU cannot answer.
        first_page = lax.div(keys[0], ps)
        last_page = jnp.maximum(lax.div(keys[1] + ps - 1, ps), first_page)

        def copies(step, slot) -> list:
            page = first_page + step * per_block
            return _page_copies(plan, refs, seq, page, last_page, slot)

        def one_step(step, carry):
            slot = lax.rem(step, 2)

            @pl.when(step + 1 < steps)
            def _prefetch():  # the next step's pages, into the other buffer, while this one runs
                for copy in copies(step + 1, 1 - slot):
                    copy.start()

            for copy in copies(step, slot):
                copy.wait()
            first_key = (first_page + step * per_block) * ps
            _attend(plan, refs, seq, first_key, keys, slot, scale=scale, soft_cap=soft_cap)
            return carry

        steps = lax.div(last_page - first_page + per_block - 1, per_block)

        @pl.when(steps > 0)
        def _first():
            for copy in copies(0, 0):
                copy.start()

        return lax.fori_loop(0, steps, one_step, carry)

    block_seqs = (refs["first_seq"][block], refs["end_seq"][block])
    lax.fori_loop(block_seqs[0], block_seqs[1], one_sequence, 0)
    g = plan.group
    for h in range(plan.num_kv_heads):
        total = refs["l"][h][:, :1]
        out = jnp.where(total > 0, refs["acc"][h] / jnp.where(total > 0, total, 1.0), 0.0)
        out = out.reshape(plan.block_q, g, plan.head_dim)
        refs["o"][:, h * g : (h + 1) * g, :] = out.astype(refs["o"].dtype)


def _validate(k_cache, v_cache, k_scales, v_scales, sliding_window, soft_cap) -> None:
    reference._validate_scales(k_cache, v_cache, k_scales, v_scales)
    if k_scales is not None and (k_scales.dtype != jnp.float32 or v_scales.dtype != jnp.float32):
        raise ValueError(f"row scales must be float32, got {k_scales.dtype}, {v_scales.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must match")
    if k_cache.dtype not in [jnp.dtype(d) for d in CACHE_DTYPES]:
        raise ValueError(
            f"the TPU kernel reads caches of {[jnp.dtype(d).name for d in CACHE_DTYPES]}, got "
            f"{k_cache.dtype} (integer storage is for the CPU backend)"
        )
    if isinstance(sliding_window, int) and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")


def make_plan(
    q: jax.Array,  # [num_tokens, num_heads, head_dim]
    k_cache: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    pages_per_seq: int,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    row_scales: bool = False,
) -> Plan:
    """The call's static shapes; by default 8 query tokens per program and 128 keys per step
    (fewer where the page table is shorter)."""
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    block_q = block_q or 8
    pages_per_block = pages_per_block or max(1, min(pages_per_seq, 128 // page_size))
    if block_q < 1 or pages_per_block < 1:
        raise ValueError(
            f"block_q ({block_q}) and pages_per_block ({pages_per_block}) must be >= 1"
        )
    return Plan(
        num_tokens=-(-num_tokens // block_q) * block_q,
        num_kv_heads=num_kv_heads,
        group=num_heads // num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        block_q=block_q,
        pages_per_block=pages_per_block,
        row_scales=row_scales,
    )


def _inputs(plan: Plan, q, layer, positions, q_starts, page_indices, kv_lens, window, num_pages):
    """The scalar-prefetch operands (``_SCALAR_NAMES``) and the VMEM ones (q, lo, hi, seq)."""
    num_tokens = q.shape[0]
    pad = plan.num_tokens - num_tokens
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    positions = jnp.pad(positions.astype(jnp.int32), (0, pad))
    # Offsets past the rows or decreasing would only make undefined rows; kept in bounds.
    q_starts = jnp.clip(lax.cummax(q_starts.astype(jnp.int32)), 0, num_tokens)
    max_keys = plan.pages_per_seq * plan.page_size
    lo, hi, seq = key_ranges(positions, q_starts, kv_lens.astype(jnp.int32), max_keys, window)
    first, end = block_sequences(q_starts, plan.num_tokens // plan.block_q, plan.block_q)
    scalars = (
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        q_starts,
        # A page table entry the sequence uses must be in range; others are never read, but a
        # clipped copy keeps even a bad one from reading out of bounds.
        jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1).reshape(-1),
        lo,
        hi,
        first,
        end,
    )
    per_row = [jnp.repeat(x, plan.group)[:, None] for x in (lo, hi, seq)]  # [rows_total, 1]
    return scalars, (q, *per_row)


def _launch(plan: Plan, scalars, vmem_inputs, caches, out_dtype, kernel, interpret):
    """The ``pallas_call``: one program per query block (``parallel``: blocks share nothing)."""
    num_heads = plan.num_kv_heads * plan.group
    q_spec = pl.BlockSpec((plan.block_q, num_heads, plan.head_dim), lambda b, *_: (b, 0, 0))
    row_spec = pl.BlockSpec((plan.rows, 1), lambda b, *_: (b, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    num_keys = plan.pages_per_block * plan.page_size
    # Two of each buffer: a step's pages are used while the next step's arrive.
    buf = pltpu.VMEM((2, num_keys, plan.num_kv_heads, plan.head_dim), caches[0].dtype)
    scale_bufs = [pltpu.VMEM((2, num_keys, plan.num_kv_heads), jnp.float32)] * (len(caches) - 2)
    lm = pltpu.VMEM((plan.num_kv_heads, plan.rows, _LANES), jnp.float32)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(plan.num_tokens // plan.block_q,),
        in_specs=[q_spec, row_spec, row_spec, row_spec, *[hbm] * len(caches)],
        out_specs=q_spec,
        scratch_shapes=[
            buf,
            buf,
            pltpu.SemaphoreType.DMA((2, len(caches))),
            lm,
            lm,
            pltpu.VMEM((plan.num_kv_heads, plan.rows, plan.head_dim), jnp.float32),
            *scale_bufs,
        ],
    )
    if interpret is True:
        interpret = pltpu.InterpretParams()
    call = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((plan.num_tokens, num_heads, plan.head_dim), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret or False,
        name="ragged_paged_attention_tpu",
    )
    return call(*scalars, *vmem_inputs, *caches)


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
    scale: float | jax.Array,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    v_scales: jax.Array | None = None,  # [num_layers, num_pages, page_size, num_kv_heads]
    block_q: int | None = None,
    pages_per_block: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [num_tokens, num_heads, head_dim]
    """``reference.ragged_paged_attention`` on TPU (see the module docstring).

    ``block_q`` query tokens per program and ``pages_per_block`` pages per step default to
    ``make_plan``'s. ``interpret=True`` (or a ``pltpu.InterpretParams``) runs Pallas' TPU
    interpreter, which is how the CPU tests run it. Padding rows and rows that see no key return
    zeros. ``k_scales``/``v_scales`` are a float8 cache's row scales, as in the reference. Raises
    ``ValueError`` for caches in integer storage and for what the reference rejects.
    """
    reference._validate_ragged(q, k_cache, positions, q_starts, page_indices, kv_lens)
    _validate(k_cache, v_cache, k_scales, v_scales, sliding_window, soft_cap)
    out_dtype = q.dtype
    if not isinstance(scale, int | float):  # traced (ops folds a traced k_scale into it)
        q, scale = q.astype(jnp.float32) * scale, 1.0
    row_scales = k_scales is not None
    plan = make_plan(q, k_cache, page_indices.shape[1], block_q, pages_per_block, row_scales)
    scalars, vmem_inputs = _inputs(
        plan, q, jnp.asarray(layer), jnp.asarray(positions), jnp.asarray(q_starts),
        jnp.asarray(page_indices), jnp.asarray(kv_lens), sliding_window, k_cache.shape[1],
    )  # fmt: skip
    kernel = functools.partial(_kernel, plan=plan, scale=scale, soft_cap=soft_cap)
    caches = (k_cache, v_cache, *((k_scales, v_scales) if row_scales else ()))
    out = _launch(plan, scalars, vmem_inputs, caches, out_dtype, kernel, interpret)
    return out[: q.shape[0]]
