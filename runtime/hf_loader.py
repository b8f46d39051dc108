"""HF-layout folders: ``config.json`` plus one or many ``*.safetensors`` files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from runtime.gguf_loader import Checkpoint


class HFCheckpointError(ValueError):
    pass


def load_hf_checkpoint(folder: Path) -> Checkpoint:
    """Read ``config.json`` and stream tensors from the folder's safetensors files.

    ``auto_map`` and any remote code are ignored; only safetensors are read (nothing is unpickled).
    """
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise HFCheckpointError(f"{folder} has no config.json")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{config_path} is not valid JSON: {e}") from None
    files = _safetensors_files(folder)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for path in files:
            # The flax framework reads bfloat16, which plain numpy cannot.
            with safe_open(str(path), framework="flax") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    yield key, np.asarray(f.get_tensor(key))

    num_tensors = 0
    for path in files:
        try:
            with safe_open(str(path), framework="flax") as f:
                num_tensors += len(list(f.keys()))
        except SafetensorError as e:
            raise HFCheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    return Checkpoint(config=config, tensors=tensors, num_tensors=num_tensors)


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
