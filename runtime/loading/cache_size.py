"""How much memory the paged KV cache gets when ``--kvcache-mem`` is not given: a fixed
``CPU_KVCACHE_MB`` on CPU, and on accelerators what ``--gpu-memory-utilization`` of each
device's memory leaves once the weights are on it, as vLLM sizes its cache. The rest of the
share (``1 - utilization``) is left for the step's activations and XLA's buffers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from jax_llm_runtime.runtime.config import CPU_KVCACHE_MB

logger = logging.getLogger(__name__)


def auto_kvcache_mb(devices: Sequence[Any], utilization: float) -> int:
    """MB for the whole KV cache of a replica on ``devices`` (it splits evenly over them):
    ``utilization`` times the smallest device's memory, less what that device already holds,
    times the device count. ``CPU_KVCACHE_MB`` on CPU, and where a device reports no memory
    limit. Raises ValueError when the weights leave nothing."""
    if all(d.platform == "cpu" for d in devices):
        return CPU_KVCACHE_MB
    stats = [d.memory_stats() or {} for d in devices]
    if any("bytes_limit" not in s for s in stats):
        logger.warning(
            "a device reports no memory limit: the KV cache takes %d MB (--kvcache-mem sets it)",
            CPU_KVCACHE_MB,
        )
        return CPU_KVCACHE_MB
    free = min(utilization * s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    limit = min(s["bytes_limit"] for s in stats) / 2**20
    used = max(s.get("bytes_in_use", 0) for s in stats) / 2**20
    if free < 2**20:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} of {limit:.0f} MB leaves nothing for the "
            f"KV cache after the {used:.0f} MB already in use; raise it or set --kvcache-mem"
        )
    total = int(free // 2**20) * len(devices)
    logger.info(
        "KV cache sized from device memory: %.2f of %.0f MB less %.0f MB in use, %d MB on each "
        "of %d devices",
        utilization,
        limit,
        used,
        total // len(devices),
        len(devices),
    )
    return total
