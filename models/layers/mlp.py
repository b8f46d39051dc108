"""Feed-forward blocks: gated (SwiGLU/GeGLU) and plain two-layer MLPs."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax

from jax_llm_runtime.models.layers.linear import linear

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
