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


def test_auto_stores_float16_for_a_float32_model_under_int8_activations() -> None:
    """llama.cpp's default cache: only where the projections multiply int8 activations (there
    the integer dots keep a request's tokens independent of its batch with a 16-bit cache too)."""
    import jax.numpy as jnp

    from jax_llm_runtime.runtime.loading.builder import resolve_kv_cache_dtype

    f32, f16, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)
    assert resolve_kv_cache_dtype("auto", f32, int8_activations=True) == f16
    assert resolve_kv_cache_dtype("auto", f32, int8_activations=False) == f32
    assert resolve_kv_cache_dtype("auto", bf16, int8_activations=True) == bf16
    assert resolve_kv_cache_dtype("float32", f32, int8_activations=True) == f32
    assert resolve_kv_cache_dtype("bfloat16", f32) == bf16


def test_the_default_cpu_cache_holds_float32s_tokens_in_any_dtype() -> None:
    """``CPU_KVCACHE_MB`` counts float32 bytes: a float16 cache holds the same tokens in half."""
    import jax.numpy as jnp

    from jax_llm_runtime.models.registry import model_config_from_hf
    from jax_llm_runtime.runtime.loading.builder import _size_cache

    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
    }  # fmt: skip
    _, model_config = model_config_from_hf(hf)
    f32, f16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)
    config = EngineConfig()
    as_f32 = _size_cache(config, model_config, f32, 16)
    sized_f16 = _size_cache(config, model_config, f16, 16, sized_as=f32)
    own_f16 = _size_cache(config, model_config, f16, 16)
    assert sized_f16 == as_f32  # (pages, max_model_len)
    assert own_f16[0] == 2 * as_f32[0]  # --kvcache-mem: twice the pages in the same MB
