"""Feed-forward blocks: gated (SwiGLU/GeGLU) and plain two-layer MLPs; ``MLP`` declares a
layer's weights (``w_gate``, ``w_up``, ``w_down`` as ``Linear`` modules, and ``b_up``, ``b_down``
with biases) and calls them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import jax
import jax.numpy as jnp

from jax_llm_runtime.models.layers.linear import project, projection
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
        """Gated: ``down(act(gate(x)) * up(x))`` (SwiGLU with silu); plain:
        ``down(act(up(x)))``, with the projections' biases where declared."""
        act = ACTIVATIONS[self.activation]
        if self.w_gate is not None:
            gate, up = project(x, self.w_gate, self.w_up)
            return self.w_down(act(gate) * up)
        return self.w_down(act(self.w_up(x)))
