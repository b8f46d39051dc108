"""``--num-experts-offload-per-rank``: which routed experts the model keeps in host memory.

The model config gets an ``ExpertOffload`` before its weights load, so the offloaded experts go
from the checkpoint straight to pinned host memory (``models.layers.expert_offload`` says which
ones and how the MoE layer fetches them). A rank is one device of the expert-parallel mesh, or,
without expert parallelism, any device (each holds every expert).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jax_llm_runtime.models.layers.expert_offload import ExpertOffload
from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.parallel.sharding import device_bytes

logger = logging.getLogger(__name__)
FLAG = "--num-experts-offload-per-rank"


def with_expert_offload(model_config: Any, config: EngineConfig) -> Any:
    """``model_config`` with its MoE set to offload ``config.num_experts_offload_per_rank``
    experts per rank; unchanged when that is 0. ValueError when the model has no routed experts
    or a rank would keep none on its device."""
    per_rank = config.num_experts_offload_per_rank
    if per_rank == 0:
        return model_config
    moe = getattr(model_config, "moe", None)
    if moe is None:
        raise ValueError(f"{FLAG} needs a mixture-of-experts model; this one has no routed experts")
    ranks = config.tensor_parallel_size if config.expert_parallel else 1
    offload = ExpertOffload(per_rank, ranks)
    try:
        offload.check(moe.num_experts)
    except ValueError as exc:
        raise ValueError(f"{FLAG} {per_rank}: {exc}") from None
    return dataclasses.replace(model_config, moe=dataclasses.replace(moe, offload=offload))


def log_expert_offload(model_config: Any, weights: Any) -> None:
    """Log what the offload moved off each device (nothing when experts are not offloaded)."""
    moe = getattr(model_config, "moe", None)
    if moe is None or moe.offload is None:
        return
    host = device_bytes(weights, "pinned_host")
    on_device = device_bytes(weights)
    per_rank = moe.num_experts // moe.offload.ranks
    logger.info(
        "expert offload: %d of the %d routed experts per rank in pinned host memory; each "
        "device holds %.1f MB of weights, %.1f MB less than without offload",
        moe.offload.per_rank,
        per_rank,
        max(on_device.values()) / 2**20,
        max(host.values()) / 2**20,
    )
