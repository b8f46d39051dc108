"""GGUF files to an HF-style config and HF-named float32 tensors.

1. ``read_gguf_header`` walks the header with ``struct`` over an mmap, checking every count, length
   and offset against the file size with Python integers before anything is allocated. (gguf's own
   ``GGUFReader`` loops forever on an array count that runs past the end of the file and spends
   seconds building a numpy view per vocabulary entry.)
2. A per-architecture table maps ``<arch>.*`` metadata keys to HF ``config.json`` keys and GGUF
   tensor names to HF parameter names. Adding an architecture means adding a table.
3. ``Checkpoint.tensors()`` memory-maps the file again and yields one dequantized tensor at a time,
   HF-shaped (``[out_features, in_features]`` for linear weights) and HF-ordered.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# Large vocabularies (Gemma: 262k tokens + scores + types) stay far below this; a crafted file with
# tens of millions of tiny array items would otherwise cost gigabytes of Python objects.
MAX_METADATA_ITEMS = 1 << 23

_SCALARS = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}


class GGUFError(ValueError):
    """The file is not a GGUF model this runtime can load; the message names the offending part."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file. ``shape`` is numpy order (GGUF lists dims reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Everything before the tensor data. Numeric metadata arrays are numpy arrays, string arrays
    are tuples of str."""

    version: int
    metadata: Mapping[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]


@dataclass(frozen=True)
class Checkpoint:
    """An HF ``config.json``-style dict and a factory that streams ``(hf_name, array)`` pairs.

    Each ``tensors()`` call starts a fresh pass; ``num_tensors`` is how many pairs one pass yields.
    """

    config: dict[str, Any]
    tensors: Callable[[], Iterator[tuple[str, np.ndarray]]]
    num_tensors: int


class _Cursor:
    """Reads little-endian fields from a buffer, checking each length against its size first."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0
        self.items_left = MAX_METADATA_ITEMS

    def take(self, n: int, what: str) -> int:
        if self.pos + n > self.size:
            raise GGUFError(
                f"truncated GGUF file: {what} at byte {self.pos} needs {n} bytes, "
                f"the file has {self.size}"
            )
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, vtype: int, what: str) -> Any:
        layout = _SCALARS[GGUFValueType(vtype)]
        return layout.unpack_from(self.buf, self.take(layout.size, what))[0]

    def string(self, what: str) -> str:
        start = self.take(self.scalar(GGUFValueType.UINT64, what), what)
        try:
            return self.buf[start : self.pos].decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what}: string at byte {start} is not UTF-8") from e

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, key)
        if vtype == GGUFValueType.STRING:
            return self.string(key)
        if vtype != GGUFValueType.ARRAY:
            raise GGUFError(f"metadata key {key!r} has unknown value type {vtype}")
        item_type = self.scalar(GGUFValueType.UINT32, key)
        count = self.scalar(GGUFValueType.UINT64, key)
        self.items_left -= count
        if self.items_left < 0:
            raise GGUFError(f"metadata array {key!r} is too long ({count} items)")
        if item_type == GGUFValueType.STRING:
            return tuple(self.string(key) for _ in range(count))
        if item_type not in _SCALARS:
            raise GGUFError(f"metadata array {key!r} has unsupported item type {item_type}")
        layout = _SCALARS[GGUFValueType(item_type)]
        start = self.take(count * layout.size, key)
        return np.frombuffer(self.buf, np.dtype(layout.format), count, start).copy()


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse and bounds-check a GGUF header. Raises GGUFError for anything malformed or truncated."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(_Cursor(buf, len(buf)))
    except (OSError, ValueError) as e:
        if isinstance(e, GGUFError):
            raise GGUFError(f"{path}: {e}") from e
        raise GGUFError(f"cannot read GGUF file {path}: {e}") from e


