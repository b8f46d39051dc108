"""Kernel selection at startup (``pallas_kernels.selection``): on an accelerator the Pallas
kernels serve only where a check on the device matches the reference, and a kernel that fails
the check leaves the reference serving; the flags force a choice. The checks run here on CPU,
where the Pallas kernels are interpreted; the GPU and TPU paths are exercised by naming the
backend."""

from __future__ import annotations

import logging
import re

import jax.numpy as jnp
import pytest
from gguf import GGMLQuantizationType as T

from jax_llm_runtime.models.families.llama import llama_config_from_hf
from jax_llm_runtime.pallas_kernels import cpu_choice, selection
from jax_llm_runtime.pallas_kernels.dequant_matmul import ops as dequant_ops
from jax_llm_runtime.pallas_kernels.dequant_matmul.gguf_blocks import from_gguf
from jax_llm_runtime.pallas_kernels.paged_attention import kernel as attention_kernel
from jax_llm_runtime.pallas_kernels.paged_attention import ops as attention_ops
from tests.pallas_kernels.test_dequant_matmul import gguf_bytes

CONFIG = llama_config_from_hf(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
)


@pytest.fixture
def weights():
    packed = from_gguf(gguf_bytes(T.Q4_1, 64, 96), T.Q4_1, 96).to_device()
    return {"segments": [{"w_up": packed}], "embed": jnp.zeros((4, 4))}


@pytest.fixture(autouse=True)
def restore(monkeypatch):
    for ops in (attention_ops, dequant_ops):
        monkeypatch.setattr(ops, "KERNEL_BACKENDS", ops.KERNEL_BACKENDS)
    monkeypatch.setattr(cpu_choice, "_verdicts", dict(cpu_choice._verdicts))


def test_the_kernels_match_the_reference_on_the_models_case(weights):
    for kernel in selection.KERNELS:
        ok, why = selection.self_check(kernel, CONFIG, weights, jnp.float32)
        assert ok, (kernel, why)


def test_a_broken_kernel_leaves_the_reference_serving(weights, monkeypatch, caplog):
    real = attention_kernel.paged_attention
    monkeypatch.setattr(attention_kernel, "paged_attention", lambda *a, **k: real(*a, **k) + 1.0)
    with caplog.at_level(logging.WARNING):
        choices = selection.choose_kernels(CONFIG, weights, jnp.float32, {}, backend="gpu")
    assert choices == {"attention": "reference", "dequant_matmul": "pallas"}
    assert "gpu" not in attention_ops.KERNEL_BACKENDS and "gpu" in dequant_ops.KERNEL_BACKENDS
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line.startswith("attention: the Pallas kernel is not used (differs from the reference")


def test_a_kernel_that_raises_or_a_model_without_packed_weights_falls_back(monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("Mosaic lowering failed\nmore lines")

    monkeypatch.setattr(attention_kernel, "paged_attention", fails)
    ok, why = selection.self_check("attention", CONFIG, {}, jnp.float32)
    assert not ok and why == "RuntimeError: Mosaic lowering failed"
    ok, why = selection.self_check("dequant_matmul", CONFIG, {"embed": jnp.zeros(3)}, jnp.float32)
    assert not ok and why == "the model has no packed weights"


def test_flags_force_a_choice(weights, monkeypatch):
    monkeypatch.setattr(selection, "self_check", lambda *a: pytest.fail("forced: no check"))
    forced = {"attention": "pallas", "dequant_matmul": "reference"}
    assert selection.choose_kernels(CONFIG, weights, jnp.float32, forced, backend="tpu") == forced
    assert "tpu" in attention_ops.KERNEL_BACKENDS and "tpu" not in dequant_ops.KERNEL_BACKENDS


def test_on_cpu_reference_turns_the_native_kernel_off_and_pallas_is_refused(weights):
    forced = {"dequant_matmul": "reference"}
    choices = selection.choose_kernels(CONFIG, weights, jnp.float32, forced, backend="cpu")
    assert choices["dequant_matmul"] == "reference"
    classes = ("one_row", "rows", "large", "large_int8", "int8")
    assert not any(cpu_choice.native_wins("dequant_matmul", c) for c in classes)
    # int8 activations too: the reference rounds x as the kernel would and multiplies in XLA.
    w = weights["segments"][0]["w_up"]
    assert dequant_ops.implementation("auto", jnp.ones((3, 96)), w, True, True) == "reference"
    assert cpu_choice.native_wins("paged_attention", "decode")
    with pytest.raises(ValueError, match="--attention-backend pallas runs on GPU and TPU"):
        selection.choose_kernels(CONFIG, weights, jnp.float32, {"attention": "pallas"}, "cpu")


def test_on_tpu_attention_is_checked_on_the_ragged_tpu_kernel(weights, monkeypatch):
    # The TPU check runs the ragged kernel (interpreted here) on the model's heads; once it
    # passes, "auto" on TPU takes the ragged kernel for every step layout.
    calls = []
    real = selection.tpu_check.check_tpu_kernel

    def interpreted(served, buckets):
        calls.append((served.num_heads, served.cache_shape[3:]))
        return real(served, buckets, interpret=True)

    monkeypatch.setattr(selection.tpu_check, "check_tpu_kernel", interpreted)
    ok, why = selection.self_check("attention", CONFIG, weights, jnp.float32, backend="tpu")
    assert ok, why
    assert calls == [(4, (2, 16))]


def test_a_kernel_slower_than_the_reference_is_not_taken(weights, monkeypatch, caplog):
    # Timed for real on this process's device (here the CPU, where the attention kernel only
    # interprets and loses by far), on a small decode case.
    monkeypatch.setattr(selection, "SPEED_SEQS", 2)
    monkeypatch.setattr(selection, "SPEED_CONTEXT", 64)
    fast, why = selection.speed_check("attention", CONFIG, weights, jnp.float32, backend="cpu")
    assert not fast and why.startswith("slower than the reference: "), why
    fast, why = selection.speed_check("dequant_matmul", CONFIG, weights, jnp.float32, "cpu")
    assert re.fullmatch(
        r"(slower than the reference: )?[\d.]+ ms against the reference's "
        r"[\d.]+ ms",
        why,
    ) and fast == (not why.startswith("slower")), why
    # Another backend than the one JAX runs on cannot be timed: the check passes untimed.
    assert selection.speed_check("attention", CONFIG, weights, jnp.float32, "gpu") == (
        True,
        "not timed",
    )
    # At startup a kernel that agrees but loses leaves the reference serving, with its times.
    slow = (False, "slower than the reference: 2.000 ms against the reference's 1.000 ms")
    monkeypatch.setattr(
        selection, "speed_check", lambda kernel, *a: slow if kernel == "attention" else (True, "")
    )
    with caplog.at_level(logging.WARNING):
        choices = selection.choose_kernels(CONFIG, weights, jnp.float32, {}, backend="gpu")
    assert choices == {"attention": "reference", "dequant_matmul": "pallas"}
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "attention: the Pallas kernel is not used (slower than the reference: 2.000" in line
