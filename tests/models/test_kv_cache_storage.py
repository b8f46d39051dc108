"""Tiny random models on a bfloat16 or float8 KV cache in integer storage (CPU's, see
``layout.storage_dtype``) against the same cache in float storage, the layout every cache had
before: the stored bits are the same, so every step's logits must be identical, bit for bit,
through the reference attention and the native kernel, for grouped-query attention (Llama) and
multi-head latent attention (DeepSeek V3). The compiled decode step on integer storage converts
and copies nothing of the cache's size (float storage converts the whole cache in every layer)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.models.batch import StepBatch
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


def _whole_cache_converts(model, cache: KVCache, page_indices: np.ndarray) -> list[str]:
    """Instructions of the compiled, donated decode step that convert or copy an array of the
    cache's shape."""
    ones = np.ones(len(page_indices), np.int32)
    zeros = np.zeros((len(page_indices), 1), np.int32)
    batch = StepBatch.padded(zeros, zeros, ones, ones, page_indices)
    step = jax.jit(model.spec.forward, static_argnums=0, donate_argnums=2)
    hlo = step.lower(model.config, model.weights, cache, batch).compile().as_text()
    shape = "[" + ",".join(map(str, cache.k.shape)) + "]"
    return [
        line.strip()
        for line in hlo.splitlines()
        if "=" in line
        and (" convert(" in line or " copy(" in line)
        and shape in line.split("=", 1)[1].split("(", 1)[0]
    ]


@pytest.mark.parametrize("native_kernels", [False, True], ids=["reference", "native"])
def test_decode_step_on_integer_storage_touches_no_whole_cache(tmp_path, native_kernels):
    if native_kernels and not native.available():
        pytest.skip("no C++ compiler built the native kernel here")
    save_random_model(_hf_config("llama"), tmp_path)
    model = load_ours(tmp_path)
    model = dataclasses.replace(
        model, config=dataclasses.replace(model.config, native_kernels=native_kernels)
    )
    runner = PagedRunner(model, 8, 2)
    for dtype in (jnp.bfloat16, FP8):
        stored = KVCache.zeros(runner.cache.k.shape, dtype, runner.cache.v.shape)
        assert _whole_cache_converts(model, stored, runner.page_indices) == []
        # The check can fail: float storage is what XLA:CPU upcasts whole.
        as_float = stored.replace(k=from_stored(stored.k), v=from_stored(stored.v))
        assert _whole_cache_converts(model, as_float, runner.page_indices)
