"""In-situ quantization (``--isq``): float checkpoint weights packed into a GGUF block type at load.

Each projection is quantized to GGUF block bytes row by row (output channel by output channel,
blocks along the input axis, exactly as llama.cpp stores them) and then re-laid out like a GGUF
file's own tensors, so ``--isq q4_k`` and a Q4_K GGUF file run through the same packed path.
A k-quant needs input widths that are multiples of 256; like llama.cpp's quantizer, a narrower
projection falls back to a 32-block type of similar size (Q4_K -> Q5_0 ...), and one whose width
is not a multiple of 32 stays float.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jax_llm_runtime.pallas_kernels.dequant_matmul import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.gguf_blocks import from_gguf
from jax_llm_runtime.pallas_kernels.dequant_matmul.quantize import QUANT_TYPES, quantize_rows

T = GGMLQuantizationType
ISQ_TYPES = tuple(QUANT_TYPES)  # q4_0 q4_1 q5_0 q5_1 q8_0 q2k q3k q4k q5k q6k
# llama.cpp's tensor_type_fallback for rows that do not split into 256-value super-blocks.
FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def block_type(name: str, in_features: int) -> GGMLQuantizationType | None:
    """The GGUF type ``--isq name`` gives a projection of ``in_features`` inputs (None: float)."""
    qtype = QUANT_TYPES[name]
    if in_features % GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype, qtype)
    return qtype if in_features % GGML_QUANT_SIZES[qtype][0] == 0 else None


def packer(name: str) -> Callable[[np.ndarray], HostPacked | np.ndarray]:
    """A function from a float ``[in, out]`` weight to its ``--isq name`` packed form."""
    if name not in QUANT_TYPES:
        raise ValueError(f"--isq must be one of {', '.join(ISQ_TYPES)}, got {name!r}")

    def pack(weight: np.ndarray) -> HostPacked | np.ndarray:  # [in, out]
        qtype = block_type(name, weight.shape[-2])
        if qtype is None:
            return weight
        rows = np.ascontiguousarray(np.swapaxes(weight, -1, -2), dtype=np.float32)
        raw = quantize_rows(rows.reshape(-1, rows.shape[-1]), qtype)
        return from_gguf(raw.reshape(*rows.shape[:-1], -1), qtype, rows.shape[-1])

    return pack
