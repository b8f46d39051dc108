"""The GGUF container: a bounds-checked header parser and per-tensor dequantization.

``read_gguf_header`` walks the header with ``struct`` over an mmap, checking every count, length
and offset against the file size with Python integers before anything is allocated. (gguf's own
``GGUFReader`` loops forever on an array count that runs past the end of the file and spends
seconds building a numpy view per vocabulary entry.) Whatever the file holds, the result is a
header or a one-line GGUFError (text from the file goes through ``short_repr``);
``tests/runtime/test_gguf_fuzz.py`` holds it to that. What the tensors mean is not this module's
business: ``gguf_loader`` turns a header into an HF checkpoint.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Mapping
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
MAX_NAME_BYTES = 63  # llama.cpp rejects tensor names of GGML_MAX_NAME (64) bytes or more
_MIN_FILE_BYTES = 24  # magic, version, tensor count, metadata count
# Large vocabularies (Gemma: 262k tokens + scores + types) stay far below this; a crafted file with
# tens of millions of tiny array items would otherwise cost gigabytes of Python objects.
MAX_METADATA_ITEMS = 1 << 23
# llama.cpp's gguf-split file names; shard k of n carries split.no = k - 1 and split.count = n.
SHARD_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")

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


class _Cursor:
    """Reads little-endian fields from a buffer, checking each length against its size first.

    ``what`` names the field in errors; callers pass it through ``short_repr`` when it holds text
    read from the file."""

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

    def string(self, what: str, max_bytes: int | None = None) -> str:
        length = self.scalar(GGUFValueType.UINT64, what)
        if max_bytes is not None and length > max_bytes:
            raise GGUFError(
                f"{what} at byte {self.pos - 8} is {length} bytes long, at most {max_bytes} allowed"
            )
        start = self.take(length, what)
        try:
            return self.buf[start : self.pos].decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what}: string at byte {start} is not UTF-8") from e

    def value(self, vtype: int, key: str) -> Any:
        what = f"metadata {short_repr(key)}"
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype != GGUFValueType.ARRAY:
            raise GGUFError(f"{what} has unknown value type {vtype}")
        item_type = self.scalar(GGUFValueType.UINT32, what)
        count = self.scalar(GGUFValueType.UINT64, what)
        self.items_left -= count
        if self.items_left < 0:
            raise GGUFError(f"metadata array {short_repr(key)} is too long ({count} items)")
        if item_type == GGUFValueType.STRING:
            return tuple(self.string(what) for _ in range(count))
        if item_type not in _SCALARS:
            raise GGUFError(
                f"metadata array {short_repr(key)} has unsupported item type {item_type}"
            )
        layout = _SCALARS[GGUFValueType(item_type)]
        start = self.take(count * layout.size, what)
        return np.frombuffer(self.buf, np.dtype(layout.format), count, start).copy()


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for a one-line error message, cut after about ``limit`` characters: keys
    and values read from a crafted file can be megabytes long."""
    if isinstance(value, np.ndarray):  # numpy's own repr wraps lines
        value = value.ravel()[: limit + 1].tolist()
    if isinstance(value, (str, tuple, list)) and len(value) > limit:
        return repr(value[:limit])[:limit] + "..."
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse and bounds-check a GGUF header. Raises GGUFError for anything malformed or truncated,
    or a file that cannot be read."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _MIN_FILE_BYTES:  # also: mmap cannot map an empty file
                raise GGUFError(f"not a GGUF file (only {size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse_header(_Cursor(buf, len(buf)))
    except OSError as e:
        raise GGUFError(f"cannot read GGUF file {path}: {e}") from e
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from e


def _parse_header(cur: _Cursor) -> GGUFHeader:
    if cur.buf[:4] != GGUF_MAGIC:
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
            raise GGUFError(f"duplicate metadata key {short_repr(key)}")
        vtype = cur.scalar(GGUFValueType.UINT32, f"metadata {short_repr(key)}")
        if key == "general.alignment" and vtype != GGUFValueType.UINT32:
            raise GGUFError(f"general.alignment must be a uint32, has value type {vtype}")
        metadata[key] = cur.value(vtype, key)
    raw = [_read_tensor_info(cur) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment == 0 or alignment & (alignment - 1):
        raise GGUFError(f"general.alignment must be a power of two, got {alignment}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for name, shape, qtype, offset, nbytes in raw:
        if name in names:
            raise GGUFError(f"duplicate tensor {name!r}")
        names.add(name)
        if offset % alignment:
            raise GGUFError(
                f"tensor {name!r} data offset {offset} is not a multiple of the alignment "
                f"{alignment}"
            )
        start = data_start + offset
        if start + nbytes > cur.size:
            raise GGUFError(
                f"tensor {name!r} data [{start}, {start + nbytes}) runs past the end of the file "
                f"({cur.size} bytes); the file may be truncated"
            )
        tensors.append(GGUFTensorInfo(name, shape, qtype, start, nbytes))
    return GGUFHeader(version, metadata, tuple(tensors))


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]:
    name = cur.string("tensor name", max_bytes=MAX_NAME_BYTES)
    what = f"tensor {name!r}"
    n_dims = cur.scalar(GGUFValueType.UINT32, what)
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"{what} has {n_dims} dims, expected 1..{MAX_DIMS}")
    dims = [cur.scalar(GGUFValueType.UINT64, what) for _ in range(n_dims)]
    raw_type = cur.scalar(GGUFValueType.UINT32, what)
    offset = cur.scalar(GGUFValueType.UINT64, what)
    try:
        qtype = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as e:
        raise GGUFError(f"{what} has unknown ggml type {raw_type}") from e
    if min(dims) < 1 or dims[0] % block_size:
        raise GGUFError(f"{what} has invalid dims {dims} for type {qtype.name}")
    nbytes = math.prod(dims) // block_size * type_size
    return name, tuple(reversed(dims)), qtype, offset, nbytes


def raw_rows(
    data: np.ndarray,  # [file_bytes] uint8, the whole file memory-mapped
    info: GGUFTensorInfo,
) -> np.ndarray:  # uint8 [*info.shape[:-1], row_bytes], owning its memory
    """One quantized tensor's block bytes, one row of blocks per innermost-dimension row."""
    raw = data[info.offset : info.offset + info.nbytes]
    return np.array(raw.reshape(quant_shape_to_byte_shape(info.shape, info.qtype)))


def dequantize_tensor(
    data: np.ndarray,  # [file_bytes] uint8, the whole file memory-mapped
    info: GGUFTensorInfo,
) -> np.ndarray:  # info.shape float32, owning its memory
    """One tensor as float32 in numpy order. Raises GGUFError for a type gguf cannot dequantize."""
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