def _parse_header(cur: _Cursor) -> GGUFHeader:
    if cur.size < 24 or cur.buf[:4] != GGUF_MAGIC:
        raise GGUFError("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.scalar(GGUFValueType.UINT32, "version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (big-endian files are not supported)" if version & 0xFFFF == 0 else ""
        raise GGUFError(f"unsupported GGUF version {version}{hint}")
    tensor_count = cur.scalar(GGUFValueType.UINT64, "tensor count")
    kv_count = cur.scalar(GGUFValueType.UINT64, "metadata count")
    metadata: dict[str, Any] = {}
    # Each loop iteration consumes at least one byte or raises, so the loops are bounded by the
    # file size whatever the counts claim.
    for _ in range(kv_count):
        key = cur.string("metadata key")
        if key in metadata:
            raise GGUFError(f"duplicate metadata key {key!r}")
        metadata[key] = cur.value(cur.scalar(GGUFValueType.UINT32, key), key)
    raw = [_read_tensor_info(cur) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"general.alignment must be a power of two, got {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for name, shape, qtype, offset, nbytes in raw:
        if name in names:
            raise GGUFError(f"duplicate tensor {name!r}")
        names.add(name)
        if offset % alignment or data_start + offset + nbytes > cur.size:
            raise GGUFError(
                f"tensor {name!r} ({nbytes} bytes at data offset {offset}) is misaligned or "
                f"extends past the end of the file ({cur.size} bytes); the file may be truncated"
            )
        tensors.append(GGUFTensorInfo(name, shape, qtype, data_start + offset, nbytes))
    return GGUFHeader(version, metadata, tuple(tensors))


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]:
    name = cur.string("tensor name")
    n_dims = cur.scalar(GGUFValueType.UINT32, name)
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"tensor {name!r} has {n_dims} dims, expected 1..{MAX_DIMS}")
    dims = [cur.scalar(GGUFValueType.UINT64, name) for _ in range(n_dims)]
    raw_type = cur.scalar(GGUFValueType.UINT32, name)
    offset = cur.scalar(GGUFValueType.UINT64, name)
    try:
        qtype = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as e:
        raise GGUFError(f"tensor {name!r} has unknown ggml type {raw_type}") from e
    if min(dims) < 1 or dims[0] % block_size:
        raise GGUFError(f"tensor {name!r} has invalid dims {dims} for type {qtype.name}")
    nbytes = math.prod(dims) // block_size * type_size
    return name, tuple(reversed(dims)), qtype, offset, nbytes


@dataclass(frozen=True)
class _ArchSpec:
    """How one GGUF ``general.architecture`` maps onto an HF architecture."""

    hf_architecture: str
    model_type: str
    metadata: Mapping[str, str]  # key after "<arch>." -> HF config key
    required: tuple[str, ...]  # keys after "<arch>." that must be present
    defaults: Mapping[str, Any]
    global_tensors: Mapping[str, str]  # GGUF name -> HF name
    layer_tensors: Mapping[str, str]  # GGUF name after "blk.N." -> HF name after "model.layers.N."
    # llama.cpp's converter reorders q/k rows so that its rope can rotate adjacent pairs; HF
    # rotates the two halves of each head, so those rows are put back.
    permute_qk: bool


_LLAMA_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec(
        hf_architecture="LlamaForCausalLM",
        model_type="llama",
        metadata={
            "context_length": "max_position_embeddings",
            "block_count": "num_hidden_layers",
            "embedding_length": "hidden_size",
            "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads",
            "attention.key_length": "head_dim",
            "attention.layer_norm_rms_epsilon": "rms_norm_eps",
            "rope.freq_base": "rope_theta",
            "vocab_size": "vocab_size",
        },
        required=(
            "context_length",
            "block_count",
            "embedding_length",
            "feed_forward_length",
            "attention.head_count",
            "attention.layer_norm_rms_epsilon",
        ),
        defaults={"hidden_act": "silu", "rope_theta": 10000.0, "attention_bias": False},
        global_tensors={
            "token_embd.weight": "model.embed_tokens.weight",
            "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight",
        },
        layer_tensors=_LLAMA_LAYER_TENSORS,
        permute_qk=True,
    ),
}

_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def load_gguf_checkpoint(path: Path) -> Checkpoint:
    """Read a GGUF model file into an HF-style config and a lazy stream of HF-named tensors.

    Every tensor name is mapped (and unknown ones rejected) here, before any weight is read.
    ``tensors()`` yields dequantized float32 numpy arrays in file order, one at a time, HF-shaped
    and HF-ordered. A tied model (no ``output.weight``) yields no ``lm_head.weight`` and has
    ``tie_word_embeddings`` True. Raises GGUFError.
    """
    header = read_gguf_header(path)
    arch = header.metadata.get("general.architecture")
    spec = _ARCHS.get(arch) if isinstance(arch, str) else None
    try:
        if spec is None:
            raise GGUFError(f"architecture {arch!r} is not supported ({', '.join(_ARCHS)} are)")
        config = _build_config(spec, arch, header)
        layers = config["num_hidden_layers"]
        names = {t.name: _hf_name(spec, arch, t.name, layers) for t in header.tensors}
        permute_heads = _permute_heads(header, config) if spec.permute_qk else {}
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from e

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for info in header.tensors:
            array = _dequantize(data, info)
            if heads := permute_heads.get(info.name):
                array = _unpermute_rope_rows(array, heads)
            yield names[info.name], array

    return Checkpoint(config=config, tensors=tensors, num_tensors=len(header.tensors))


