"""Tiny random models decoding through a float8 KV cache against the same model on a float one.

Both runs see the same tokens (the float run's greedy choices, fed to both), so every step's
logits can be compared; decoding reads back every prompt row from the float8 cache. The float8
cache is NaN everywhere nobody writes (values and scales); the float one holds random garbage
there (see harness.py). Covered: grouped-query attention (Llama) and multi-head latent attention
(DeepSeek V3, one scaled latent row per token).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels.paged_attention import FP8, KVCache, kv_scale_shape
from tests.models.harness import (
    NEW_TOKENS,
    TINY,
    PagedRunner,
    load_ours,
    prompts,
    save_random_model,
)


def _nan_fp8_cache(float_cache: KVCache) -> KVCache:
    k_shape, v_shape = float_cache.k.shape, float_cache.v.shape
    empty_v = v_shape[-1] == 0
    return KVCache(
        k=jnp.full(k_shape, jnp.nan, FP8),
        v=jnp.full(v_shape, jnp.nan, FP8),
        k_scales=jnp.full(kv_scale_shape(k_shape), jnp.nan),
        v_scales=None if empty_v else jnp.full(kv_scale_shape(v_shape), jnp.nan),
    )


def _logits_side_by_side(model, ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """[1 + NEW_TOKENS, num_seqs, vocab] logits of the float and the float8 run: the whole
    prompts in one step, then one token per sequence per step (two compiled shapes each)."""
    max_len = max(map(len, ids)) + NEW_TOKENS
    ref = PagedRunner(model, max_len, len(ids), seed=1)
    fp8 = PagedRunner(model, max_len, len(ids), seed=1)  # same page tables
    fp8.cache = _nan_fp8_cache(ref.cache)
    got_ref, got_fp8 = [ref.step(ids)], [fp8.step(ids)]
    for _ in range(NEW_TOKENS):
        last = [[t] for t in got_ref[-1].argmax(-1).tolist()]
        got_ref.append(ref.step(last)), got_fp8.append(fp8.step(last))
    return np.stack(got_ref), np.stack(got_fp8)


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
        first_k_dense_replace=TINY["num_hidden_layers"],  # dense layers only: MLA is the point
    )


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_fp8_cache_logits_close_to_float_cache(tmp_path, name):
    save_random_model(_hf_config(name), tmp_path)
    model = load_ours(tmp_path)
    ref, fp8 = _logits_side_by_side(model, prompts(TINY["vocab_size"]))
    assert np.isfinite(fp8).all(), "NaN in unwritten slots or scales reached the logits"
    # e4m3 rounds each K/V element by up to 2^-4 of itself (~2.6% rms); through two layers of a
    # random model that moves the logits by a few percent of their spread. Measured: at most
    # ~1% mean and ~6% worst (Llama; MLA about half), so 3x headroom on the mean and 2.5x on the
    # worst case.
    spread = ref.std()
    err = np.abs(fp8 - ref) / spread
    assert err.mean() < 0.03 and err.max() < 0.15, (err.mean(), err.max())
    agree = (fp8.argmax(-1) == ref.argmax(-1)).mean()
    assert agree >= 0.9, agree
