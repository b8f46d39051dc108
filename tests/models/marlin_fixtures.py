"""Marlin-layout test folders, written the way candle-vllm's converters and AutoGPTQ lay them out.

The packer here runs the forward direction of the published algorithm (IST-DASLab's
``Layer.pack``, vLLM's ``marlin_weights`` and ``marlin_permute_scales``, candle-vllm's
``marlin_zero_points``), written with plain loops, so that it shares no code with the loader's
un-packing in ``pallas_kernels.dequant_matmul.marlin``.

``to_marlin`` rewrites a GPTQ folder of ``gptq_awq_fixtures`` into Marlin's layout (``B``, ``s``);
``to_awq_marlin`` does what ``convert_awq_marlin.py`` does to an AWQ folder (only ``qzeros``
change). Both keep the shards and the index of their source.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from tests.models.gptq_awq_fixtures import QuantizedModel

INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)


def weight_perm() -> np.ndarray:
    """Position p of a run of 1024 shuffled codes (four 16 x 16 tiles, row-major one after the
    other) holds the run's code ``perm[p]``."""
    perm = []
    for thread in range(32):
        fragment = []
        for column in (thread // 4, thread // 4 + 8):
            base = 2 * (thread % 4)
            for row in (base, base + 1, base + 8, base + 9):
                fragment.append(16 * row + column)
        for tile in range(4):
            shifted = [p + 256 * tile for p in fragment]
            perm += [shifted[i] for i in INTERLEAVE]
    return np.array(perm)


def scale_perm(single: bool) -> np.ndarray:
    if single:
        return np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])
    return np.array([i + 8 * j for i in range(8) for j in range(8)])


def pack_sequential(values: np.ndarray) -> np.ndarray:  # int32 [rows, cols / 8]
    """Eight 4-bit values per word along the columns, low nibble first, in column order."""
    values = np.asarray(values, np.uint32)
    out = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
    for i in range(8):
        out |= values[:, i::8] << (4 * i)
    return out.view(np.int32)


def pack_marlin(
    codes: np.ndarray,  # uint8 [in, out], symmetric codes (zero 8)
    scales: np.ndarray,  # float16 [groups, out]
    group_size: int,
) -> tuple[np.ndarray, np.ndarray]:  # B int32 [in / 16, 2 * out], s float16 [groups, out]
    k, n = codes.shape
    tiles = codes.reshape(k // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(k // 16, 16 * n)
    shuffled = tiles.reshape(-1, 1024)[:, weight_perm()].reshape(tiles.shape)
    single = group_size == -1 or group_size >= k
    perm = scale_perm(single)
    s = scales.reshape(-1, perm.size)[:, perm].reshape(scales.shape)
    return pack_sequential(shuffled), np.ascontiguousarray(s)


def marlin_awq_zeros(zeros: np.ndarray) -> np.ndarray:  # int32 [groups, out / 8]
    """``convert_awq_marlin.py``'s qzeros from natural zero points ``[groups, out]``."""
    shuffled = zeros.reshape(-1, 64)[:, scale_perm(False)]
    interleaved = shuffled.reshape(-1, 8)[:, list(INTERLEAVE)]
    return pack_sequential(interleaved.reshape(zeros.shape))


def _rewrite(src: Path, dst: Path, convert) -> None:
    """Every shard of ``src`` through ``convert(tensors) -> tensors``; the index follows."""
    dst.mkdir(parents=True)
    weight_map = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        tensors = {k: np.ascontiguousarray(a) for k, a in convert(tensors).items()}
        save_file(tensors, str(dst / path.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, path.name))
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def to_marlin(
    model: QuantizedModel, dst: Path, quant: dict, workspace: bool = False
) -> QuantizedModel:
    """``model``'s GPTQ folder (symmetric, 4 bits) in Marlin's layout, with ``quant`` as its
    ``quantization_config``; ``workspace`` adds the scratch tensor AutoGPTQ saves."""
    group = json.loads((model.folder / "config.json").read_text())["quantization_config"][
        "group_size"
    ]

    def convert(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for key, value in tensors.items():
            prefix, _, part = key.rpartition(".")
            if part not in ("qweight", "qzeros", "scales", "g_idx"):
                out[key] = value
            elif part == "qweight":  # the whole linear goes where its qweight was
                ints = model.linears[prefix]
                out[f"{prefix}.B"], out[f"{prefix}.s"] = pack_marlin(ints.codes, ints.scales, group)
                if workspace:
                    out[f"{prefix}.workspace"] = np.zeros(ints.codes.shape[1] // 64 * 16, np.int32)
        return out

    _rewrite(model.folder, dst, convert)
    config = json.loads((model.folder / "config.json").read_text())
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return QuantizedModel(dst, model.hf_model, model.linears)


def to_awq_marlin(model: QuantizedModel, dst: Path) -> QuantizedModel:
    """``model``'s AWQ folder as ``convert_awq_marlin.py --method awq`` leaves it: config and
    every tensor as they were except each ``qzeros``."""

    def convert(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(tensors)
        for key in tensors:
            if key.endswith(".qzeros"):
                out[key] = marlin_awq_zeros(model.linears[key.removesuffix(".qzeros")].zeros)
        return out

    _rewrite(model.folder, dst, convert)
    shutil.copy2(model.folder / "config.json", dst / "config.json")
    return QuantizedModel(dst, model.hf_model, model.linears)
