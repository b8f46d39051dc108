"""Paged attention: the KV cache layout, the KV write, and attention that reads only through pages.

The cache layout is owned here; callers ask ``kv_cache_shape`` instead of hard-coding it.
``attention`` picks the Pallas kernel (``kernel.py``) or the reference (``reference.py``).
"""

from pallas_kernels.paged_attention.layout import KVCache, kv_cache_shape, write_kv
from pallas_kernels.paged_attention.ops import attention
from pallas_kernels.paged_attention.reference import paged_attention

__all__ = ["KVCache", "attention", "kv_cache_shape", "paged_attention", "write_kv"]
