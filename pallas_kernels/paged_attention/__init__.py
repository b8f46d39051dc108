"""Paged attention: the KV cache layout, the KV write, and attention that reads only through pages.

The cache layout is owned here; callers ask ``kv_cache_shape`` (and ``kv_scale_shape``,
``kv_cache_bytes`` for a float8 cache) instead of hard-coding it, and write through
``write_cache``. A bfloat16 or float8 cache is stored as integers on CPU (``storage_dtype``);
anything that reads its arrays directly goes through ``from_stored``.
``attention`` picks the Pallas kernel (``kernel.py``), the native CPU kernel (``native.py``) or
the reference (``reference.py``). ``ragged_paged_attention`` is the contract of a step whose
query rows are a flat run mixing sequences (decode tokens and prefill chunks, ``q_starts``);
``ragged_attention`` picks its implementation, the TPU kernel (``tpu.py``, gated by
``self_check.py``) among them.
"""

from jax_llm_runtime.pallas_kernels.paged_attention.layout import (
    FP8,
    KVCache,
    from_stored,
    kv_cache_bytes,
    kv_cache_shape,
    kv_scale_shape,
    quantize_rows,
    storage_dtype,
    to_stored,
    value_dtype,
    write_cache,
    write_cache_ragged,
    write_kv,
)
from jax_llm_runtime.pallas_kernels.paged_attention.ops import attention, ragged_attention
from jax_llm_runtime.pallas_kernels.paged_attention.reference import (
    paged_attention,
    ragged_paged_attention,
)

__all__ = [
    "FP8",
    "KVCache",
    "attention",
    "from_stored",
    "kv_cache_bytes",
    "kv_cache_shape",
    "kv_scale_shape",
    "paged_attention",
    "quantize_rows",
    "ragged_attention",
    "ragged_paged_attention",
    "storage_dtype",
    "to_stored",
    "value_dtype",
    "write_cache",
    "write_cache_ragged",
    "write_kv",
]
