"""Repack an AWQ (GEMM) HF folder into GPTQ's layout, the one our loader re-lays most directly.

    python tools/convert_awq.py SRC_FOLDER DST_FOLDER

Each AWQ linear (``qweight`` int32 ``[in, out / 8]`` with AutoAWQ's interleaved nibbles,
``qzeros``, ``scales``) becomes GPTQ tensors (``qweight`` int32 ``[in / 8, out]``, ``qzeros``,
``scales``, ``g_idx``) holding the same codes, zero points and scales, so the new folder loads to
the same ``HostPacked`` weights and dequantizes bit for bit as the original. The zero points
decide the GPTQ flavour: all of them 8 is ``sym=True``; otherwise ``sym=False``, in
``checkpoint_format`` "gptq" (v1, which transformers, vLLM and AutoGPTQ all read) unless some
zero point is 0, which v1 cannot store (it stores zero - 1), and then "gptq_v2" (GPTQModel).

Every other tensor is copied as it is, shard for shard (each converted linear goes to the shard
of its ``qweight``), the index is rewritten, ``config.json`` gets a GPTQ ``quantization_config``
(also written as ``quantize_config.json`` for AutoGPTQ), and every other file (tokenizer,
generation config, ...) is copied. This plays the role of candle-vllm's ``convert_awq_marlin.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jax_llm_runtime.pallas_kernels.dequant_matmul.gptq import pack_gptq
from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint
from jax_llm_runtime.runtime.loading.hf_quant import (
    QuantConfig,
    quant_config_from_hf,
    quantized_linears,
)

INDEX = "model.safetensors.index.json"
# Files rewritten here rather than copied (AutoAWQ's own quant_config.json describes AWQ).
NOT_COPIED = {"config.json", INDEX, "quant_config.json", "quantize_config.json"}


def convert(src: Path, dst: Path) -> dict:
    """Write ``src`` (an AWQ GEMM folder) to ``dst`` in GPTQ layout; returns the new
    ``quantization_config``. ValueError (one line) for an input that is not AWQ GEMM 4-bit."""
    if dst.exists():
        raise ValueError(f"{dst} already exists; name a new folder")
    config = json.loads((src / "config.json").read_text())
    quant = quant_config_from_hf(config)
    if quant is None or quant.method != "awq":
        method = None if quant is None else quant.method
        raise ValueError(f"{src} is not an AWQ checkpoint (quant_method {method!r})")
    load_hf_checkpoint(src)  # every check the loader makes, before anything is written
    files = sorted(p.name for p in src.glob("*.safetensors"))
    where = {}
    for name in files:
        with safe_open(str(src / name), framework="numpy") as f:
            where.update(dict.fromkeys(f.keys(), name))
    linears = quantized_linears(where, quant)
    gptq = _gptq_config(quant, _zero_points(src, where, linears))
    dst.mkdir(parents=True, exist_ok=False)
    weight_map, total = {}, 0
    for name in files:
        tensors = _convert_shard(src, name, where, linears, quant, gptq)
        # safetensors' numpy writer stores an array's memory as it lies, so lay it out in C order.
        tensors = {k: np.ascontiguousarray(t) for k, t in tensors.items()}
        save_file(tensors, str(dst / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
    if (src / INDEX).is_file():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config["quantization_config"] = gptq
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dst / "quantize_config.json").write_text(json.dumps(gptq, indent=2) + "\n")
    for path in src.iterdir():
        if path.name in NOT_COPIED or path.suffix == ".safetensors":
            continue
        if path.is_dir():
            shutil.copytree(path, dst / path.name)
        else:
            shutil.copy2(path, dst / path.name)
    return gptq


def _zero_points(src: Path, where: dict[str, str], linears: dict) -> set[int]:
    """Every zero point value in the checkpoint (nibbles of all ``qzeros``; order is moot)."""
    seen: set[int] = set()
    for prefix in linears:
        key = f"{prefix}.qzeros"
        with safe_open(str(src / where[key]), framework="numpy") as f:
            words = np.ascontiguousarray(f.get_tensor(key)).view(np.uint32)
        shifts = np.arange(8, dtype=np.uint32) * 4
        seen.update(np.unique((words[..., None] >> shifts) & 0xF).tolist())
    return seen


def _gptq_config(quant: QuantConfig, zeros: set[int]) -> dict:
    sym = zeros <= {1 << (quant.bits - 1)}
    return {
        "quant_method": "gptq",
        "bits": quant.bits,
        "group_size": quant.group_size,
        "desc_act": False,
        "static_groups": False,
        "sym": sym,
        "checkpoint_format": "gptq_v2" if 0 in zeros else "gptq",
        "pack_dtype": "int32",
    }


def _convert_shard(
    src: Path, name: str, where: dict[str, str], linears: dict, quant: QuantConfig, gptq: dict
) -> dict[str, np.ndarray]:
    """One output shard: this shard's tensors, with each linear whose qweight is here repacked."""
    parts = {f"{prefix}.{p}" for prefix, names in linears.items() for p in names}
    out: dict[str, np.ndarray] = {}
    with safe_open(str(src / name), framework="flax") as f:  # flax: bfloat16 reads too
        for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
            if key not in parts:
                out[key] = np.asarray(f.get_tensor(key))
            elif key.endswith(".qweight"):
                prefix = key.removesuffix(".qweight")
                awq = {p: _tensor(src, where, f"{prefix}.{p}") for p in linears[prefix]}
                packed = quant.host_packed(awq)
                tensors = pack_gptq(
                    packed.codes,
                    packed.z,
                    packed.d,
                    group_size=quant.group_size,
                    checkpoint_format=gptq["checkpoint_format"],
                )
                for part in ("qweight", "qzeros", "scales", "g_idx"):
                    out[f"{prefix}.{part}"] = getattr(tensors, part)
    return out


def _tensor(src: Path, where: dict[str, str], key: str) -> np.ndarray:
    with safe_open(str(src / where[key]), framework="flax") as f:
        return np.asarray(f.get_tensor(key))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="AWQ (GEMM) HF folder")
    parser.add_argument("dst", type=Path, help="new folder for the GPTQ-layout copy")
    args = parser.parse_args(argv)
    try:
        gptq = convert(args.src, args.dst)
    except (ValueError, OSError) as e:
        print(f"convert_awq: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst} (GPTQ, sym={gptq['sym']}, {gptq['checkpoint_format']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
