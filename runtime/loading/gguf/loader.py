"""GGUF files to an HF-style config and HF-named float32 tensors.

1. ``gguf_reader.read_gguf_header`` parses and bounds-checks each file's header.
2. A split model (llama.cpp's gguf-split: ``name-00001-of-00003.gguf`` ...) is opened from its
   first shard; the other shards are found by name and checked against its ``split.*`` metadata.
   Metadata comes from the first shard, tensors from all of them.
3. ``gguf_archs`` holds one table per ``general.architecture``; ``gguf_config`` turns metadata
   (and the few small config tensors, such as Llama 3's ``rope_freqs``) into an HF config dict.
4. ``gguf_tensors`` maps every tensor name to a rule before any weight is read.
5. ``Checkpoint.tensors()`` memory-maps the shards again and yields one dequantized tensor at a
   time, HF-named, HF-shaped (``[out_features, in_features]`` for linear weights) and HF-ordered.
   ``tensors(packed=True)`` yields each quantized tensor whose conversion only moves rows as a
   ``HostPacked`` instead (``[in_features, out_features]``): its block bytes go through the same
   row operations and are re-laid out, never dequantized (MXFP4: expert stacks only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jax_llm_runtime.pallas_kernels.dequant_matmul import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.gguf_blocks import (
    CODEBOOK_DECODERS,
    PACKABLE,
    from_gguf,
)
from jax_llm_runtime.runtime.loading.gguf.archs import ARCHS
from jax_llm_runtime.runtime.loading.gguf.config import CONFIG_TENSORS, GGUFModel, build_config
from jax_llm_runtime.runtime.loading.gguf.reader import (
    SHARD_NAME,
    GGUFError,
    GGUFHeader,
    GGUFTensorInfo,
    dequantize_tensor,
    raw_rows,
    read_gguf_header,
    short_repr,
)
from jax_llm_runtime.runtime.loading.gguf.tensors import TensorRule, plan_tensors

__all__ = ["Checkpoint", "GGUFError", "load_gguf_checkpoint", "read_gguf_header"]

# Rope factor tensors hold head_dim / 2 values; anything far larger is not one.
_MAX_CONFIG_TENSOR_ITEMS = 1 << 16


@dataclass(frozen=True)
class Checkpoint:
    """An HF ``config.json``-style dict and a factory that streams ``(hf_name, array)`` pairs.

    Each ``tensors()`` call starts a fresh pass; ``num_tensors`` is how many pairs one pass yields.
    """

    config: dict[str, Any]
    tensors: Callable[..., Iterator[tuple[str, np.ndarray | HostPacked]]]  # (packed=False)
    num_tensors: int


@dataclass(frozen=True)
class _Shard:
    path: Path
    header: GGUFHeader


def load_gguf_checkpoint(path: Path) -> Checkpoint:
    """Read a GGUF model (one file, or the first shard of a split set) into an HF-style config and
    a lazy stream of HF-named tensors.

    Every tensor name is mapped (and unknown ones rejected) here, before any weight is read.
    ``tensors()`` yields float32 numpy arrays in file order, HF-shaped and HF-ordered; one GGUF
    tensor may become several HF tensors (stacked experts) and two may become one (DeepSeek's
    k_b/v_b). A tied model (no ``output.weight``) yields no ``lm_head.weight`` and has
    ``tie_word_embeddings`` True. ``config["rope_freq_factors"]`` (not an HF key) holds Llama 3's
    per-frequency rope divisors when the file has them. Raises GGUFError.
    """
    shards = _read_shards(Path(path))
    metadata = shards[0].header.metadata
    located = _locate_tensors(shards)
    arch = metadata.get("general.architecture")
    try:
        spec = ARCHS.get(arch) if isinstance(arch, str) else None
        if spec is None:
            raise GGUFError(
                f"architecture {short_repr(arch)} is not supported ({', '.join(ARCHS)} are)"
            )
        model = GGUFModel(
            arch=arch,
            metadata=metadata,
            shapes={name: info.shape for name, (_, info) in located.items()},
            values=_config_tensor_values(located),
        )
        config = build_config(spec, model)
        rules = plan_tensors(spec, config, model, list(located))
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from e

    def tensors(packed: bool = False) -> Iterator[tuple[str, np.ndarray | HostPacked]]:
        yield from _stream(rules, located, packed)

    num_tensors = sum(len(rule.outputs) for rule in rules)
    return Checkpoint(config=config, tensors=tensors, num_tensors=num_tensors)


def _read_shards(path: Path) -> list[_Shard]:
    first = _Shard(path, read_gguf_header(path))
    count = _split_int(path, first.header.metadata, "split.count", default=1, minimum=1)
    if count == 1:
        return [first]
    number = _split_int(path, first.header.metadata, "split.no")
    match = SHARD_NAME.fullmatch(path.name)
    if match is None or int(match["count"]) != count:
        raise GGUFError(
            f"{path} is part of a {count}-file split GGUF but is not named "
            f"<name>-0000k-of-{count:05d}.gguf; restore the shard file names"
        )
    if number != 0 or int(match["no"]) != 1:
        first_name = f"{match['prefix']}-00001-of-{count:05d}.gguf"
        raise GGUFError(f"{path} is not the first shard of a split GGUF; pass {first_name}")
    shards = [first]
    for no in range(2, count + 1):
        shard = path.with_name(f"{match['prefix']}-{no:05d}-of-{count:05d}.gguf")
        if not shard.is_file():
            raise GGUFError(
                f"split GGUF shard {shard.name} ({no} of {count}) is missing; put all {count} "
                f"shards next to {path.name}"
            )
        header = read_gguf_header(shard)
        split = [_split_int(shard, header.metadata, key) for key in ("split.no", "split.count")]
        if split != [no - 1, count]:
            raise GGUFError(
                f"{shard} is not shard {no} of {count} by its split.no/split.count metadata; "
                "the shards come from different files"
            )
        shards.append(_Shard(shard, header))
    _check_tensor_count(path, shards)
    return shards


def _check_tensor_count(path: Path, shards: list[_Shard]) -> None:
    expected = _split_int(path, shards[0].header.metadata, "split.tensors.count")
    found = sum(len(shard.header.tensors) for shard in shards)
    if expected is not None and expected != found:
        raise GGUFError(
            f"{path}: split.tensors.count says {expected} tensors, the {len(shards)} shards "
            f"hold {found}; a shard is truncated or from another file"
        )


def _split_int(
    path: Path, metadata: Mapping[str, Any], key: str, default: int | None = None, minimum: int = 0
) -> int | None:
    """A ``split.*`` count or index (``default`` when absent); GGUFError unless an integer."""
    value = metadata.get(key, default)
    if value is not None and (
        not isinstance(value, int) or isinstance(value, bool) or value < minimum
    ):
        raise GGUFError(f"{path}: {key} must be an integer >= {minimum}, got {short_repr(value)}")
    return value


def _locate_tensors(shards: list[_Shard]) -> dict[str, tuple[Path, GGUFTensorInfo]]:
    located: dict[str, tuple[Path, GGUFTensorInfo]] = {}
    for shard in shards:
        for info in shard.header.tensors:
            if info.name in located:
                raise GGUFError(
                    f"tensor {info.name!r} is in both {located[info.name][0].name} and "
                    f"{shard.path.name}"
                )
            located[info.name] = (shard.path, info)
    return located


def _config_tensor_values(
    located: dict[str, tuple[Path, GGUFTensorInfo]],
) -> dict[str, np.ndarray]:
    values = {}
    for name in CONFIG_TENSORS:
        if name not in located:
            continue
        path, info = located[name]
        if len(info.shape) != 1 or info.shape[0] > _MAX_CONFIG_TENSOR_ITEMS:
            raise GGUFError(f"tensor {name!r} should be a short vector, has shape {info.shape}")
        values[name] = dequantize_tensor(np.memmap(path, dtype=np.uint8, mode="r"), info)
    return values


def _stream(
    rules: tuple[TensorRule, ...],
    located: dict[str, tuple[Path, GGUFTensorInfo]],
    packed: bool,
) -> Iterator[tuple[str, np.ndarray | HostPacked]]:
    files: dict[Path, np.ndarray] = {}
    for rule in rules:
        sources = []
        for name in rule.sources:
            path, info = located[name]
            if path not in files:
                files[path] = np.memmap(path, dtype=np.uint8, mode="r")
            sources.append((files[path], info))
        if packed and _packable(rule, [info for _, info in sources]):
            qtype, cols = sources[0][1].qtype, sources[0][1].shape[-1]
            arrays = rule.convert([raw_rows(data, info) for data, info in sources])
            for out, raw in zip(rule.outputs, arrays, strict=True):
                yield out, from_gguf(raw, qtype, cols)
            continue
        arrays = rule.convert([dequantize_tensor(data, info) for data, info in sources])
        if rule.in_out:
            arrays = [np.ascontiguousarray(np.swapaxes(a, -1, -2)) for a in arrays]
        yield from zip(rule.outputs, arrays, strict=True)


def _packable(rule: TensorRule, infos: list[GGUFTensorInfo]) -> bool:
    """Whether ``rule``'s sources stay packed: one packable type, rows of output channels (a
    vector, kept F32 by llama.cpp's converter so that only an odd file quantizes one, is
    dequantized), and a conversion that only moves rows. MXFP4 stays packed in expert stacks
    only, what llama.cpp's MXFP4 files hold: the MoE layers read it through the reference
    dequantizer, while the dense projections' kernels read affine codes only."""
    qtypes = {info.qtype for info in infos}
    if not rule.rows_only or len(qtypes) != 1 or not qtypes <= set(PACKABLE):
        return False
    min_dims = 3 if qtypes <= CODEBOOK_DECODERS.keys() else 2
    return all(len(info.shape) >= min_dims for info in infos)
