"""Device bytes of a model's weights as loaded, per ``--isq`` format (BENCHMARKS.md, "Memory").

For each format the model is loaded the way ``runtime-serve`` loads it and the bytes of every
device array are summed: the packed projections (codes and scales) on their own, as bits per
weight, and the whole model (embeddings, norms and the float LM head included).

    .venv/bin/python tools/weight_bytes.py --model-id smollm2-135m-instruct --isq none,q4_0,q4k \
        2>/dev/null  # the loaders' progress bars
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import numpy as np

from jax_llm_runtime.models.decoder import PACKED_FIELDS
from jax_llm_runtime.models.isq import ISQ_TYPES
from jax_llm_runtime.models.registry import model_config_from_hf
from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedWeight
from jax_llm_runtime.runtime.loading.builder import load_checkpoint, resolve_dtype
from jax_llm_runtime.runtime.loading.sources import resolve_model_source


def _bytes(tree: object) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def _projection_stats(weights: dict) -> tuple[int, int]:
    """(device bytes, weights) of the fields a quantized model keeps packed, packed or not."""
    nbytes = count = 0
    for segment in weights["segments"]:
        for name, value in segment.items():
            if name in PACKED_FIELDS:
                nbytes += value.nbytes if isinstance(value, PackedWeight) else _bytes(value)
                count += int(np.prod(value.shape))
    return nbytes, count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default="smollm2-135m-instruct")
    parser.add_argument(
        "--isq",
        default="float,none," + ",".join(ISQ_TYPES),
        help="comma-separated formats; none = the checkpoint as it is, float = its quantized "
        "tensors dequantized at load (default: all)",
    )
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    files = resolve_model_source(args.model_id, None)
    checkpoint = load_checkpoint(files)
    spec, base = model_config_from_hf(checkpoint.config)
    dtype = resolve_dtype(args.dtype)
    print(f"{files.name}: device bytes of the weights ({dtype.name} for the float ones)")
    print(f"{'format':>8} {'projections MB':>14} {'bits/weight':>12} {'model MB':>9}")
    for name in args.isq.split(","):
        if name not in ("float", "none", *ISQ_TYPES):
            print(f"weight_bytes: unknown format {name!r}", file=sys.stderr)
            return 2
        config = dataclasses.replace(base, quantization=name if name in ISQ_TYPES else None)
        tensors = checkpoint.tensors(packed=name != "float")
        weights = spec.load(config, tensors, dtype, checkpoint.num_tensors)
        nbytes, count = _projection_stats(weights)
        bits = f"{nbytes * 8 / count:.3f}" if count else "-"
        print(f"{name:>8} {nbytes / 1e6:>14.1f} {bits:>12} {_bytes(weights) / 1e6:>9.1f}")
        del weights
    return 0


if __name__ == "__main__":
    sys.exit(main())
