"""A loaded model as the engine holds it: ``nnx.split``'s graph definition and state.

The graph definition (the module tree, its static settings and every parameter's declaration
with its metadata) is static; the state is the argument of every jitted step, which merges the
two back into the module (``ModelWeights.model``) while it traces. The state is kept as nested
dicts of the parameters' values (``nnx.State.to_pure_dict``): a step call flattens plain dicts
(in C++), and the declarations stay in the graph definition, where mesh placement
(``runtime.parallel.sharding``) reads their logical axes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
from flax import nnx, struct

from jax_llm_runtime.models.layers.params import PerLayer, params


@struct.dataclass
class ModelWeights(Mapping[str, Any]):
    """A split model. As a mapping it reads the parameter values by field name, the names the
    checkpoint rules use: ``weights["embed"]``, and per segment of stacked layers
    ``weights["segments"][i]["wq"]``."""

    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    state: dict[str, Any]  # nested by module path; leaves: arrays, PackedWeight, QuantizedWeight

    @classmethod
    def split(cls, model: nnx.Module) -> ModelWeights:
        """``model`` split into its graph definition and the values of its parameters."""
        return cls(
            nnx.graphdef(model), nested((path, var.get_value()) for path, var in params(model))
        )

    def model(self, cfg: Any = None) -> Any:
        """The module, merged from the graph definition and the state (inside jit: traced
        values). With a ``cfg`` other than the module's (the same model with other run
        settings: ``native_kernels``, a KV rounding), the module is declared again from it
        (``redeclared``) and merged with the same state."""
        model = nnx.merge(self.graphdef, self.state)
        if cfg is not None and cfg != model.cfg:
            model = nnx.merge(nnx.graphdef(model.redeclared(cfg)), self.state)
        return model

    def per_layer(self, consume: bool = False) -> ModelWeights:
        """The same weights with every stacked layer parameter held as one array per layer
        (``PerLayer``), for a step that walks the layers unrolled (``--layer-loop unrolled``).

        Each layer's arrays are copies of its slices, placed as the stack was. With
        ``consume`` each stack is deleted once copied, so the device holds the weights once
        (this ``ModelWeights`` must then not be used again). Stacks kept in host memory
        (offloaded experts) stay stacked; the loop slices those."""
        segments = self.model().segments
        state = dict(self.state)
        state["segments"] = {
            k: _split_layers(v, segments[k].end - segments[k].start, consume)
            for k, v in self.state["segments"].items()
        }
        return ModelWeights(self.graphdef, state)

    def variables(self) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
        """Every parameter with its path: its value and its declaration's metadata."""
        return params(self.model())

    def fields(self) -> dict[str, Any]:
        """Parameter values by field name; the stacked layers' under ``"segments"``."""
        top: dict[str, Any] = {}
        segments: dict[int, dict[str, Any]] = {}
        for path, var in self.variables():
            own = segments.setdefault(path[1], {}) if path[0] == "segments" else top
            own[var.get_metadata("field")] = var.get_value()
        if segments:
            top["segments"] = tuple(segments[i] for i in sorted(segments))
        return top

    def __getitem__(self, name: str) -> Any:
        return self.fields()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields())

    def __len__(self) -> int:
        return len(self.fields())


def nested(flat: Iterable[tuple[tuple[Any, ...], Any]]) -> dict[str, Any]:
    """Values by path as nested dicts (the form of ``ModelWeights.state``)."""
    out: dict[Any, Any] = {}
    for path, value in flat:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _split_layers(node: Any, layers: int, consume: bool) -> Any:
    """``node``'s parameter values (nested dicts), each stack of ``layers`` split (``per_layer``)."""
    if isinstance(node, dict):
        return {k: _split_layers(v, layers, consume) for k, v in node.items()}
    arrays = jax.tree.leaves(node)
    on_device = all(
        getattr(a, "ndim", 0)
        and a.shape[0] == layers
        and a.sharding.memory_kind in (None, "device")
        for a in arrays
    )
    if not arrays or not on_device:
        return node
    split = PerLayer(tuple(jax.tree.map(lambda a, i=i: a[i], node) for i in range(layers)))
    if consume:
        jax.block_until_ready(split)
        for a in arrays:
            a.delete()
    return split
