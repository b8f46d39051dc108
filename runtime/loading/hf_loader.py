"""HF-layout folders: ``config.json`` plus one or many ``*.safetensors`` files.

GPTQ and AWQ checkpoints, Marlin-layout ones included, and MXFP4 ones (``quantization_config`` in
``config.json``, see ``runtime.loading.hf_quant``), load as they are: each quantized linear's
tensors, wherever its shards put them, come out as one ``(<prefix>.weight, HostPacked)`` item
(MXFP4: ``(<prefix>, HostPacked)``) in the ``[in, out]`` orientation; every other tensor streams
as a numpy array.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.gptq import check_g_idx
from jax_llm_runtime.pallas_kernels.dequant_matmul.host import dequantize_host
from jax_llm_runtime.runtime.loading.gguf.loader import Checkpoint
from jax_llm_runtime.runtime.loading.hf_quant import (
    QuantConfig,
    quant_config_from_hf,
    quantized_linears,
)


class HFCheckpointError(ValueError):
    pass


def load_hf_checkpoint(folder: Path) -> Checkpoint:
    """Read ``config.json`` and stream tensors from the folder's safetensors files.

    ``auto_map`` and any remote code are ignored; only safetensors are read (nothing is unpickled).
    A quantized checkpoint's config and the completeness of its quantized linears are checked
    here, before any weight is read, and so is GPTQ's ``g_idx`` (small), so that an act-order
    checkpoint fails at once.
    """
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise HFCheckpointError(f"{folder} has no config.json")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{config_path} is not valid JSON: {e}") from None
    try:
        quant = quant_config_from_hf(config)
    except ValueError as e:
        raise HFCheckpointError(f"{config_path}: {e}") from None
    files = _safetensors_files(folder)
    located = _locate(files)  # (key, file) in file order
    where = dict(located)
    try:
        linears = quantized_linears(where, quant)
    except ValueError as e:
        raise HFCheckpointError(f"{folder}: {e}") from None
    if quant is not None and quant.method == "gptq":
        _check_g_idx(linears, where, quant)
    sep = "." if quant is None else quant.separator
    parts = {f"{prefix}{sep}{part}" for prefix, names in linears.items() for part in names}

    def tensors(packed: bool = False) -> Iterator[tuple[str, np.ndarray | HostPacked]]:
        """With ``packed``, each quantized linear is one ``HostPacked`` ``[in, out]``; without,
        its float32 values in the checkpoint's ``[out, in]`` layout."""
        for path in files:
            # The flax framework reads bfloat16, which plain numpy cannot.
            with safe_open(str(path), framework="flax") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    if key not in parts:
                        yield key, np.asarray(f.get_tensor(key))
                    elif key.endswith(f"{sep}{quant.required[0]}"):
                        prefix = key.removesuffix(f"{sep}{quant.required[0]}")
                        value = _packed(prefix, linears[prefix], where, quant)
                        yield quant.item_name(prefix), value if packed else _float(value, quant)

    num_tensors = len(located) - len(parts) + len(linears)
    return Checkpoint(config=config, tensors=tensors, num_tensors=num_tensors)


def _locate(files: list[Path]) -> list[tuple[str, Path]]:
    located = []
    for path in files:
        try:
            with safe_open(str(path), framework="flax") as f:
                located += [(key, path) for key in f.keys()]  # noqa: SIM118
        except SafetensorError as e:
            raise HFCheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    return located


def _read(where: dict[str, Path], keys: list[str]) -> dict[str, np.ndarray]:
    """The named tensors, each read from its own shard (one opening per shard)."""
    out: dict[str, np.ndarray] = {}
    for path in dict.fromkeys(where[k] for k in keys):
        with safe_open(str(path), framework="flax") as f:
            out.update({k: np.asarray(f.get_tensor(k)) for k in keys if where[k] == path})
    return out


def _packed(
    prefix: str, parts: tuple[str, ...], where: dict[str, Path], quant: QuantConfig
) -> HostPacked:
    sep = quant.separator
    tensors = _read(where, [f"{prefix}{sep}{p}" for p in parts])
    try:
        return quant.host_packed({p: tensors[f"{prefix}{sep}{p}"] for p in parts})
    except ValueError as e:
        raise HFCheckpointError(f"{quant.method} linear {prefix}: {e}") from None


def _float(value: HostPacked, quant: QuantConfig) -> np.ndarray:
    """A quantized linear's float32 values, laid out as its float tensor would be."""
    values = dequantize_host(value)  # [..., in, out]
    return np.swapaxes(values, -1, -2) if quant.float_transposed else values


def _check_g_idx(
    linears: dict[str, tuple[str, ...]], where: dict[str, Path], quant: QuantConfig
) -> None:
    keys = [f"{prefix}.g_idx" for prefix, parts in linears.items() if "g_idx" in parts]
    for key, g_idx in _read(where, keys).items():
        try:
            check_g_idx(g_idx, quant.group_size)
        except ValueError as e:
            raise HFCheckpointError(f"{key}: {e}") from None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        files = [folder / name for name in names]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise HFCheckpointError(f"{index} names missing files: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{folder} has no *.safetensors weights")
    return files
