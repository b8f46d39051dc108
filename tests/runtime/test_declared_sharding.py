"""Every parameter is declared once with its shape, dtype, logical sharding axes and checkpoint
field, and the mesh placement of the weights derives from those declarations alone.

The placement runs on 4 fake CPU devices in a fresh process (``declared_shardings_run.py``),
since JAX fixes its device count when it starts.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jax_llm_runtime.models.decoder import PACKED_FIELDS, Decoder
from jax_llm_runtime.models.layers.params import params
from tests.runtime.declared_shardings_run import CONFIGS
from tests.runtime.test_tensor_parallel import run_on_four_devices

# The logical axes the mesh splits.
SPLIT = {"vocab", "heads", "kv_heads", "mlp", "linear_heads"}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("quantized", [(), tuple(PACKED_FIELDS)])
def test_every_parameter_declares_its_axes_and_field(name: str, quantized: tuple) -> None:
    model = Decoder(CONFIGS[name], jnp.bfloat16, frozenset(quantized), packed_head=True)
    declared = params(model)
    assert declared
    for path, var in declared:
        value = var.get_value()
        axes = var.get_metadata("out_sharding")
        assert len(axes) == value.ndim, path
        assert value.dtype == jnp.bfloat16, path
        assert isinstance(var.get_metadata("field"), str), path
        if path[0] == "segments":
            assert axes[0] == "layers", path  # stacked layers lead every per-layer weight


@pytest.fixture(scope="module")
def placed() -> dict:
    return run_on_four_devices("declared_shardings_run.py")


def _split_axes(entry: dict) -> list[int]:
    return [i for i, part in enumerate(entry["spec"]) if part == "tp"]


def test_mesh_placement_follows_the_declared_axes(placed: dict) -> None:
    for run, fields in placed.items():
        if run == "renamed":
            continue
        split = SPLIT | ({"experts"} if run.endswith("ep=True") else set())
        for field, entry in fields.items():
            axes, shape = entry["axes"], entry["shape"]
            want = [
                i for i, a in enumerate(axes) if a in split and shape[i] > 1 and shape[i] % 4 == 0
            ]
            assert _split_axes(entry) == want[:1], (run, field, entry)
    llama = placed["llama/ep=False"]
    assert llama["embed"]["spec"] == ["tp", None]  # vocabulary rows
    assert llama["lm_head"]["spec"] == [None, "tp"]  # vocabulary columns
    assert llama["0.wq"]["spec"] == [None, None, "tp"] and llama["0.bq"]["spec"] == [None, "tp"]
    assert llama["0.wo"]["spec"] == [None, "tp", None]  # row-parallel
    assert llama["0.w_down"]["spec"] == [None, "tp", None]
    assert not _split_axes(llama["0.attn_norm"]) and not _split_axes(llama["final_norm"])
    deepseek = placed["deepseek/ep=True"]
    assert deepseek["0.wq_b"]["spec"] == [None, None, "tp"]  # MLA by heads
    assert not _split_axes(deepseek["0.wq_a"]) and not _split_axes(deepseek["0.kv_a_norm"])
    assert deepseek["1.e_gate"]["spec"][:2] == [None, "tp"]  # experts with expert parallelism
    assert not _split_axes(placed["deepseek/ep=False"]["1.e_gate"])
    assert deepseek["1.e_up_host"]["memory_kind"] == "pinned_host"
    assert deepseek["1.e_up_host"]["spec"][:2] == [None, "tp"]
    # Linear attention by heads: input projections and the convolution's channels, the output
    # projection row-parallel; the per-head norm whole.
    for run, inputs in (("qwen3_next", ("la_qkvz", "la_ba")), ("qwen3_5", ("la_q", "la_v"))):
        fields = placed[f"{run}/ep=False"]
        for name in inputs:
            assert fields[f"0.{name}"]["spec"] == [None, None, "tp"], (run, name)
        assert fields["0.la_conv_k"]["spec"] == [None, "tp", None, None], run
        assert fields["0.la_out"]["spec"] == [None, "tp", None], run
        assert not _split_axes(fields["0.la_norm"]), run


def test_changing_a_declaration_moves_the_weight(placed: dict) -> None:
    assert placed["renamed"]["final_norm"]["spec"] == ["tp"]
    assert placed["llama/ep=False"]["final_norm"]["spec"] == [None]


def test_packed_projections_are_quantized_linear_modules(tmp_path) -> None:
    import dataclasses

    import numpy as np
    import transformers

    from jax_llm_runtime.models.layers.linear import Linear, QuantizedLinear
    from jax_llm_runtime.models.registry import model_config_from_hf
    from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedWeight
    from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint
    from tests.models.harness import TINY, save_random_model

    save_random_model(transformers.LlamaConfig(**TINY), tmp_path)
    checkpoint = load_hf_checkpoint(tmp_path)
    spec, config = model_config_from_hf(checkpoint.config)
    config = dataclasses.replace(config, quantization="q4_0")
    weights = spec.load(config, checkpoint.tensors(packed=True), np.float32)
    model = weights.model()
    attn = model.segments[0].layers.attn
    assert isinstance(attn.wq, QuantizedLinear) and isinstance(
        attn.wq.kernel.get_value(), PackedWeight
    )
    assert attn.wq.kernel.get_value().shape == (2, 64, 64)  # the declared [layers, in, out]
    assert type(model.lm_head) is Linear  # the LM head stays float
    assert weights["segments"][0]["wq"] is not None and "lm_head" in weights


EXPERT_AXES = {"e_gate": ("embed", "expert_mlp"), "e_up": ("embed", "expert_mlp")}
EXPERT_AXES["e_down"] = ("expert_mlp", "embed")


@pytest.mark.parametrize("packed", [False, True])
def test_expert_stacks_are_expert_linear_modules(packed: bool) -> None:
    """The routed expert stacks, resident and offloaded, are declared by ``ExpertLinear`` (by
    ``QuantizedExpertLinear`` when packed) as ``[layers, experts, in, out]`` kernels along
    (layers, experts, in, out), under their checkpoint field names."""
    from jax_llm_runtime.models.layers.linear import ExpertLinear, QuantizedExpertLinear

    cfg = CONFIGS["deepseek"]  # 8 experts over 4 ranks, one offloaded per rank
    quantized = PACKED_FIELDS if packed else frozenset()
    moe = Decoder(cfg, jnp.bfloat16, quantized).segments[1].layers.ffn
    kind = QuantizedExpertLinear if packed else ExpertLinear
    for field, axes in EXPERT_AXES.items():
        for suffix, experts, memory_kind in (("", 4, None), ("_host", 4, "pinned_host")):
            stack = getattr(moe, field + suffix)
            assert type(stack) is kind, field + suffix
            kernel = stack.kernel
            assert kernel.get_metadata("field") == field + suffix
            assert kernel.get_metadata("out_sharding") == ("layers", "experts", *axes)
            assert kernel.get_value().shape[:2] == (2, experts)  # MoE layers 1-2
            assert kernel.get_metadata("memory_kind", None) == memory_kind
            assert stack.offloaded == (memory_kind is not None)


def test_packed_expert_stacks_load_into_quantized_expert_linear_modules(tmp_path) -> None:
    import dataclasses

    import numpy as np
    import transformers

    from jax_llm_runtime.models.layers.linear import QuantizedExpertLinear
    from jax_llm_runtime.models.registry import model_config_from_hf
    from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedWeight
    from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint
    from tests.models.harness import TINY, save_random_model

    hf = transformers.Qwen2MoeConfig(
        **TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    save_random_model(hf, tmp_path)
    checkpoint = load_hf_checkpoint(tmp_path)
    spec, config = model_config_from_hf(checkpoint.config)
    config = dataclasses.replace(config, quantization="q4_0")
    weights = spec.load(config, checkpoint.tensors(packed=True), np.float32)
    moe = weights.model().segments[0].layers.ffn
    for field in EXPERT_AXES:
        stack = getattr(moe, field)
        assert isinstance(stack, QuantizedExpertLinear), field
        assert isinstance(stack.kernel.get_value(), PackedWeight), field
        assert stack.kernel.get_value().shape[:2] == (2, 4)  # [layers, experts, in, out]
        assert isinstance(weights["segments"][0][field], PackedWeight), field
