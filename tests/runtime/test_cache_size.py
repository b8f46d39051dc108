"""The KV cache's size without ``--kvcache-mem``: fixed on CPU, a share of device memory on
accelerators (devices faked: their memory_stats are what a GPU reports)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from jax_llm_runtime.runtime.config import CPU_KVCACHE_MB, EngineConfig
from jax_llm_runtime.runtime.loading.cache_size import auto_kvcache_mb

GB = 2**30


@dataclass
class FakeDevice:
    platform: str
    stats: dict | None

    def memory_stats(self) -> dict | None:
        return self.stats


def gpu(limit_gb: float, in_use_gb: float) -> FakeDevice:
    return FakeDevice(
        "gpu", {"bytes_limit": int(limit_gb * GB), "bytes_in_use": int(in_use_gb * GB)}
    )


def test_cpu_keeps_a_fixed_cache() -> None:
    assert auto_kvcache_mb([FakeDevice("cpu", None)], 0.9) == CPU_KVCACHE_MB
    assert EngineConfig().kvcache_mem_mb == 0  # auto unless given


def test_accelerators_take_the_share_left_after_the_weights() -> None:
    # 80 GB at 0.9 = 72 GB, of which the weights hold 16: 56 GB of cache.
    assert auto_kvcache_mb([gpu(80, 16)], 0.9) == 56 * 1024
    # Split over devices: the fullest one decides, and every device holds the same share.
    assert auto_kvcache_mb([gpu(80, 16), gpu(80, 20)], 0.5) == 2 * 20 * 1024


def test_weights_that_leave_nothing_are_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match=r"--gpu-memory-utilization 0\.5 of 81920 MB leaves nothing"
    ):
        auto_kvcache_mb([gpu(80, 40)], 0.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_a_device_without_a_limit_falls_back_to_the_fixed_size() -> None:
    assert auto_kvcache_mb([FakeDevice("tpu", {})], 0.9) == CPU_KVCACHE_MB
