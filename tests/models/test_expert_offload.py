"""Experts in host memory (``models.layers.expert_offload``): the MoE layer gives what it gives
with every expert on the device, fetches the offloaded stack only when a valid token needs it,
and the fetch is a host-to-device placement inside that branch when lowered for a GPU."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.models.isq import packer
from jax_llm_runtime.models.layers.expert_offload import (
    EXPERT_FIELDS,
    HOST_SUFFIX,
    ExpertOffload,
    split_stack,
    to_host_memory,
)
from jax_llm_runtime.models.layers.moe import MoEConfig, moe_mlp
from jax_llm_runtime.pallas_kernels.dequant_matmul import HostPacked
from tests.models.test_moe import HIDDEN, build_case, random_input

NUM_EXPERTS = 8


def offloaded(
    cfg: MoEConfig, lw: dict[str, Any], offload: ExpertOffload, pack: bool = False
) -> tuple[MoEConfig, dict[str, Any], dict[str, Any]]:
    """(the offloading config, its layer weights, the same weights all on the device); with
    ``pack``, expert stacks that q8_0 fits are packed in both."""
    split, whole = dict(lw), dict(lw)
    for name in EXPERT_FIELDS:
        stack = np.asarray(lw[name])[None]  # one layer: [1, experts, in, out]
        if pack:
            stack = packer("q8_0")(stack)
        resident, host = split_stack(offload, cfg.num_experts, stack)
        layer = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
        split[name] = layer(_on_device(resident))
        split[name + HOST_SUFFIX] = layer(to_host_memory(host, None))
        whole[name] = layer(_on_device(stack))
    return dataclasses.replace(cfg, offload=offload), split, whole


def _on_device(stack: Any) -> Any:
    return stack.to_device() if isinstance(stack, HostPacked) else jnp.asarray(stack)


def test_which_experts_each_rank_offloads() -> None:
    resident, host = ExpertOffload(per_rank=1, ranks=2).experts(NUM_EXPERTS)
    assert resident.tolist() == [0, 1, 2, 4, 5, 6] and host.tolist() == [3, 7]
    resident, host = ExpertOffload(per_rank=4).experts(NUM_EXPERTS)
    assert resident.tolist() == [0, 1, 2, 3] and host.tolist() == [4, 5, 6, 7]
    offloaded_, index = ExpertOffload(per_rank=1, ranks=2).locate(jnp.arange(8), NUM_EXPERTS)
    assert offloaded_.tolist() == [False, False, False, True, False, False, False, True]
    assert index.tolist() == [0, 1, 2, 0, 3, 4, 5, 1]


@pytest.mark.parametrize(
    ("per_rank", "ranks", "pack"),
    [(4, 1, False), (7, 1, False), (2, 2, False), (1, 4, False), (2, 2, True)],
)
@pytest.mark.parametrize("shape", [(1, 3), (3, 5)], ids=["gathered", "grouped"])
def test_offloaded_experts_give_the_same_output(
    per_rank: int, ranks: int, shape: tuple[int, int], pack: bool
) -> None:
    _, cfg, lw = build_case("qwen2_moe_norm")
    cfg_off, split, whole = offloaded(cfg, lw, ExpertOffload(per_rank, ranks), pack)
    for name in EXPERT_FIELDS:
        assert jax.tree.leaves(split[name + HOST_SUFFIX])[0].sharding.memory_kind == "pinned_host"
    x = jnp.asarray(random_input(shape=(*shape, HIDDEN)))
    want = jax.jit(lambda x, w: moe_mlp(cfg, x, w))(x, whole)
    got = jax.jit(lambda x, w: moe_mlp(cfg_off, x, w))(x, split)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_only_valid_tokens_fetch_offloaded_experts() -> None:
    """NaN offloaded weights reach the output exactly when a valid token chose such an expert."""
    _, cfg, lw = build_case("qwen2_moe_norm")
    cfg_off, split, _ = offloaded(cfg, lw, ExpertOffload(per_rank=4))
    for name in EXPERT_FIELDS:
        host = split[name + HOST_SUFFIX]
        split[name + HOST_SUFFIX] = to_host_memory(np.full(host.shape, np.nan, np.float32), None)
    x = jnp.asarray(random_input(shape=(3, 5, HIDDEN)))
    run = jax.jit(lambda x, w, valid: moe_mlp(cfg_off, x, w, valid))
    none = run(x, split, jnp.zeros((3, 5), bool))
    assert np.isfinite(np.asarray(none)).all(), "nothing valid: the offloaded stack is not run"
    every = run(x, split, jnp.ones((3, 5), bool))
    assert not np.isfinite(np.asarray(every)).all(), "some token chose an offloaded expert"


def test_the_fetch_is_a_device_placement_inside_the_branch_on_gpu() -> None:
    """Lowered for CUDA (no GPU needed), the offloaded stacks are pinned-host arguments and each
    is placed on the device inside the conditional, where XLA inserts the copy. (XLA:CPU has no
    separate device memory, so JAX lowers the placement to nothing there.)"""
    _, cfg, lw = build_case("qwen2_moe_norm")
    cfg_off, split, _ = offloaded(cfg, lw, ExpertOffload(per_rank=4))
    x = jnp.asarray(random_input(shape=(1, 3, HIDDEN)))
    traced = jax.jit(lambda x, w: moe_mlp(cfg_off, x, w)).trace(x, split)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('mhlo.memory_kind = "pinned_host"') == len(EXPERT_FIELDS)
    placements = [
        i for i, line in enumerate(text.splitlines()) if "annotate_device_placement" in line
    ]
    assert len(placements) == len(EXPERT_FIELDS)
    assert all('_xla_buffer_placement = "device"' in text.splitlines()[i] for i in placements)
    case = next(i for i, line in enumerate(text.splitlines()) if "stablehlo.case" in line)
    assert min(placements) > case
