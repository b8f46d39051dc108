"""The real SmolLM2 (Q4_1 projections) on the native CPU dequant-matmul kernel: the same greedy
tokens as with the XLA formulations, and a decode step that reads every layer's projections in
the whole stack (no per-layer copy of the packed codes).

Three chat prompts are prefilled in chunks of 8 tokens (24 rows: the reference's path) and then
decoded together (3 rows per projection: the kernel's), through shuffled pages
(``harness.greedy_paged``).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from models.batch import StepBatch
from pallas_kernels.dequant_matmul import native
from runtime.gguf_loader import load_gguf_checkpoint
from runtime.tokenizer import Tokenizer
from tests.models.harness import Loaded, PagedRunner, greedy_paged, load_checkpoint

pytestmark = pytest.mark.slow

PROMPTS = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nList three prime numbers.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf) -> Loaded:
    """SmolLM2 with its projections packed, native kernels off."""
    return load_checkpoint(load_gguf_checkpoint(smollm2_gguf))


def _decode_hlo(model: Loaded) -> str:
    runner = PagedRunner(model, 16, 2)
    ones = np.ones(2, np.int32)
    batch = StepBatch(np.zeros((2, 1), np.int32), np.zeros((2, 1), np.int32), ones, ones,
                      runner.page_indices)  # fmt: skip
    step = jax.jit(model.spec.forward, static_argnums=0, donate_argnums=2)
    return step.lower(model.config, model.weights, runner.cache, batch).compile().as_text()


@pytest.mark.skipif(not native.available(), reason="the native kernel could not be built here")
def test_greedy_tokens_equal_the_xla_formulation(smollm2, smollm2_gguf):
    on = dataclasses.replace(
        smollm2, config=dataclasses.replace(smollm2.config, native_kernels=True)
    )
    hlo = _decode_hlo(on)
    assert "runtime_dequant_matmul_" in hlo
    assert not re.search(r"= u8\[[^\n]* (dynamic-slice|copy)\(", hlo)
    tokenizer = Tokenizer.from_gguf(smollm2_gguf)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert greedy_paged(on, ids) == greedy_paged(smollm2, ids)
