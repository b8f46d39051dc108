"""The startup check a device must pass before ``ops`` may pick the TPU ragged kernel for "auto".

``check_tpu_kernel`` does what the design asks of an accelerator kernel before it is used:

1. compile the kernel for every served bucket (``Bucket``: the step's padded ``num_tokens``,
   ``num_seqs`` and ``pages_per_seq``) with the served cache's shape and dtype, so a shape Mosaic
   rejects fails here and not in the first step;
2. run it once on a small mixed case in that cache layout (decode rows, a chunk after cached pages,
   an empty sequence, padding rows; a shuffled page table; NaN in every slot no sequence owns);
3. compare with ``reference.ragged_paged_attention`` on the same device, the reference's matmuls
   at float32 precision: rows that see a key within the tolerance of the query dtype, every other
   row zero, nothing NaN.

It returns a ``CheckResult`` (``ok`` and a ``reason`` for the log) and never raises for a kernel
that fails: a failure means the runtime keeps the reference. On CPU, ``interpret=True`` runs the
same check in Pallas' TPU interpreter (the tests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.pallas_kernels.paged_attention import layout, reference, tpu

# Absolute and relative tolerance by query (output) dtype: float32 outputs differ by rounding
# in the order of accumulation; 16-bit ones by the rounding of the output itself.
_TOLERANCE = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 2e-2}
_DEFAULT_TOLERANCE = 5e-3  # float16
# (q_len, kv_len) per sequence of the small case: decodes, a first chunk, a chunk after two
# cached pages of its page size, an empty sequence.
_SEQS = ((1, 9), (5, 5), (0, 0), (4, 13), (1, 2))
_PADDING = 3


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One padded shape of the ragged call the runtime compiles."""

    num_tokens: int
    num_seqs: int
    pages_per_seq: int


@dataclasses.dataclass(frozen=True)
class CheckResult:
    ok: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Served:
    """What the runtime serves: the cache arrays' shape and dtype, the query heads and dtype, and
    the attention options of the model's layers."""

    cache_shape: tuple[int, int, int, int, int]  # [num_layers, num_pages, page_size, kv_heads, d]
    cache_dtype: jnp.dtype
    num_heads: int
    q_dtype: jnp.dtype
    scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None

    @property
    def row_scales(self) -> bool:
        return jnp.dtype(self.cache_dtype) == layout.FP8


def _abstract_args(served: Served, bucket: Bucket) -> tuple[tuple, dict]:
    """The kernel's arguments for ``bucket`` as shapes, and the row scales' if the cache has them."""
    s = jax.ShapeDtypeStruct
    head_dim = served.cache_shape[4]
    cache = s(served.cache_shape, served.cache_dtype)
    args = (
        s((bucket.num_tokens, served.num_heads, head_dim), served.q_dtype),
        cache,
        cache,
        s((), jnp.int32),
        s((bucket.num_tokens,), jnp.int32),
        s((bucket.num_seqs + 1,), jnp.int32),
        s((bucket.num_seqs, bucket.pages_per_seq), jnp.int32),
        s((bucket.num_seqs,), jnp.int32),
    )
    scales = s(served.cache_shape[:4], jnp.float32)
    return args, ({"k_scales": scales, "v_scales": scales} if served.row_scales else {})


def _options(served: Served) -> dict:
    return dict(scale=served.scale, sliding_window=served.sliding_window, soft_cap=served.soft_cap)


