"""What every image encoder of a vision-language model provides (``VisionSpec``), the split
encoder the engine holds (``VisionWeights``), the packed inputs of an encoder of images of any
size (``PackedImages``), and its strict checkpoint loading.

An encoder of one fixed image size (Gemma 3's SigLIP) turns preprocessed pixels
``[num_images, 3, size, size]`` into the soft tokens ``[num_images, tokens_per_image,
text_hidden]``; an encoder of images of any size (Pixtral) takes their patches packed into one
run (``VisionSpec.pack``) and returns the soft tokens of all of them in one run. Either way they
replace the embeddings of a prompt's image tokens. Its weights live beside the text model's in
the checkpoint, under ``checkpoint_prefixes``; the text model's rules skip them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jax_llm_runtime.models.weights import WeightLoadError


@dataclass(frozen=True)
class PackedImages:
    """Images of any size as one encoder call's host inputs: every image's patches in one run,
    padded to a compiled count; the encoder's output holds ``tokens[i]`` soft tokens of image
    ``i`` after those of the images before it (padding's after all of them)."""

    patches: np.ndarray  # [num_patches, channels * patch_size**2] float32
    # [num_patches, config.position_width] int32: each patch's (row, column) in its image, then
    # what else the encoder reads per patch (Qwen3-VL: its image's rows and columns)
    positions: np.ndarray
    segments: np.ndarray  # [num_patches] int32, each patch's image in the call; -1: padding
    tokens: tuple[int, ...]  # soft tokens per image


def pack_images(
    cfg: Any,
    pixels: Sequence[np.ndarray],
    num_patches: int,
    image_patches: Callable[[Any, np.ndarray], tuple[np.ndarray, np.ndarray]],
) -> PackedImages:
    """``pixels`` (each ``[3, height, width]``) packed into a run of ``num_patches`` patches:
    ``image_patches(cfg, image)`` gives one image's patches ``[n, cfg.patch_features]`` and
    positions ``[n, cfg.position_width]`` in the order of its merged tokens (``cfg.
    patch_multiple`` patches each); a ValueError when they do not fit."""
    patches = np.zeros((num_patches, cfg.patch_features), np.float32)
    positions = np.zeros((num_patches, cfg.position_width), np.int32)
    segments = np.full(num_patches, -1, np.int32)
    tokens, start = [], 0
    for i, image in enumerate(pixels):
        values, where = image_patches(cfg, np.asarray(image, np.float32))
        end = start + len(values)
        if end > num_patches:
            raise ValueError(f"the images have more than {num_patches} patches")
        patches[start:end], positions[start:end], segments[start:end] = values, where, i
        tokens.append(len(values) // cfg.patch_multiple)
        start = end
    return PackedImages(patches, positions, segments, tuple(tokens))


@dataclass(frozen=True)
class VisionSpec:
    """``config_from_hf(hf)`` -> the encoder config (``image_token_id``, and for one fixed image
    size ``tokens_per_image``, ``image_size``, ``boi_token_id``, ``eoi_token_id``);
    ``load(config, tensors, dtype)`` -> ``VisionWeights`` from the HF tensors named under
    ``checkpoint_prefixes``; ``declare(config, dtype)`` -> the encoder module with abstract
    parameters (what a prepared checkpoint restores into); ``encode(config, weights, pixels)`` -> soft tokens (pure; the
    engine jits it). ``rename`` spells a checkpoint name the way ``checkpoint_prefixes`` and
    ``load`` read it.

    An encoder of images of any size has ``pack(config, pixels, num_patches)`` ->
    ``PackedImages`` (``pixels``: each image's ``[3, height, width]``; its config's
    ``num_patches(height, width)`` counts an image's patches, ``patch_multiple`` divides every
    padded count; ``patch_features`` and ``position_width`` give the packed arrays' widths),
    and its ``encode(config, weights, patches, positions, segments)`` returns ``[num_patches /
    merged, text_hidden]``, or ``[..., config.out_width]`` when the config has one (deepstack
    levels after each soft token: ``models.batch``). ``bidirectional``: the decoder lets the tokens of
    one image attend to each other both ways (Gemma 3), rather than causally (Mistral 3)."""

    config_from_hf: Callable[[dict[str, Any]], Any]
    load: Callable[[Any, Mapping[str, np.ndarray], Any], Any]
    encode: Callable[..., Any]
    declare: Callable[[Any, Any], nnx.Module]
    checkpoint_prefixes: tuple[str, ...]
    rename: Callable[[str], str] = lambda name: name
    pack: Callable[[Any, Sequence[np.ndarray], int], PackedImages] | None = None
    bidirectional: bool = True

    def owns(self, name: str) -> bool:
        """Whether a checkpoint tensor (named as ``rename`` spells it) belongs to the encoder."""
        return name.startswith(self.checkpoint_prefixes)

    def split_tensors(
        self, tensors: Iterable[tuple[str, Any]], captured: dict[str, np.ndarray]
    ) -> Iterator[tuple[str, Any]]:
        """The text model's tensors of a checkpoint stream; the encoder's go to ``captured``
        (as host arrays, under ``rename``'s names) as the stream passes them."""
        for name, value in tensors:
            canonical = self.rename(name)
            if self.owns(canonical):
                captured[canonical] = np.asarray(value)
            else:
                yield name, value


@struct.dataclass
class VisionWeights:
    """An ``nnx.split`` encoder: its static graph definition and its state."""

    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    state: Any


def _value(name: str, path: tuple[Any, ...], tensor: np.ndarray) -> np.ndarray:
    """HF's layout to ours: linear weights ``[out, in]`` (a patch convolution's ``[out,
    channels, rows, columns]``, or ``[out, channels, frames, rows, columns]``: a linear map of
    the flattened patch) become ``[in, out]`` kernels."""
    if path[-1] != "kernel":
        return tensor
    if tensor.ndim in (4, 5):
        tensor = tensor.reshape(tensor.shape[0], -1)
    if tensor.ndim != 2:
        raise WeightLoadError(f"{name}: expected a matrix, got shape {tensor.shape}")
    return tensor.T


def load_vision(
    module: nnx.Module,
    names: Mapping[str, tuple[Any, ...]],
    tensors: Mapping[str, np.ndarray],
    dtype: jnp.dtype,
) -> VisionWeights:
    """Fill ``module``'s parameters from ``tensors`` through ``names`` (HF name -> state
    path). A tensor with no parameter, a parameter with no tensor, or a shape mismatch is a
    ``WeightLoadError`` naming the key."""
    graphdef, state = nnx.split(module)
    flat = dict(nnx.to_flat_state(state))
    filled: set[tuple[Any, ...]] = set()
    for name, tensor in tensors.items():
        path = names.get(name)
        if path is None or path not in flat:
            raise WeightLoadError(f"{name}: no vision parameter takes this checkpoint tensor")
        value = _value(name, path, np.asarray(tensor))
        expected = flat[path].get_value().shape
        if value.shape != expected:
            raise WeightLoadError(f"{name}: shape {value.shape}, the model declares {expected}")
        flat[path].set_value(jnp.asarray(value, dtype))
        filled.add(path)
    missing = [name for name, path in names.items() if path not in filled]
    if missing:
        raise WeightLoadError(f"the checkpoint lacks the vision tensor {missing[0]}")
    return VisionWeights(graphdef, nnx.from_flat_state(flat))
