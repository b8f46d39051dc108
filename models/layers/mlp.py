"""Feed-forward blocks: gated (SwiGLU/GeGLU) and plain two-layer MLPs; ``MLP`` declares a
layer's weights (``w_gate``, ``w_up``, ``w_down``, and ``b_up``, ``b_down`` with biases)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import jax
import jax.numpy as jnp

from jax_llm_runtime.models.layers.linear import linear, projection
from jax_llm_runtime.models.layers.params import EMBED, FFN, Block

# HF ``hidden_act`` names -> functions. The tanh approximations are distinct from exact GELU.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def check_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)} are)")
    return name


def gated_mlp(
    x: jax.Array,  # [..., hidden]
    gate: jax.Array,  # [hidden, intermediate]
    up: jax.Array,  # [hidden, intermediate]
    down: jax.Array,  # [intermediate, hidden]
    activation: str = "silu",
) -> jax.Array:  # [..., hidden]
    """down(act(gate(x)) * up(x)); SwiGLU with silu."""
    act = ACTIVATIONS[activation]
    return linear(act(linear(x, gate)) * linear(x, up), down)


def dense_mlp(
    x: jax.Array,  # [..., hidden]
    lw: Mapping[
        str, jax.Array
    ],  # w_up [hidden, inter], w_down [inter, hidden], optional b_up/b_down
    activation: str,
    gated: bool,
) -> jax.Array:  # [..., hidden]
    """A layer's MLP: gated (``w_gate`` too) or plain fc1 -> act -> fc2 with optional biases."""
    if gated:
        return gated_mlp(x, lw["w_gate"], lw["w_up"], lw["w_down"], activation)
    act = ACTIVATIONS[activation]
    return linear(act(linear(x, lw["w_up"], lw.get("b_up"))), lw["w_down"], lw.get("b_down"))


class MLP(Block):
    """A layer's (or a stack of ``lead`` layers') MLP: the gate and up projections split by
    intermediate features, the down projection along its input (partial sums all-reduced)."""

    def __init__(
        self,
        lead: Sequence[int],
        hidden: int,
        intermediate: int,
        dtype: jnp.dtype,
        activation: str = "silu",
        gated: bool = True,
        bias: bool = False,
        quantized: Collection[str] = (),
    ) -> None:
        self.activation, self.gated = check_activation(activation), gated
        up, down = (hidden, intermediate), (intermediate, hidden)
        col, row = (EMBED, FFN), (FFN, EMBED)
        self.w_gate = projection(lead, up, col, dtype, "w_gate", None, quantized) if gated else None
        self.w_up = projection(lead, up, col, dtype, "w_up", "b_up" if bias else None, quantized)
        b_down = "b_down" if bias else None
        self.w_down = projection(lead, down, row, dtype, "w_down", b_down, quantized)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., hidden] -> [..., hidden]
        return dense_mlp(x, self.fields(), self.activation, self.gated)