def _small_case(served: Served, seed: int = 0) -> tuple[tuple, dict]:
    """The small mixed case (``_SEQS``) in the served layout: layer 1 of 2, a shuffled page table,
    NaN in every slot (and row scale) no sequence owns."""
    rng = np.random.default_rng(seed)
    _, _, page_size, num_kv_heads, head_dim = served.cache_shape
    num_seqs = len(_SEQS)
    pages_per_seq = -(-max(kv for _, kv in _SEQS) // page_size) + 1
    num_pages = num_seqs * pages_per_seq + 2
    page_indices = rng.permutation(num_pages)[: num_seqs * pages_per_seq].astype(np.int32)
    page_indices = page_indices.reshape(num_seqs, pages_per_seq)
    kv = np.full((2, 2, num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32)
    for s, (_, n) in enumerate(_SEQS):
        t = np.arange(n)
        kv[:, 1, page_indices[s, t // page_size], t % page_size] = rng.standard_normal(
            (2, n, num_kv_heads, head_dim)
        )
    scales = {}
    if served.row_scales:
        values, row_scales = layout.quantize_rows(jnp.asarray(kv))
        row_scales = jnp.where(jnp.isnan(kv).any(-1), jnp.nan, row_scales)
        caches = (values[0], values[1])
        scales = {"k_scales": row_scales[0], "v_scales": row_scales[1]}
    else:
        caches = tuple(jnp.asarray(c, served.cache_dtype) for c in kv)
    positions = [kv_len - q_len + np.arange(q_len) for q_len, kv_len in _SEQS]
    num_tokens = sum(q_len for q_len, _ in _SEQS) + _PADDING
    q = rng.standard_normal((num_tokens, served.num_heads, head_dim))
    args = (
        jnp.asarray(q, served.q_dtype),
        *caches,
        jnp.int32(1),
        jnp.asarray(np.concatenate([*positions, np.full(_PADDING, 10**6)]), jnp.int32),
        jnp.asarray(np.cumsum([0, *(q_len for q_len, _ in _SEQS)]), jnp.int32),
        jnp.asarray(page_indices),
        jnp.asarray([kv_len for _, kv_len in _SEQS], jnp.int32),
    )
    return args, scales


def _compare(out: jax.Array, ref: jax.Array, args: tuple, served: Served) -> CheckResult:
    """``out`` against ``ref``: close on rows that see a key, zero on the others, never NaN."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    seq, valid = reference.sequence_ids(args[5], args[0].shape[0])
    lens = jnp.where(valid, args[7][seq], 0)
    seen = np.asarray(reference.sees_a_key(args[4], lens, served.sliding_window))
    if not np.isfinite(out).all():
        return CheckResult(False, "the kernel returned NaN or inf (stale pages leaked?)")
    if out[~seen].any():
        return CheckResult(False, "rows that see no key (padding) are not zero")
    tol = _TOLERANCE.get(jnp.dtype(served.q_dtype), _DEFAULT_TOLERANCE)
    err = np.abs(out[seen] - ref[seen])
    worst = float(np.max(err / (tol + tol * np.abs(ref[seen]))))
    if worst > 1.0:
        return CheckResult(False, f"differs from the reference: max |error| {err.max():.3g}")
    return CheckResult(True, f"max |error| against the reference {err.max():.3g}")


def check_tpu_kernel(
    served: Served, buckets: Sequence[Bucket], *, interpret: bool = False
) -> CheckResult:
    """Compiles ``tpu.ragged_paged_attention`` for every bucket of ``served``, runs it on a small
    mixed case and compares it with the reference (the module docstring). Never raises for a
    kernel that fails: ``ok`` is False and ``reason`` says where."""
    options = _options(served)

    def kernel(*args, **scales):
        return tpu.ragged_paged_attention(*args, **options, **scales, interpret=interpret)

    run = jax.jit(kernel)
    for bucket in buckets:
        args, scales = _abstract_args(served, bucket)
        try:
            run.lower(*args, **scales).compile()
        except Exception as e:  # any compile failure means "keep the reference", with its reason
            return CheckResult(False, f"{bucket} did not compile: {type(e).__name__}: {e}")
    args, scales = _small_case(served)
    try:
        out = jax.block_until_ready(run(*args, **scales))
    except Exception as e:  # a runtime failure on the device: the same verdict
        return CheckResult(False, f"the small case failed to run: {type(e).__name__}: {e}")
    with jax.default_matmul_precision("float32"):
        ref = jax.jit(lambda *a, **s: reference.ragged_paged_attention(*a, **options, **s))(
            *args, **scales
        )
    result = _compare(out, ref, args, served)
    if result.ok:
        return CheckResult(True, f"compiled {len(buckets)} buckets; {result.reason}")
    return result
