"""GLM-4.5 MoE, GLM-4-MoE-lite and MiniMax-M2 against HF transformers on tiny random models
(see harness.py), and over tensor-parallel sizes on fake devices: partial rotary over rotated
halves (GLM-4.5, MiniMax-M2) or multi-head latent attention (lite), q/k norms per head (GLM-4.5)
or over all heads (MiniMax-M2), dense first layers, sigmoid routing steered by a correction bias
(inside the best expert groups for GLM), routed scaling and a shared expert (GLM).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.models.harness import TINY, check_model, load_ours

MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
GLM4_MOE = dict(
    num_hidden_layers=3,
    head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    attention_bias=True,
    **MOE,
)


def _config(name: str, **fields):
    import transformers

    config = getattr(transformers, name)(**{**TINY, "pad_token_id": 0, **fields})
    # HF's grouped-matmul expert kernels need extras; the per-expert loop is the plain reference.
    config._experts_implementation = "eager"
    return config


def save_with_router_bias(hf_config, folder: Path, seed: int = 0):
    """A seeded random HF model whose correction biases and norm weights are random too (HF
    initialises them to zero and one, which would leave the biases' effect on the choice and
    the norm weights' layout untested); saved as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.05)
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def check_biased(hf_config, folder: Path):
    hf_model = save_with_router_bias(hf_config, folder)
    model = load_ours(folder)
    check_model(model, hf_model)
    return model


@pytest.mark.parametrize(
    "fields",
    [
        dict(use_qk_norm=True, n_group=2, topk_group=1, norm_topk_prob=True),
        dict(use_qk_norm=False, n_group=1, topk_group=1, norm_topk_prob=False),
    ],
    ids=["qk_norm-grouped", "plain-one-group"],
)
def test_glm4_moe(tmp_path, fields):
    model = check_biased(_config("Glm4MoeConfig", **GLM4_MOE, **fields), tmp_path)
    cfg = model.config
    assert cfg.segments == ((0, 1, False), (1, 3, True))
    assert cfg.attention.rope.rotary_dim == 16 and not cfg.attention.rope.interleaved
    assert cfg.moe.has_router_bias and cfg.moe.scoring == "sigmoid"
    assert (cfg.attention.qk_norm is not None) == fields["use_qk_norm"]


def test_glm4_moe_skips_next_token_prediction_layers():
    from jax_llm_runtime.models.families.glm4_moe import without_nextn_layers
    from jax_llm_runtime.models.registry import get_model_spec
    from jax_llm_runtime.models.weights import WeightLoadError

    hf = {**TINY, **GLM4_MOE, "architectures": ["Glm4MoeForCausalLM"]}
    cfg = get_model_spec("Glm4MoeForCausalLM").config_from_hf(hf)
    names = ["model.norm.weight", "model.layers.2.mlp.gate.weight", "model.layers.3.eh_proj.weight"]
    kept = without_nextn_layers(cfg, ((n, np.zeros(1)) for n in names), num_nextn=1)
    assert [name for name, _ in kept] == names[:2]
    with pytest.raises(WeightLoadError, match="names layer 4"):
        list(without_nextn_layers(cfg, [("model.layers.4.eh_proj.weight", None)], num_nextn=1))


_LITE = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    routed_scaling_factor=1.8,
    n_group=2,
    topk_group=1,
    **MOE,
)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_glm4_moe_lite(tmp_path, q_lora_rank):
    kinds = ["dense", "sparse", "sparse"]
    hf = _config("Glm4MoeLiteConfig", q_lora_rank=q_lora_rank, mlp_layer_types=kinds, **_LITE)
    model = check_biased(hf, tmp_path)
    assert model.config.segments == ((0, 1, False), (1, 3, True))
    assert model.config.cache_shapes(5, 4) == ((3, 5, 4, 1, 24), (3, 5, 4, 1, 0))
    assert model.config.attention.rope.interleaved


def test_glm4_moe_lite_gguf_runs_as_deepseek_v3(tmp_path):
    """llama.cpp writes GLM-4-MoE-lite files as ``deepseek2``; they load as DeepSeek V3 (the
    same layers) and run like the lite model they came from. The converter reads
    ``first_k_dense_replace``, which released lite configs carry."""
    from jax_llm_runtime.runtime.loading.gguf.loader import load_gguf_checkpoint
    from tests.models.gguf_writer import write_gguf
    from tests.models.harness import load_checkpoint

    fields = dict(q_lora_rank=24, mlp_layer_types=["dense", "sparse", "sparse"])
    hf = _config("Glm4MoeLiteConfig", first_k_dense_replace=1, **fields, **_LITE)
    hf_model = save_with_router_bias(hf, tmp_path / "hf")
    files = write_gguf(hf_model, hf_model.config, tmp_path / "model.gguf")
    checkpoint = load_gguf_checkpoint(files[0])
    assert checkpoint.config["architectures"] == ["DeepseekV3ForCausalLM"]
    check_model(load_checkpoint(checkpoint), hf_model)


