"""The defaults that make a CPU fast without flags: int8 activations where the native kernels
multiply int8 fastest (x86-64 from AVX2 up, Arm with dotprod; and only there), the model dtype
elsewhere or when asked for. (Four tokens per decode call on CPU by default:
``test_multi_step.py``.)"""

from __future__ import annotations

import dataclasses

import pytest

from jax_llm_runtime.models.families.llama import llama_config_from_hf
from jax_llm_runtime.pallas_kernels import native
from jax_llm_runtime.pallas_kernels.dequant_matmul import native as native_dequant
from jax_llm_runtime.runtime.loading import builder

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
}


@pytest.fixture
def model_config():
    return dataclasses.replace(llama_config_from_hf(TINY), native_kernels=True)


def _cpu(monkeypatch: pytest.MonkeyPatch, isa: str, built: bool = True) -> None:
    monkeypatch.setattr(native, "cpu_isa", lambda: native.Isa(isa, ()))
    monkeypatch.setattr(native_dequant, "available", lambda: built)


@pytest.mark.parametrize(
    ("isa", "int8"),
    [
        ("x86-64-v4+vnni+vbmi", True),
        ("x86-64-v4", True),  # Skylake-X: AVX-512BW maddubs, no VNNI
        ("x86-64-v3+avxvnni", True),
        ("x86-64-v3", True),  # plain AVX2: maddubs pairs beat the float path too
        ("aarch64+dotprod", True),
        ("aarch64", False),  # no integer dot instruction
        ("generic", False),  # scalar
    ],
)
def test_auto_picks_int8_activations_where_int8_dots_win(
    monkeypatch: pytest.MonkeyPatch, model_config, isa: str, int8: bool
) -> None:
    _cpu(monkeypatch, isa)
    assert native.int8_wins() is int8
    assert builder.operand_dtype("auto", model_config) == ("int8" if int8 else None)


def test_auto_keeps_the_model_dtype_without_native_kernels(
    monkeypatch: pytest.MonkeyPatch, model_config
) -> None:
    _cpu(monkeypatch, "x86-64-v4+vnni+vbmi")
    # a mesh or an accelerator: no native kernels
    off = dataclasses.replace(model_config, native_kernels=False)
    assert builder.operand_dtype("auto", off) is None
    # no compiler built them
    _cpu(monkeypatch, "x86-64-v4+vnni+vbmi", built=False)
    assert builder.operand_dtype("auto", model_config) is None


def test_auto_leaves_isq_int8_weights_alone(monkeypatch: pytest.MonkeyPatch, model_config) -> None:
    _cpu(monkeypatch, "x86-64-v4+vnni+vbmi")
    isq_int8 = dataclasses.replace(model_config, quantization="int8")
    assert builder.operand_dtype("auto", isq_int8) is None


def test_explicit_choices_win(monkeypatch: pytest.MonkeyPatch, model_config) -> None:
    _cpu(monkeypatch, "x86-64-v4+vnni+vbmi")
    assert builder.operand_dtype("model", model_config) is None
    assert builder.operand_dtype("bfloat16", model_config) == "bfloat16"
    _cpu(monkeypatch, "aarch64")  # auto would keep the model dtype here
    assert builder.operand_dtype("int8", model_config) == "int8"


def test_the_engine_config_takes_model_and_refuses_others() -> None:
    from jax_llm_runtime.runtime.config import EngineConfig

    assert EngineConfig(model_id="x", matmul_dtype="model").matmul_dtype == "model"
    with pytest.raises(ValueError, match="matmul_dtype"):
        EngineConfig(model_id="x", matmul_dtype="float32")
