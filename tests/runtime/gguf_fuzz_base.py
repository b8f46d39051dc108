"""The file the GGUF fuzz test mutates, and a walker and an encoder for its header.

``write_base_gguf`` writes a small but complete llama GGUF the way llama.cpp's converter lays one
out: a tokenizer (string, int32 and float32 arrays, a chat template), F32/F16 tensors and seven
block types, ``general.alignment`` 64. ``walk`` is an independent parser of a valid file that
records where each header field lives, so that mutations hit real fields; ``with_metadata``
re-encodes one metadata entry with any type and value, keeping the rest of the file valid.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jax_llm_runtime.pallas_kernels.dequant_matmul.quantize import quantize_rows
from tests.models.gguf_writer_metadata import llama_metadata

ALIGNMENT = 64  # the base file's general.alignment (not the default, so that it matters)
_Q = gguf.GGMLQuantizationType
_HP = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,  # a multiple of 256, so every block type fits a row
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 48,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
TENSORS = {  # GGUF name: (numpy shape, type)
    "token_embd.weight": ((48, 256), _Q.Q4_K),
    "rope_freqs.weight": ((32,), _Q.F32),
    "blk.0.attn_norm.weight": ((256,), _Q.F32),
    "blk.0.attn_q.weight": ((256, 256), _Q.Q8_0),
    "blk.0.attn_k.weight": ((128, 256), _Q.Q5_K),
    "blk.0.attn_v.weight": ((128, 256), _Q.F16),
    "blk.0.attn_output.weight": ((256, 256), _Q.Q4_0),
    "blk.0.ffn_norm.weight": ((256,), _Q.F32),
    "blk.0.ffn_gate.weight": ((256, 256), _Q.Q4_1),
    "blk.0.ffn_up.weight": ((256, 256), _Q.Q5_0),
    "blk.0.ffn_down.weight": ((256, 256), _Q.Q6_K),
    "output_norm.weight": ((256,), _Q.F32),
    "output.weight": ((48, 256), _Q.Q3_K),
}
TOKENS = ["<unk>", "<s>", "</s>", "é", "ĠĠ", "\n"] + [chr(c) for c in range(97, 123)]
TOKENS += [a + b for a, b in zip("abcdefghijklmnop", "qrstuvwxyzabcdef", strict=True)]


def write_base_gguf(path: Path, split_max_tensors: int = 0) -> list[Path]:
    """A valid tiny llama GGUF laid out as llama.cpp's converter writes one, with a tokenizer;
    with ``split_max_tensors``, the gguf-split shards ``<stem>-0000k-of-0000n.gguf``. Returns the
    files written."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama", split_max_tensors=split_max_tensors)
    writer.add_name("fuzz-base")
    writer.add_custom_alignment(ALIGNMENT)
    llama_metadata(writer, _HP)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_token_scores([-float(i) for i in range(len(TOKENS))])
    writer.add_token_merges(["a b", "ab c", "Ġ Ġ"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    for name, (shape, qtype) in TENSORS.items():
        array = rng.standard_normal(shape, dtype=np.float32)
        if name == "rope_freqs.weight":
            writer.add_tensor(name, np.ones(shape, np.float32))
        elif qtype in (_Q.F32, _Q.F16):
            writer.add_tensor(name, array.astype(np.float32 if qtype == _Q.F32 else np.float16))
        else:
            writer.add_tensor(name, quantize_rows(array, qtype), raw_dtype=qtype)
    files = writer.format_shard_names(path)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return files


# ---- where each header field lives ----------------------------------------------------------------

STRING, ARRAY = 8, 9
FORMATS = {  # GGUF value type -> struct format, for the scalar types
    **{0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?"},
    **{10: "Q", 11: "q", 12: "d"},
}
WIDTHS = {vtype: struct.calcsize(fmt) for vtype, fmt in FORMATS.items()}
# Fields whose value names a type; besides arbitrary values they get every small id.
TYPE_FIELDS = ("value_type", "array_type", "ggml_type")
FIELD_KINDS = (
    "version",
    "tensor_count",
    "kv_count",
    "key_length",
    "value_type",
    "string_length",
    "array_type",
    "array_count",
    "scalar",
    "alignment",
    "name_length",
    "n_dims",
    "dim",
    "ggml_type",
    "data_offset",
)


@dataclass(frozen=True)
class Field:
    kind: str  # one of FIELD_KINDS
    offset: int  # bytes from the start of the file
    width: int  # bytes
    value: int  # as the walked file has it (floats as their bits)


@dataclass(frozen=True)
class Layout:
    fields: tuple[Field, ...]
    entries: dict[str, tuple[int, int]]  # metadata key -> [start, end) of its whole entry
    infos_start: int  # where the tensor infos begin
    header_end: int  # where the last tensor info ends
    tensor_offsets: tuple[int, ...]  # data offsets as stored (relative to the data section)


class _Walker:
    """An independent GGUF header parser that records each field's position; valid files only."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.fields = data, 0, []

    def int(self, kind: str, width: int) -> int:
        value = int.from_bytes(self.data[self.pos : self.pos + width], "little")
        self.fields.append(Field(kind, self.pos, width, value))
        self.pos += width
        return value

    def string(self, kind: str) -> str:
        length = self.int(kind, 8)
        self.pos += length
        return self.data[self.pos - length : self.pos].decode()

    def value(self, vtype: int, key: str) -> None:
        if vtype == STRING:
            self.string("string_length")
        elif vtype == ARRAY:
            item_type, count = self.int("array_type", 4), self.int("array_count", 8)
            if item_type == STRING:
                for _ in range(count):
                    self.string("string_length")
            else:
                self.pos += count * WIDTHS[item_type]
        else:
            self.int("alignment" if key == "general.alignment" else "scalar", WIDTHS[vtype])


def walk(data: bytes) -> Layout:
    w = _Walker(data)
    w.pos = 4  # magic
    w.int("version", 4)
    tensor_count, kv_count = w.int("tensor_count", 8), w.int("kv_count", 8)
    entries = {}
    for _ in range(kv_count):
        start = w.pos
        key = w.string("key_length")
        w.value(w.int("value_type", 4), key)
        entries[key] = (start, w.pos)
    infos_start, offsets = w.pos, []
    for _ in range(tensor_count):
        w.string("name_length")
        for _ in range(w.int("n_dims", 4)):
            w.int("dim", 8)
        w.int("ggml_type", 4)
        offsets.append(w.int("data_offset", 8))
    return Layout(tuple(w.fields), entries, infos_start, w.pos, tuple(offsets))


def encode(vtype: int, value: Any) -> bytes:
    """A metadata value's bytes; an array is ``(item_type, items)``."""
    if vtype == STRING:
        raw = value.encode()
        return struct.pack("<Q", len(raw)) + raw
    if vtype == ARRAY:
        item_type, items = value
        body = b"".join(encode(item_type, item) for item in items)
        return struct.pack("<IQ", item_type, len(items)) + body
    return struct.pack("<" + FORMATS[vtype], value)


def with_metadata(data: bytes, layout: Layout, key: str, vtype: int, value: Any) -> bytes:
    """``data`` (a valid file, walked to ``layout``) with ``key`` set to a value of ``vtype``, the
    rest unchanged: the tensor data moves to the next ``ALIGNMENT`` boundary after the header."""
    entry = encode(STRING, key) + struct.pack("<I", vtype) + encode(vtype, value)
    entries = {k: data[start:end] for k, (start, end) in layout.entries.items()} | {key: entry}
    header = data[:16] + struct.pack("<Q", len(entries)) + b"".join(entries.values())
    header += data[layout.infos_start : layout.header_end]
    data_start = -(-layout.header_end // ALIGNMENT) * ALIGNMENT
    return header + bytes(-len(header) % ALIGNMENT) + data[data_start:]
