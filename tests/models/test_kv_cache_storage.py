"""Tiny random models on a bfloat16 or float8 KV cache in integer storage (CPU's, see
``layout.storage_dtype``) against the same cache in float storage, the layout every cache had
before: the stored bits are the same, so every step's logits must be identical, bit for bit,
through the reference attention and the native kernel, for grouped-query attention (Llama) and
multi-head latent attention (DeepSeek V3)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels.paged_attention import FP8, KVCache, from_stored, native
from tests.models.harness import (
    NEW_TOKENS,
    PREFILL_CHUNK,
    TINY,
    PagedRunner,
    load_ours,
    prompts,
    save_random_model,
)

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="integer storage is the CPU backend's"
)


def _hf_config(name: str):
    import transformers

    if name == "llama":
        return transformers.LlamaConfig(**TINY, pad_token_id=0)
    return transformers.DeepseekV3Config(
        **{**TINY, "num_key_value_heads": 4},
        pad_token_id=0,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=TINY["num_hidden_layers"],
    )


def _greedy_logits(model, ids: list[list[int]], cache: KVCache) -> np.ndarray:
    """[steps, num_seqs, vocab] logits of a chunked prefill and greedy decoding from ``cache``."""
    runner = PagedRunner(model, max(map(len, ids)) + NEW_TOKENS, len(ids), seed=1)
    runner.cache = cache
    chunks = range(0, max(map(len, ids)), PREFILL_CHUNK)
    steps = [runner.step([p[s : s + PREFILL_CHUNK] for p in ids]) for s in chunks]
    for _ in range(NEW_TOKENS):
        steps.append(runner.step([[t] for t in steps[-1].argmax(-1).tolist()]))
    return np.stack(steps)


@pytest.mark.parametrize("native_kernels", [False, True], ids=["reference", "native"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bfloat16", "float8"])
@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_integer_storage_gives_the_float_storage_logits(tmp_path, name, dtype, native_kernels):
    if native_kernels and not native.available():
        pytest.skip("no C++ compiler built the native kernel here")
    save_random_model(_hf_config(name), tmp_path)
    model = load_ours(tmp_path)
    model = dataclasses.replace(
        model, config=dataclasses.replace(model.config, native_kernels=native_kernels)
    )
    ids = prompts(TINY["vocab_size"])
    # PagedRunner's own cache sets the shapes: float32 garbage, replaced by zeroed caches here.
    shaped = PagedRunner(model, max(map(len, ids)) + NEW_TOKENS, len(ids), seed=1).cache
    stored = KVCache.zeros(shaped.k.shape, dtype, shaped.v.shape)
    assert stored.k.dtype in (jnp.uint16, jnp.uint8) and stored.dtype == dtype
    as_float = stored.replace(k=from_stored(stored.k), v=from_stored(stored.v))
    got = _greedy_logits(model, ids, stored)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, _greedy_logits(model, ids, as_float))