def _build_config(spec: _ArchSpec, arch: str, header: GGUFHeader) -> dict[str, Any]:
    md = header.metadata
    missing = [f"{arch}.{key}" for key in spec.required if f"{arch}.{key}" not in md]
    if missing:
        raise GGUFError(f"GGUF metadata is missing required key(s): {', '.join(missing)}")
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        **spec.defaults,
    }
    for key, hf_key in spec.metadata.items():
        if f"{arch}.{key}" in md:
            config[hf_key] = md[f"{arch}.{key}"]
    config.update({hf: md[key] for key, hf in _TOKEN_ID_KEYS.items() if key in md})
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    _check_config(config)
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    tensor_shapes = {t.name: t.shape for t in header.tensors}
    if "vocab_size" not in config:
        tokens = md.get("tokenizer.ggml.tokens")
        embed = tensor_shapes.get("token_embd.weight", (0,))
        config["vocab_size"] = len(tokens) if tokens is not None else embed[0]
    config["tie_word_embeddings"] = "output.weight" not in tensor_shapes
    if scaling := _rope_scaling(md, arch):
        config["rope_scaling"] = scaling
    return config


def _check_config(config: dict[str, Any]) -> None:
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        if not isinstance(config[key], int) or config[key] < 1:
            raise GGUFError(f"GGUF metadata: {key} must be a positive integer, got {config[key]!r}")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise GGUFError(
            f"GGUF metadata: {config['num_attention_heads']} attention heads are not a multiple "
            f"of {config['num_key_value_heads']} key/value heads"
        )


def _hf_name(spec: _ArchSpec, arch: str, name: str, num_layers: int) -> str:
    if match := _LAYER_NAME.fullmatch(name):
        layer, rest = int(match[1]), match[2]
        if rest in spec.layer_tensors and layer < num_layers:
            return f"model.layers.{layer}.{spec.layer_tensors[rest]}"
    elif name in spec.global_tensors:
        return spec.global_tensors[name]
    hint = (
        " (llama3 rope frequency factors are not supported yet)"
        if name == "rope_freqs.weight"
        else ""
    )
    raise GGUFError(f"GGUF tensor {name!r} has no mapping for architecture {arch!r}{hint}")


def _permute_heads(header: GGUFHeader, config: dict[str, Any]) -> dict[str, int]:
    heads = {}
    for info in header.tensors:
        if info.name.endswith((".attn_q.weight", ".attn_k.weight")):
            key = "num_attention_heads" if ".attn_q." in info.name else "num_key_value_heads"
            if info.shape[0] % (2 * config[key]):
                raise GGUFError(
                    f"tensor {info.name!r} of shape {info.shape} does not split into {config[key]} heads"
                )
            heads[info.name] = config[key]
    return heads


def _rope_scaling(md: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise GGUFError(f"{arch}.rope.scaling.type {kind!r} is not supported (linear, yarn)")
    scaling = {"rope_type": kind, "factor": float(md.get(f"{arch}.rope.scaling.factor", 1.0))}
    if kind == "yarn":
        key = f"{arch}.rope.scaling.original_context_length"
        if key not in md:
            raise GGUFError(f"GGUF metadata is missing required key {key} for yarn rope scaling")
        scaling["original_max_position_embeddings"] = md[key]
    return scaling


def _dequantize(data: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    raw = data[info.offset : info.offset + info.nbytes]
    raw = raw.reshape(quant_shape_to_byte_shape(info.shape, info.qtype))
    try:
        array = dequantize(raw, info.qtype)
    except NotImplementedError as e:
        raise GGUFError(f"tensor {info.name!r}: cannot dequantize {info.qtype.name}") from e
    # F32 comes back as a view of the memmap; copy so callers never hold the file open.
    if np.may_share_memory(array, raw) or array.dtype != np.float32:
        array = np.array(array, dtype=np.float32)
    return array


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's ``permute``: within each head, GGUF row ``2*i + j`` is HF row
    ``j*half + i`` (HF keeps the two rotary halves apart, llama.cpp interleaves them)."""
    half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)
