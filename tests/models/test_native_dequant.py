"""The real SmolLM2 (Q4_1 projections, a Q8_0 tied embedding) on the native CPU dequant-matmul
kernel: the same greedy tokens as with the XLA formulations (float32 LM head), and a decode step
that reads every layer's projections in the whole stack (no per-layer copy of the packed codes).

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

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.registry import get_model_spec
from jax_llm_runtime.pallas_kernels import cpu_choice
from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedWeight, native
from jax_llm_runtime.runtime.loading.gguf.loader import load_gguf_checkpoint
from jax_llm_runtime.runtime.text.tokenizer import Tokenizer
from tests.models.harness import Loaded, PagedRunner, greedy_paged


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """This file checks the native kernel's step: no measured verdict of this CPU (an engine
    built earlier in the process sets them) sends a call class to XLA here."""
    monkeypatch.setattr(cpu_choice, "_verdicts", {})


pytestmark = pytest.mark.slow

PROMPTS = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nList three prime numbers.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
)


def _load(path, native: bool, operand_dtype: str | None = None) -> Loaded:
    checkpoint = load_gguf_checkpoint(path)
    spec = get_model_spec(checkpoint.config["architectures"][0])
    config = dataclasses.replace(
        spec.config_from_hf(checkpoint.config), native_kernels=native, operand_dtype=operand_dtype
    )
    weights = spec.load(config, checkpoint.tensors(packed=True), np.float32)
    return Loaded(spec, config, weights)


def _decode_hlo(model: Loaded) -> str:
    runner = PagedRunner(model, 16, 2)
    ones = np.ones(2, np.int32)
    batch = StepBatch.padded(np.zeros((2, 1), np.int32), np.zeros((2, 1), np.int32), ones, ones,
                      runner.page_indices)  # fmt: skip
    step = jax.jit(model.spec.forward, static_argnums=0, donate_argnums=2)
    return step.lower(model.config, model.weights, runner.cache, batch).compile().as_text()


@pytest.mark.skipif(
    not native.available(),
    reason="no C++ compiler built the native kernel here (it runs wherever one does, CI included)",
)
def test_greedy_tokens_equal_the_xla_formulation(smollm2_gguf):
    on, off = _load(smollm2_gguf, native=True), _load(smollm2_gguf, native=False)
    # The tied embedding (Q8_0 in the file) is also kept packed as the LM head.
    assert isinstance(on.weights["lm_head"], PackedWeight) and on.weights["lm_head"].bits == 8
    assert "lm_head" not in off.weights
    hlo = _decode_hlo(on)
    assert "runtime_dequant_matmul_" in hlo
    assert not re.search(r"= u8\[[^\n]* (dynamic-slice|copy)\(", hlo)
    tokenizer = Tokenizer.from_gguf(smollm2_gguf)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert greedy_paged(on, ids) == greedy_paged(off, ids)


@pytest.mark.skipif(
    not native.available(),
    reason="no C++ compiler built the native kernel here (it runs wherever one does, CI included)",
)
@pytest.mark.parametrize(
    ("one_row", "large", "kept", "packed_rows"),
    [
        (True, True, True, {1, 3}),
        (True, False, True, {1}),  # lone rows read it packed, batches the float embedding
        (False, True, False, set()),
    ],
)
def test_the_tied_head_takes_the_path_measured_faster_per_row_count(
    smollm2_gguf, monkeypatch: pytest.MonkeyPatch, one_row, large, kept, packed_rows
):
    """The Q8_0 tied embedding is kept packed as the LM head where the kernel won one row; a
    batch reads it packed only where the kernel also won the large class (an AVX2 CPU measured
    the float32 head's dot faster at 16 rows). Both give the float head's logits."""
    monkeypatch.setattr(
        cpu_choice,
        "_verdicts",
        {("dequant_matmul", "one_row"): one_row, ("dequant_matmul", "large"): large},
    )
    model = _load(smollm2_gguf, native=True)
    assert isinstance(model.weights.get("lm_head"), PackedWeight) is kept
    calls, logits, want = _head_calls(model, monkeypatch)
    for got in logits:
        np.testing.assert_allclose(got, want[: len(got)], rtol=1e-4, atol=1e-3)
    assert calls == packed_rows


def _head_calls(
    model: Loaded, monkeypatch: pytest.MonkeyPatch
) -> tuple[set[int], list[np.ndarray], np.ndarray]:
    """The LM head of 1 and then 3 rows of random hidden states: the row counts of the calls
    that read the packed head, each call's logits, and the float embedding's logits."""
    from jax_llm_runtime.models import decoder

    calls = set()
    real = decoder.dequant_matmul
    monkeypatch.setattr(
        decoder, "dequant_matmul", lambda x, *a, **k: calls.add(x.shape[0]) or real(x, *a, **k)
    )
    h = np.random.default_rng(0).standard_normal((3, 576)).astype(np.float32)
    want = h @ np.asarray(model.weights["embed"]).T
    logits = [
        np.asarray(decoder.lm_head(model.config, model.weights, jax.numpy.asarray(h[:rows])))
        for rows in (1, 3)
    ]
    return calls, logits, want


@pytest.mark.skipif(
    not native.available(),
    reason="no C++ compiler built the native kernel here (it runs wherever one does, CI included)",
)
@pytest.mark.parametrize("large_int8", [True, False])
def test_with_int8_activations_the_head_follows_the_int8_verdict(
    smollm2_gguf, monkeypatch: pytest.MonkeyPatch, large_int8
):
    """Under int8 activations the head takes one path for every row count, chosen by the large
    class measured with int8 activations, whatever the float-activation verdict: an AVX2 Zen 4
    timed the float-activation head a tie with the float32 dot at 16 rows (and so read the
    113 MB float head at one row too), where its int8 passes won."""
    verdicts = {"one_row": True, "large": not large_int8, "large_int8": large_int8}
    monkeypatch.setattr(
        cpu_choice, "_verdicts", {("dequant_matmul", c): v for c, v in verdicts.items()}
    )
    model = _load(smollm2_gguf, native=True, operand_dtype="int8")
    assert isinstance(model.weights.get("lm_head"), PackedWeight) is large_int8
    calls, logits, want = _head_calls(model, monkeypatch)
    for got in logits:  # int8 activations round x to 8 bits: within 1% of the logits' range
        assert np.abs(got - want[: len(got)]).max() < 0.01 * np.abs(want).max()
    assert calls == ({1, 3} if large_int8 else set())
