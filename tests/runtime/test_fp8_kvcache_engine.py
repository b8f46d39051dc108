"""``kv_cache_dtype="fp8"`` through the whole engine on a tiny random Llama: the builder sizes
and allocates an e4m3 cache with row scales, and greedy decoding through it follows the float
cache's tokens with log-probabilities close to its own. On CPU a bfloat16 or float8 cache is
stored as integers of the same width (``storage_dtype``); ``KVCache.dtype`` stays the float one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels.paged_attention import (
    FP8,
    KVCache,
    from_stored,
    storage_dtype,
)
from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.engine.model_runner import _fill_pages
from jax_llm_runtime.runtime.engine.request import SamplingParams
from tests.models.harness import TINY, save_random_model
from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog"]
NEW_TOKENS = 12
# Weights 5x HF's default spread: a random model at the default has near-tied logits, so any
# perturbation flips its greedy choices; at 0.1 its choices have margins to compare against.
INIT_RANGE = 0.1


def _generate(engine, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and each one's log-probability, per prompt, all requests at once."""
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)

    async def one(i: int, text: str) -> tuple[list[int], list[float]]:
        tokens, logprobs = [], []
        async for delta in engine.generate(engine.tokenizer.encode(text), sampling, f"r{i}"):
            tokens += delta.token_ids
            logprobs += [lp.logprob for lp in delta.logprobs]
        return tokens, logprobs

    async def run_all():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(run_all())


def _run(folder: Path, kv_cache_dtype: str):
    from jax_llm_runtime.runtime.loading.builder import build_engine

    config = EngineConfig(
        model_id=str(folder),
        max_num_seqs=2,
        max_model_len=64,
        kvcache_mem_mb=1,
        prefill_chunk_size=16,
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        precompile="none",
    )
    engine = build_engine(config)
    engine.start()
    try:
        return engine.runner.cache, _generate(engine, PROMPTS)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("tiny_llama")
    hf = {**TINY, "vocab_size": VOCAB_SIZE, "pad_token_id": 0, "bos_token_id": 256}
    config = transformers.LlamaConfig(**hf, eos_token_id=None, initializer_range=INIT_RANGE)
    save_random_model(config, folder)
    save_byte_tokenizer(folder)
    return folder


@pytest.mark.slow
def test_fp8_engine_decodes_close_to_float(tiny_llama: Path) -> None:
    float_cache, ref = _run(tiny_llama, "auto")
    fp8_cache, got = _run(tiny_llama, "fp8")
    assert float_cache.k.dtype == jnp.float32 and float_cache.k_scales is None
    assert fp8_cache.dtype == FP8 and fp8_cache.k.dtype == storage_dtype(FP8)
    assert fp8_cache.k_scales.shape == fp8_cache.v_scales.shape == fp8_cache.k.shape[:4]
    # The same 1 MB holds 64 / (16 + 4) = 3.2x the pages: the scales are counted.
    pages_float, pages_fp8 = float_cache.k.shape[1], fp8_cache.k.shape[1]
    assert pages_fp8 == pytest.approx(pages_float * 64 / 20, abs=1)
    for (ref_tokens, ref_lp), (tokens, lp) in zip(ref, got, strict=True):
        assert len(tokens) == NEW_TOKENS
        agree = np.mean(np.asarray(tokens) == np.asarray(ref_tokens))
        assert agree >= 0.75, (tokens, ref_tokens)
        # Where the histories still agree the logprobs are of the same token after the same
        # context; e4m3's ~2^-4 rounding moves them by at most ~0.06 here (measured).
        same = np.cumprod(np.asarray(tokens) == np.asarray(ref_tokens)).astype(bool)
        np.testing.assert_allclose(np.asarray(lp)[same], np.asarray(ref_lp)[same], atol=0.15)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "atol"), [("float16", 2e-3), ("bfloat16", 2e-2)])
def test_a_16_bit_cache_decodes_the_float_tokens(tiny_llama: Path, name: str, atol: float) -> None:
    """``--kv-cache-dtype float16|bfloat16`` on a float32 model: the cache has that dtype and
    twice float32's pages in the same memory, and greedy decoding follows the float32 cache."""
    float_cache, ref = _run(tiny_llama, "float32")
    cache, got = _run(tiny_llama, name)
    assert float_cache.k.dtype == jnp.float32
    assert cache.dtype == jnp.dtype(name) and cache.k_scales is None
    assert cache.k.dtype == storage_dtype(jnp.dtype(name))
    assert cache.k.shape[1] == 2 * float_cache.k.shape[1]
    for (ref_tokens, ref_lp), (tokens, lp) in zip(ref, got, strict=True):
        assert tokens == ref_tokens
        np.testing.assert_allclose(lp, ref_lp, atol=atol)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bfloat16", "float8"])
def test_debug_fill_puts_nan_in_a_cache_of_any_storage(dtype) -> None:
    """``--debug-fill-freed-pages`` writes NaN's bits into integer storage, not NaN cast to an
    integer (0), so a read of a stale row still shows."""
    cache = KVCache.zeros((2, 5, 4, 2, 8), dtype)
    pages = np.array([1, 3], np.int32)
    filled = _fill_pages(cache, pages)
    for leaf in (filled.k, filled.v) + ((filled.k_scales,) if dtype == FP8 else ()):
        assert np.isnan(np.asarray(from_stored(leaf[:, pages]), np.float32)).all()
        assert not np.asarray(from_stored(leaf[:, [0, 2, 4]]), np.float32).any()


def test_bad_kv_cache_dtype_is_one_line_error() -> None:
    with pytest.raises(
        ValueError,
        match="kv_cache_dtype must be one of auto, float32, float16, bfloat16, fp8, fp8_e4m3, "
        "got 'int4'",
    ):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
