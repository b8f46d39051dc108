"""Routed experts kept in host memory and brought to the device only when a token needs them.

Which experts. The experts split into ``ranks`` equal, contiguous slices: with expert
parallelism rank ``r`` owns experts ``r * P .. (r + 1) * P - 1`` (``P = num_experts // ranks``),
without it there is one rank owning all of them. The last ``per_rank`` experts of each slice are
offloaded. A layer's expert stacks (``e_gate``, ``e_up``, ``e_down``) are cut along the expert
axis into a resident stack of the other experts and an offloaded stack (``e_gate_host``, ...),
both in expert order, so that splitting either over the ranks gives every rank its own experts:

    8 experts, 2 ranks, per_rank 1:  rank 0 owns 0-3, rank 1 owns 4-7
    resident  [0 1 2 | 4 5 6]   offloaded  [3 | 7]

Where they live. The offloaded stacks are placed in the ``pinned_host`` memory of their devices
(``jax.memory.Space.Host``). The MoE layer moves one layer's offloaded stack to device memory
inside the jitted step (``jax.device_put(..., jax.memory.Space.Device)``, which XLA lowers to a
host-to-device copy on GPU and TPU), under a ``lax.cond`` on whether any valid token of the batch
was routed to an offloaded expert, and drops it after the layer. XLA:CPU has no separate device
memory: JAX lowers the transfer to nothing there and the step reads the host buffers in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.pallas_kernels.dequant_matmul import HostPacked

EXPERT_FIELDS = ("e_gate", "e_up", "e_down")
HOST_SUFFIX = "_host"  # ``e_gate_host`` holds the offloaded experts of ``e_gate``


@dataclass(frozen=True)
class ExpertOffload:
    """The last ``per_rank`` experts of each of ``ranks`` contiguous expert slices live in host
    memory (see the module docstring)."""

    per_rank: int
    ranks: int = 1

    def __post_init__(self) -> None:
        if self.per_rank < 1 or self.ranks < 1:
            raise ValueError(
                f"expert offload needs per_rank >= 1 and ranks >= 1, got {self.per_rank} and "
                f"{self.ranks}"
            )

    def check(self, num_experts: int) -> None:
        """Refuse a split that leaves a rank without a resident expert."""
        if num_experts % self.ranks:
            raise ValueError(
                f"the model's {num_experts} routed experts do not divide over {self.ranks} ranks"
            )
        if self.per_rank >= num_experts // self.ranks:
            raise ValueError(
                f"cannot offload {self.per_rank} experts per rank: each of the {self.ranks} "
                f"rank(s) holds {num_experts // self.ranks} of the {num_experts} routed experts, "
                f"and at least one must stay on the device"
            )

    def stack_sizes(self, num_experts: int) -> tuple[int, int]:
        """Experts in the resident stack and in the offloaded one."""
        offloaded = self.ranks * self.per_rank
        return num_experts - offloaded, offloaded

    def experts(self, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """The expert numbers of the resident stack and of the offloaded stack, in stack order."""
        per_rank = num_experts // self.ranks
        offloaded = np.arange(num_experts) % per_rank >= per_rank - self.per_rank
        return np.flatnonzero(~offloaded), np.flatnonzero(offloaded)

    def locate(
        self,
        experts: jax.Array,  # [num_tokens, top_k] int32 expert numbers
        num_experts: int,
    ) -> tuple[jax.Array, jax.Array]:
        """Per (token, slot): whether its expert is offloaded, and its index in its own stack
        (the resident one or the offloaded one); both ``[num_tokens, top_k]``."""
        per_rank = num_experts // self.ranks
        keep = per_rank - self.per_rank
        rank, local = experts // per_rank, experts % per_rank
        offloaded = local >= keep
        index = jnp.where(offloaded, rank * self.per_rank + local - keep, rank * keep + local)
        return offloaded, index.astype(jnp.int32)


def split_stack(
    offload: ExpertOffload,
    num_experts: int,
    stack: np.ndarray | HostPacked,  # [layers, num_experts, in, out]
) -> tuple[np.ndarray | HostPacked, np.ndarray | HostPacked]:
    """A host expert stack cut into its resident and offloaded stacks (``[layers, n, in, out]``
    each; every array of a packed stack is cut the same way)."""
    resident, offloaded = offload.experts(num_experts)
    if isinstance(stack, HostPacked):
        return stack.map(lambda a: a[:, resident]), stack.map(lambda a: a[:, offloaded])
    return stack[:, resident], stack[:, offloaded]


def to_host_memory(stack: np.ndarray | HostPacked, operand_dtype: str | None) -> Any:
    """A host stack placed in the default device's pinned host memory, never in device memory."""
    if isinstance(stack, HostPacked):
        return stack.to_device(operand_dtype, jax.memory.Space.Host)
    return jax.device_put(stack, jax.memory.Space.Host)


def to_device_memory(tree: Any) -> Any:
    """Inside jit: a copy of host-memory arrays in device memory, keeping their sharding."""
    return jax.device_put(tree, jax.memory.Space.Device)
