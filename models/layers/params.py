"""How a weight is declared: once, by the module that uses it, with its shape, dtype, logical
sharding axes and the field name the checkpoint rules fill.

Every layer kind is a ``flax.nnx`` module (``Linear``, ``ExpertLinear``, ``Norm``, ``Embed``,
``Attention``, ``MLA``, ``MLP``, ``MoE``, ``DecoderLayer``, ``Decoder``). Its ``__init__``
declares each parameter with ``declare``: an abstract ``nnx.Param`` (a ``jax.ShapeDtypeStruct``,
nothing is allocated) whose metadata carries

- ``out_sharding``: one logical axis name per array axis (below), from which the mesh placement
  of the weights derives (``runtime.parallel.sharding``: one table maps logical axes to mesh
  axes);
- ``field``: the name the architecture's checkpoint rules map tensors onto (``models.weights``).

The loader fills the declared values from the checkpoint (``models.checkpoint.load``); the engine
then holds ``nnx.split``'s graph definition (static) and state (the arrays), and jits pure
functions over the state.

Modules of stacked layers declare their parameters with leading ``lead`` axes (``LAYERS``, then
``EXPERTS`` for expert stacks); a layer scan slices them, so inside the scan the same module
sees one layer's arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx, struct

# Logical axes. Only some are split over a device mesh (``runtime.parallel.sharding``); the
# others name what an axis is and stay whole.
LAYERS = "layers"  # the stacked-layer axis a scan runs over
EMBED = "embed"  # the hidden (residual) features
VOCAB = "vocab"  # the vocabulary, split: the largest matrices of a small model
HEADS = "heads"  # attention heads (times their head_dim), split: each device attends its heads
KV_HEADS = "kv_heads"  # KV heads (times head_dim), split with the heads they serve
FFN = "mlp"  # an MLP's (or shared expert's) intermediate features, split
EXPERTS = "experts"  # routed experts, split with expert parallelism
# Linear-attention heads' features (Gated DeltaNet), split in blocks of whole key heads with
# their value heads, as vLLM splits Qwen3-Next (``models.layers.linear_attention``).
LINEAR_HEADS = "linear_heads"
EXPERT_MLP = "expert_mlp"  # a routed expert's intermediate features (its expert is whole)
LATENT = "latent"  # MLA's low-rank query and KV latents, read by every head
HEAD_DIM = "head_dim"  # features of one head
NORM = "norm"  # a norm's features
ROUTER = "router"  # router logits (one per expert, or the shared expert's one gate)
PER_LAYER = "per_layer"  # per-layer input features (Gemma 4's per-layer embeddings), whole


def declare(
    shape: Sequence[int],
    dtype: Any,
    axes: Sequence[str | None],
    field: str,
    **metadata: Any,
) -> nnx.Param:
    """An abstract parameter of ``shape`` and ``dtype`` split along logical ``axes`` (one per
    array axis), filled at load from the checkpoint tensors the rules map onto ``field``."""
    shape, axes = tuple(int(n) for n in shape), tuple(axes)
    if len(axes) != len(shape):
        raise ValueError(f"{field}: {len(axes)} logical axes {axes} for shape {shape}")
    return nnx.Param(
        jax.ShapeDtypeStruct(shape, dtype),
        out_sharding=axes,
        field=field,
        eager_sharding=False,
        **metadata,
    )


@struct.dataclass
class PerLayer:
    """A stacked parameter held as one array (or packed weight) per layer, in layer order.

    The value a stacked parameter takes where the layers are walked unrolled
    (``models.state.ModelWeights.per_layer``): each layer's matmuls then read an array of their
    own, with no slice of a stack for XLA to copy out, and every layer's fusions are alike.
    """

    layers: tuple[Any, ...]


def layer_axes(lead: Sequence[int]) -> tuple[str, ...]:
    """Logical axes of ``lead``: the stacked layers."""
    return (LAYERS,) * len(lead)


def params(node: Any) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
    """Every parameter of a module (or ``nnx.State``) with its path, in path order."""
    state = node if isinstance(node, nnx.State) else nnx.state(node, nnx.Param)
    return list(nnx.to_flat_state(state))


class Block(nnx.Module):
    """A module whose parameters are also seen by field name, as the shared layer functions
    take them (``{"wq": ..., "bq": ...}``: see ``models.layers.attention`` and the others)."""

    def fields(self) -> dict[str, Any]:
        """This module's parameter values (its submodules' too) by field name."""
        return {var.get_metadata("field"): var.get_value() for _, var in params(self)}


def shapes(node: Any) -> dict[str, tuple[int, ...]]:
    """Every declared parameter's shape by field name."""
    return {var.get_metadata("field"): tuple(var.get_value().shape) for _, var in params(node)}
