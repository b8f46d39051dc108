"""Write a GGUF file whose projections are re-quantized to one block type, as ``--isq`` does.

The output is what ``runtime-serve --isq <type>`` runs, as a file llama.cpp also loads: every
metadata key and every other tensor is copied unchanged; each layer projection (attention q, k,
v, output and fused qkv; MLP gate, up, down, for experts and shared experts too) is dequantized
and quantized again with ``pallas_kernels.dequant_matmul.quantize`` (llama.cpp's bytes), with
llama.cpp's fallback for widths that a k-quant does not divide (``models.isq.block_type``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize

from jax_llm_runtime.models.isq import block_type
from jax_llm_runtime.pallas_kernels.dequant_matmul.quantize import quantize_rows

# The tensors ``--isq`` quantizes: the same projections as models.decoder's packed fields.
PROJECTIONS = re.compile(
    r"blk\.\d+\.(attn_(q|k|v|qkv|output|q_a|q_b|kv_a_mqa)|ffn_(gate|up|down)(_exps|_shexp)?)"
    r"\.weight"
)
_SKIPPED_FIELDS = ("GGUF.", gguf.Keys.General.ARCHITECTURE)
FILE_TYPES = {
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q2k": gguf.LlamaFileType.MOSTLY_Q2_K,
    "q3k": gguf.LlamaFileType.MOSTLY_Q3_K_S,
    "q4k": gguf.LlamaFileType.MOSTLY_Q4_K_S,
    "q5k": gguf.LlamaFileType.MOSTLY_Q5_K_S,
    "q6k": gguf.LlamaFileType.MOSTLY_Q6_K,
}


@dataclass(frozen=True)
class QuantizedTensor:
    """One tensor of the output: its name and type, and whether it was re-quantized."""

    name: str
    qtype: gguf.GGMLQuantizationType
    requantized: bool


def requantize_gguf(source: Path, target: Path, isq: str) -> list[QuantizedTensor]:
    """Copy ``source`` to ``target`` with its projections quantized to ``isq``; returns what
    each tensor became. Raises ValueError for an unknown type or an existing target."""
    if isq not in FILE_TYPES:
        raise ValueError(f"type must be one of {', '.join(FILE_TYPES)}, got {isq!r}")
    if Path(target).exists():
        raise ValueError(f"{target} exists; choose a new file name")
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name.startswith(_SKIPPED_FIELDS) or field.name == gguf.Keys.General.FILE_TYPE:
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(FILE_TYPES[isq])
    report = []
    for name, data, qtype, requantized in _tensors(reader, isq):
        writer.add_tensor(name, data, raw_dtype=qtype)
        report.append(QuantizedTensor(name, qtype, requantized))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return report


def _tensors(
    reader: gguf.GGUFReader, isq: str
) -> Iterator[tuple[str, np.ndarray, gguf.GGMLQuantizationType, bool]]:
    """(name, data as the writer takes it, type, re-quantized) for every tensor in file order."""
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # numpy order
        qtype = block_type(isq, shape[-1]) if PROJECTIONS.fullmatch(tensor.name) else None
        if qtype is None:
            yield tensor.name, np.asarray(tensor.data), tensor.tensor_type, False
            continue
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(-1, shape[-1])
        rows = quantize_rows(values.astype(np.float32), qtype)
        yield tensor.name, rows.reshape(*shape[:-1], -1), qtype, True
