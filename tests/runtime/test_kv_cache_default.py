"""``--kv-cache-dtype auto``: a float32 model whose projections take int8 activations on CPU
keeps its KV cache in float16 (llama.cpp's default, half the bytes, same perplexity); float
activations keep the model dtype (their batch-size dependence would show through a 16-bit
rounding), and a named dtype is always that dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jax_llm_runtime.pallas_kernels.paged_attention import FP8
from jax_llm_runtime.runtime.loading.builder import resolve_kv_cache_dtype

F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU default")
@pytest.mark.parametrize(
    ("name", "model", "operands", "expected"),
    [
        ("auto", F32, "int8", F16),
        ("auto", F32, None, F32),
        ("auto", F32, "bfloat16", F32),
        ("auto", BF16, "int8", BF16),
        ("float32", F32, "int8", F32),
        ("bfloat16", F32, "int8", BF16),
        ("fp8", F32, "int8", FP8),
    ],
)
def test_auto_is_float16_under_int8_activations_only(name, model, operands, expected) -> None:
    assert resolve_kv_cache_dtype(name, model, operands) == expected


def test_the_int8_engine_serves_from_a_float16_cache(smollm2_gguf) -> None:
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    engine = build_engine(
        EngineConfig(
            model_id=str(smollm2_gguf),
            max_num_seqs=2,
            max_model_len=64,
            kvcache_mem_mb=8,
            dtype="float32",
            matmul_dtype="int8",
        )
    )
    assert engine.runner.cache.dtype == F16
