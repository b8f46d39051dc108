"""Mixture-of-experts architectures against HF transformers on tiny random models (see
harness.py): Mixtral, Qwen2-MoE (shared expert with a gate), Qwen3-MoE, and DeepSeek V2/V3
(multi-head latent attention over the compressed cache, grouped routing, dense first layers).
"""

from __future__ import annotations

import pytest

from tests.models.harness import TINY, check_against_hf

MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


def _config(name: str, **fields):
    import transformers

    config = getattr(transformers, name)(**{**TINY, "pad_token_id": 0, **fields})
    # HF's grouped-matmul expert kernels need extras; the per-expert loop is the plain reference.
    config._experts_implementation = "eager"
    return config


def test_mixtral(tmp_path):
    model = check_against_hf(_config("MixtralConfig", num_local_experts=4), tmp_path)
    assert model.config.moe.num_experts == 4


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe(tmp_path, norm_topk_prob):
    hf = _config(
        "Qwen2MoeConfig",
        num_experts=8,
        shared_expert_intermediate_size=48,
        norm_topk_prob=norm_topk_prob,
        **MOE,
    )
    model = check_against_hf(hf, tmp_path)
    assert model.config.moe.shared_gate


def test_qwen3_moe_with_dense_first_layer(tmp_path):
    hf = _config("Qwen3MoeConfig", num_experts=8, mlp_only_layers=[0], head_dim=32, **MOE)
    model = check_against_hf(hf, tmp_path)
    assert model.config.segments == ((0, 1, False), (1, 2, True))


def test_interleaved_moe_layers_are_refused():
    from jax_llm_runtime.models.registry import get_model_spec

    hf = {**TINY, "num_experts": 4, **MOE, "mlp_only_layers": [1]}
    with pytest.raises(ValueError, match="interleaved"):
        get_model_spec("Qwen3MoeForCausalLM").config_from_hf(hf)


_MLA = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    **MOE,
)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_deepseek_v3(tmp_path, q_lora_rank):
    hf = _config("DeepseekV3Config", q_lora_rank=q_lora_rank, n_group=4, topk_group=2, **_MLA)
    model = check_against_hf(hf, tmp_path)
    assert model.config.segments == ((0, 1, False), (1, 3, True))
    assert model.config.cache_shapes(5, 4) == ((3, 5, 4, 1, 24), (3, 5, 4, 1, 0))


def test_deepseek_v3_yarn(tmp_path):
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    }
    hf = _config(
        "DeepseekV3Config",
        q_lora_rank=24,
        n_group=2,
        topk_group=1,
        rope_parameters=rope,
        **_MLA,
    )
    check_against_hf(hf, tmp_path)


def test_deepseek_v2(tmp_path):
    hf = _config(
        "DeepseekV2Config",
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        **_MLA,
    )
    model = check_against_hf(hf, tmp_path)
    assert model.config.moe.scoring == "softmax"