def test_glm4_moe_lite_refusals():
    from jax_llm_runtime.models.registry import get_model_spec

    config_from_hf = get_model_spec("Glm4MoeLiteForCausalLM").config_from_hf
    hf = {**TINY, **_LITE, "q_lora_rank": None, "model_type": "glm4_moe_lite"}
    with pytest.raises(ValueError, match="interleaved"):
        config_from_hf({**hf, "mlp_layer_types": ["dense", "sparse", "dense"]})
    with pytest.raises(ValueError, match="mlp_layer_types must name"):
        config_from_hf({**hf, "mlp_layer_types": ["dense", "sparse"]})
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.5 is not supported"):
        config_from_hf({**hf, "rope_parameters": {"partial_rotary_factor": 0.5}})


MINIMAX_M2 = dict(
    head_dim=32, rotary_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32
)


def test_minimax_m2(tmp_path):
    model = check_biased(_config("MiniMaxM2Config", **MINIMAX_M2), tmp_path)
    cfg = model.config
    assert cfg.segments == ((0, 2, True),)
    assert cfg.attention.qk_norm_all_heads and cfg.attention.rope.rotary_dim == 16
    assert cfg.attention.rope.theta == 5e6


def test_minimax_m2_refuses_settings_transformers_never_reads():
    from jax_llm_runtime.models.registry import get_model_spec

    config_from_hf = get_model_spec("MiniMaxM2ForCausalLM").config_from_hf
    hf = {**TINY, **MINIMAX_M2, "qk_norm_type": "per_layer", "scoring_func": "sigmoid"}
    assert config_from_hf(hf).moe.scoring == "sigmoid"
    with pytest.raises(ValueError, match="scoring_func='softmax' is not supported"):
        config_from_hf({**hf, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="qk_norm_type='per_head' is not supported"):
        config_from_hf({**hf, "qk_norm_type": "per_head"})


def test_gguf_glm4_moe_with_softmax_gating_is_refused(tmp_path):
    from jax_llm_runtime.runtime.loading.gguf.loader import GGUFError, load_gguf_checkpoint
    from tests.models.gguf_writer import write_gguf

    hf = _config("Glm4MoeConfig", **GLM4_MOE, scoring_func="softmax")
    files = write_gguf(save_with_router_bias(hf, tmp_path / "hf"), hf, tmp_path / "m.gguf")
    with pytest.raises(GGUFError, match="expert_gating_func is 1; this architecture routes"):
        load_gguf_checkpoint(files[0])


def save_tp_model(hf_config, folder: Path) -> None:
    """A tiny model for the engine on 4 fake devices (``tests/runtime/test_tensor_parallel``)."""
    from tests.models.tiny_tokenizer import save_byte_tokenizer

    save_with_router_bias(hf_config, folder)
    save_byte_tokenizer(folder)


@pytest.mark.slow
def test_glm4_moe_tensor_and_expert_parallel(tmp_path: Path) -> None:
    import transformers

    from tests.runtime.test_tensor_parallel import BASE, check_split, run_sharded

    shape = dict(num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2, head_dim=16)
    config = transformers.Glm4MoeConfig(
        **{**BASE, **GLM4_MOE, **shape}, use_qk_norm=True, n_group=2, topk_group=1
    )
    save_tp_model(config, tmp_path)
    # Attention, the dense layer's MLP and the shared expert split by heads and columns; the
    # routed experts are split over the devices too (expert parallelism).
    results = run_sharded(tmp_path, "1,2,4", {"expert_parallel": True})
    check_split(results)
    single = results["1"]["expert_bytes"][0]
    for size, result in results.items():
        assert set(result["expert_bytes"]) == {single // int(size)}, "each device: 1/N experts"


@pytest.mark.slow
def test_glm4_moe_lite_tensor_and_expert_parallel(tmp_path: Path) -> None:
    import transformers

    from tests.runtime.test_tensor_parallel import BASE, check_mla_split, run_sharded

    shape = dict(num_hidden_layers=2, mlp_layer_types=["dense", "sparse"], q_lora_rank=32)
    config = transformers.Glm4MoeLiteConfig(**{**BASE, **_LITE, **shape})
    save_tp_model(config, tmp_path)
    # A 35-token prompt takes two chunks, so decode reads latents of earlier steps. The query
    # heads split; the latent cache and the low-rank projections stay whole on every device.
    extra = {"prefill_chunk_size": 32, "expert_parallel": True}
    results = run_sharded(tmp_path, "1,4", extra)
    single = results["1"]
    check_mla_split(single, results, ("wq_b", "wkv_b", "wo"))
    for size, result in results.items():
        assert set(result["expert_bytes"]) == {single["expert_bytes"][0] // int(size)}


@pytest.mark.slow
def test_minimax_m2_tensor_and_expert_parallel(tmp_path: Path) -> None:
    """The q/k norms span all heads while each device holds only its heads' features: the
    norms' weights split with the heads and their means are reduced over the devices."""
    import transformers

    from tests.runtime.test_tensor_parallel import BASE, check_split, run_sharded

    shape = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, rotary_dim=8)
    config = transformers.MiniMaxM2Config(**{**BASE, **MINIMAX_M2, **shape})
    save_tp_model(config, tmp_path)
    results = run_sharded(tmp_path, "1,2,4", {"expert_parallel": True})
    check_split(results)
    norms = results["4"]["field_bytes"]["q_norm"]
    assert norms == [results["1"]["field_bytes"]["q_norm"][0] // 4] * 4
