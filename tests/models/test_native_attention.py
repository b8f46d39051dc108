"""A model step on the native CPU paged-attention kernel: the same greedy tokens as on the
pure-jnp reference (and as HF's), and the builder's choice of when the kernel may run.

A tiny Gemma 2 exercises everything the kernel reads: GQA (4 query heads over 2 KV heads),
soft-capped scores, alternating sliding and global layers, chunked prefill and decode, all on
shuffled pages with garbage in the pages no sequence owns (``harness.PagedRunner``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.pallas_kernels import cpu_choice
from jax_llm_runtime.pallas_kernels.paged_attention import native
from jax_llm_runtime.runtime.loading.builder import with_native_kernels
from tests.models.harness import (
    TINY,
    Loaded,
    PagedRunner,
    greedy_hf,
    greedy_paged,
    load_ours,
    prompts,
    save_random_model,
)


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """This file checks the native kernel's step: no measured verdict of this CPU (an engine
    built earlier in the process sets them) sends a call class to XLA here."""
    monkeypatch.setattr(cpu_choice, "_verdicts", {})


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> tuple[object, Loaded]:
    """HF's tiny random Gemma 2 and ours loaded from it (native kernels off)."""
    import transformers

    folder = tmp_path_factory.mktemp("gemma2")
    hf = transformers.Gemma2Config(
        **{**TINY, "pad_token_id": 0},
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    )
    return save_random_model(hf, folder), load_ours(folder)


def _compiled_decode_step(model: Loaded) -> tuple[str, str]:
    """The optimized HLO of a decode step of ``model`` with the cache donated, as served, and
    the HLO type of the K cache."""
    runner = PagedRunner(model, 8, 2)
    ones = np.ones(2, np.int32)
    batch = StepBatch.padded(np.zeros((2, 1), np.int32), np.zeros((2, 1), np.int32), ones, ones,
                      runner.page_indices)  # fmt: skip
    step = jax.jit(model.spec.forward, static_argnums=0, donate_argnums=2)
    hlo = step.lower(model.config, model.weights, runner.cache, batch).compile().as_text()
    return hlo, "f32[" + ",".join(map(str, runner.cache.k.shape)) + "]"


@pytest.mark.skipif(
    not native.available(),
    reason="no C++ compiler built the native kernel here (it runs wherever one does, CI included)",
)
def test_gemma2_greedy_tokens_equal_the_reference_and_hf(gemma2):
    hf_model, reference_model = gemma2
    native_model = dataclasses.replace(
        reference_model, config=dataclasses.replace(reference_model.config, native_kernels=True)
    )
    # The native step calls the kernel on the whole cache: no copy of it, still updated in place.
    hlo, cache_type = _compiled_decode_step(native_model)
    assert "runtime_paged_attention_" in hlo and "input_output_alias" in hlo
    assert not [line for line in hlo.splitlines() if " copy(" in line and cache_type in line]
    assert "runtime_paged_attention_" not in _compiled_decode_step(reference_model)[0]
    ids = prompts(hf_model.config.vocab_size)
    tokens = greedy_paged(native_model, ids)
    assert tokens == greedy_paged(reference_model, ids)
    assert tokens == [greedy_hf(hf_model, p) for p in ids]
    # Whole prompts in one ragged step: last-position logits agree to float32 rounding.
    logits = PagedRunner(native_model, 32, len(ids)).step(ids)
    expected = PagedRunner(reference_model, 32, len(ids)).step(ids)
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)


def test_builder_allows_native_kernels_on_one_cpu_device_only(gemma2):
    config = gemma2[1].config
    assert not config.native_kernels  # a model config alone keeps the XLA formulations
    on_cpu = jax.default_backend() == "cpu"
    assert with_native_kernels(config, tensor_parallel_size=1).native_kernels is on_cpu
    # Tensor parallelism means XLA's partitioner splits the step, and it would not split a
    # custom call.
    assert with_native_kernels(config, tensor_parallel_size=2).native_kernels is False
