"""The MoE layer against the HF sparse-MoE blocks it covers, on tiny seeded random weights.

Each case builds one HF block (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2, DeepSeek-V3) from a
tiny config, re-initialises every parameter so the router is far from uniform, converts the
in-memory parameters into our weight mapping and compares outputs on a [3, 5, hidden] input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.models.layers.moe import (
    MoEConfig,
    experts_gathered,
    experts_grouped,
    filled,
    moe_mlp,
    moe_weight_shapes,
    route,
)

torch = pytest.importorskip("torch")

HIDDEN = 32
# Shared by every case: 8 experts, 2 chosen per token, expert width 16.
TINY_MOE = dict(
    hidden_size=HIDDEN, num_experts_per_tok=2, hidden_act="silu", experts_implementation="eager"
)
NUM_EXPERTS = 8
EXPERT_INTER = 16
ATOL = 1e-5


def _mixtral() -> tuple[Any, MoEConfig]:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf = MixtralConfig(**TINY_MOE, num_local_experts=NUM_EXPERTS, intermediate_size=EXPERT_INTER)
    cfg = MoEConfig(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        expert_intermediate_size=hf.intermediate_size,
        norm_topk_prob=True,  # Mixtral always renormalises
    )
    return MixtralSparseMoeBlock(hf), cfg


def _qwen2_moe(norm_topk_prob: bool) -> Callable[[], tuple[Any, MoEConfig]]:
    def build() -> tuple[Any, MoEConfig]:
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        hf = Qwen2MoeConfig(
            **TINY_MOE,
            num_experts=NUM_EXPERTS,
            moe_intermediate_size=EXPERT_INTER,
            shared_expert_intermediate_size=24,
            norm_topk_prob=norm_topk_prob,
        )
        cfg = MoEConfig(
            num_experts=hf.num_experts,
            top_k=hf.num_experts_per_tok,
            expert_intermediate_size=hf.moe_intermediate_size,
            norm_topk_prob=hf.norm_topk_prob,
            shared_intermediate_size=hf.shared_expert_intermediate_size,
            shared_gate=True,
        )
        return Qwen2MoeSparseMoeBlock(hf), cfg

    return build


def _qwen3_moe() -> tuple[Any, MoEConfig]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf = Qwen3MoeConfig(
        **TINY_MOE,
        num_experts=NUM_EXPERTS,
        moe_intermediate_size=EXPERT_INTER,
        norm_topk_prob=True,
    )
    cfg = MoEConfig(
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        expert_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=hf.norm_topk_prob,
    )
    return Qwen3MoeSparseMoeBlock(hf), cfg


def _deepseek_v2(topk_method: str) -> Callable[[], tuple[Any, MoEConfig]]:
    def build() -> tuple[Any, MoEConfig]:
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

        grouped = topk_method == "group_limited_greedy"
        hf = DeepseekV2Config(
            **TINY_MOE,
            n_routed_experts=NUM_EXPERTS,
            moe_intermediate_size=EXPERT_INTER,
            n_shared_experts=2,
            routed_scaling_factor=1.5,
            topk_method=topk_method,
            # One kept group of four: ranking groups by their best expert only bites when the
            # runner-up expert can lie outside the kept groups.
            n_group=2 if grouped else None,
            topk_group=1 if grouped else None,
        )
        cfg = MoEConfig(
            num_experts=hf.n_routed_experts,
            top_k=hf.num_experts_per_tok,
            expert_intermediate_size=hf.moe_intermediate_size,
            routed_scaling_factor=hf.routed_scaling_factor,
            # transformers' V2 router ranks groups by their best expert and never renormalises.
            num_groups=hf.n_group if grouped else None,
            topk_groups=hf.topk_group if grouped else None,
            group_score_topn=1,
            shared_intermediate_size=hf.moe_intermediate_size * hf.n_shared_experts,
        )
        return DeepseekV2Moe(hf), cfg

    return build


def _deepseek_v3() -> tuple[Any, MoEConfig]:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf = DeepseekV3Config(
        **TINY_MOE,
        n_routed_experts=NUM_EXPERTS,
        moe_intermediate_size=EXPERT_INTER,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
    )
    cfg = MoEConfig(
        num_experts=hf.n_routed_experts,
        top_k=hf.num_experts_per_tok,
        expert_intermediate_size=hf.moe_intermediate_size,
        scoring="sigmoid",
        norm_topk_prob=hf.norm_topk_prob,
        routed_scaling_factor=hf.routed_scaling_factor,
        num_groups=hf.n_group,
        topk_groups=hf.topk_group,
        group_score_topn=2,
        has_router_bias=True,
        shared_intermediate_size=hf.moe_intermediate_size * hf.n_shared_experts,
    )
    return DeepseekV3MoE(hf), cfg


CASES: dict[str, Callable[[], tuple[Any, MoEConfig]]] = {
    "mixtral": _mixtral,
    "qwen2_moe_norm": _qwen2_moe(norm_topk_prob=True),
    "qwen2_moe_no_norm": _qwen2_moe(norm_topk_prob=False),
    "qwen3_moe": _qwen3_moe,
    "deepseek_v2_greedy": _deepseek_v2("greedy"),
    "deepseek_v2_group_limited": _deepseek_v2("group_limited_greedy"),
    "deepseek_v3": _deepseek_v3,
}


def build_case(name: str, seed: int = 0) -> tuple[Any, MoEConfig, dict[str, np.ndarray]]:
    """The HF block with seeded random float32 parameters, our config and our weight mapping."""
    torch.manual_seed(seed)
    block, cfg = CASES[name]()
    block = block.float().eval()
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
        for buf_name, buf in block.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.2)
    return block, cfg, weights_from_hf(block)


def weights_from_hf(block: Any) -> dict[str, np.ndarray]:
    """transformers 5 keeps experts fused in memory: ``gate_up_proj`` [E, 2*inter, hidden] (gate
    rows first) and ``down_proj`` [E, hidden, inter]; plain linears are [out, in]."""
    sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    gate_up = sd.pop("experts.gate_up_proj")
    inter = gate_up.shape[1] // 2
    lw = {
        "router": sd.pop("gate.weight").T,
        "e_gate": gate_up[:, :inter].transpose(0, 2, 1),
        "e_up": gate_up[:, inter:].transpose(0, 2, 1),
        "e_down": sd.pop("experts.down_proj").transpose(0, 2, 1),
    }
    if "gate.e_score_correction_bias" in sd:
        lw["router_bias"] = sd.pop("gate.e_score_correction_bias")
    for prefix in ("shared_expert.", "shared_experts."):
        if prefix + "gate_proj.weight" in sd:
            for ours, theirs in (
                ("s_gate", "gate_proj"),
                ("s_up", "up_proj"),
                ("s_down", "down_proj"),
            ):
                lw[ours] = sd.pop(f"{prefix}{theirs}.weight").T
    if "shared_expert_gate.weight" in sd:
        lw["s_router"] = sd.pop("shared_expert_gate.weight").T
    assert not sd, f"unconverted HF parameters: {sorted(sd)}"
    return lw


def random_input(seed: int = 1, shape: tuple[int, ...] = (3, 5, HIDDEN)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_hf(name):
    block, cfg, lw = build_case(name)
    assert {k: v.shape for k, v in lw.items()} == moe_weight_shapes(cfg, HIDDEN)
    x = random_input()
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy()
    got = np.asarray(jax.jit(moe_mlp, static_argnums=0)(cfg, jnp.asarray(x), lw))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    # Guard against a test that passes vacuously: outputs must be well away from zero.
    assert np.abs(want).max() > 0.1


@pytest.mark.parametrize("name", sorted(CASES))
def test_single_token_matches_batch(name):
    """A lone token (gathered-weights path) equals itself inside a batch (grouped-matmul path)."""
    _, cfg, lw = build_case(name)
    x = jnp.asarray(random_input())
    assert x.shape[0] * x.shape[1] * cfg.top_k > cfg.num_experts  # the batch takes the other path
    batch = moe_mlp(cfg, x, lw)
    for s, t in ((0, 0), (1, 2), (2, 4)):
        alone = moe_mlp(cfg, x[s : s + 1, t : t + 1], lw)
        np.testing.assert_allclose(alone[0, 0], batch[s, t], atol=1e-6, rtol=0)


def test_both_expert_mechanisms_agree():
    _, cfg, lw = build_case("deepseek_v3")
    x = jnp.asarray(random_input(shape=(40, HIDDEN)))
    experts, _ = route(cfg, x, lw["router"], lw["router_bias"])
    layer = filled(cfg, HIDDEN, lw)
    args = (x, experts, layer.e_gate, layer.e_up, layer.e_down)
    np.testing.assert_allclose(experts_gathered(*args), experts_grouped(*args), atol=1e-6, rtol=0)


def test_runs_inside_a_scan_over_layers():
    _, cfg, lw0 = build_case("qwen2_moe_norm", seed=0)
    _, _, lw1 = build_case("qwen2_moe_norm", seed=1)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), lw0, lw1)
    x = jnp.asarray(random_input())

    def body(h, lw):
        return h + moe_mlp(cfg, h, lw), None

    got, _ = jax.jit(lambda h, w: jax.lax.scan(body, h, w))(x, stacked)
    want = x + moe_mlp(cfg, x, lw0)
    want = want + moe_mlp(cfg, want, lw1)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def _chosen_sets(cfg: MoEConfig, x: jax.Array, lw: dict, bias: Any) -> list[frozenset[int]]:
    experts, _ = route(cfg, x, lw["router"], bias)
    return [frozenset(row) for row in np.asarray(experts).tolist()]


@pytest.mark.parametrize("name", ["deepseek_v2_group_limited", "deepseek_v3"])
def test_groups_change_the_choice(name):
    """The grouped cases would pass without grouping unless it alters some choices."""
    _, cfg, lw = build_case(name)
    x = jnp.asarray(random_input().reshape(-1, HIDDEN))
    bias = lw.get("router_bias")
    ungrouped = dataclasses.replace(cfg, num_groups=None, topk_groups=None)
    assert _chosen_sets(cfg, x, lw, bias) != _chosen_sets(ungrouped, x, lw, bias)


def test_correction_bias_changes_the_choice():
    _, cfg, lw = build_case("deepseek_v3")
    x = jnp.asarray(random_input().reshape(-1, HIDDEN))
    assert _chosen_sets(cfg, x, lw, lw["router_bias"]) != _chosen_sets(cfg, x, lw, None)


def test_weights_are_checked_at_trace_time():
    _, cfg, lw = build_case("deepseek_v3")
    x = jnp.asarray(random_input())
    missing = {k: v for k, v in lw.items() if k != "router_bias"}
    with pytest.raises(ValueError, match="lack 'router_bias'"):
        moe_mlp(cfg, x, missing)
    transposed = {**lw, "e_down": lw["e_down"].transpose(0, 2, 1)}
    with pytest.raises(ValueError, match="'e_down' has shape"):
        moe_mlp(cfg, x, transposed)


BASE = dict(num_experts=8, top_k=2, expert_intermediate_size=16)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (dict(num_experts=0), "num_experts must be >= 1"),
        (dict(top_k=0), "top_k must be >= 1"),
        (dict(expert_intermediate_size=0), "expert_intermediate_size must be >= 1"),
        (dict(top_k=9), "cannot exceed num_experts"),
        (dict(scoring="relu"), "scoring must be one of"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor must be a positive"),
        (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor must be a positive"),
        (dict(activation="tanh"), "activation must be one of"),
        (dict(shared_intermediate_size=-1), "shared_intermediate_size must be >= 0"),
        (dict(shared_gate=True), "shared_gate needs a shared expert"),
        (dict(num_groups=4), "set num_groups and topk_groups together"),
        (dict(topk_groups=2), "set num_groups and topk_groups together"),
        (dict(num_groups=3, topk_groups=1), "must be >= 1 and divide"),
        (dict(num_groups=4, topk_groups=5), r"topk_groups \(5\) must be in"),
        (dict(num_groups=4, topk_groups=0), r"topk_groups \(0\) must be in"),
        (dict(num_groups=4, topk_groups=2, group_score_topn=3), "group_score_topn"),
        (dict(num_groups=4, topk_groups=1, top_k=3), "exceeds the 2 experts"),
    ],
)
def test_config_validation(override, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**BASE, **override})
