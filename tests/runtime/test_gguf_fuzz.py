"""Fuzz the GGUF reader and loader with structure-aware mutations of a real file.

A small llama GGUF (``gguf_fuzz_base``: tokenizer arrays, F32/F16 and seven block types), whole
or as two gguf-split shards, is walked once to find every header field. Hypothesis then rewrites
counts, lengths, type ids, dims, offsets and the alignment, re-encodes metadata values with other
types, truncates the file, or flips bytes. Each mutated file must load, or fail with a one-line
``GGUFError`` (``ValueError`` from the model config; ``runtime-serve`` prints either as one
line), within a second and a bounded allocation, through the path ``--model-id file.gguf`` takes
as far as it goes without building a model: header, checkpoint (config and tensor plan), every
tensor (packed, or dequantized) and the model config. Tokenizer building (transformers) is left
out: seconds per case.

What the fuzz found is kept below as plain cases, so that a fix cannot regress unnoticed when the
examples hypothesis draws change.
"""

from __future__ import annotations

import re
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_llm_runtime.models.registry import model_config_from_hf
from jax_llm_runtime.runtime.loading.gguf.loader import (
    GGUFError,
    load_gguf_checkpoint,
    read_gguf_header,
)
from tests.runtime.gguf_fuzz_base import (
    ALIGNMENT,
    ARRAY,
    FIELD_KINDS,
    FORMATS,
    STRING,
    TENSORS,
    TOKENS,
    TYPE_FIELDS,
    WIDTHS,
    Field,
    Layout,
    walk,
    with_metadata,
    write_base_gguf,
)

TIME_LIMIT_S = 1.0
# The file is 0.35 MB and loads within ~1 MiB; an allocation sized by a crafted count is far larger.
MEMORY_LIMIT = 64 << 20
MAX_MESSAGE = 400  # characters of an error message, besides the file's path


# ---- running one case ----------------------------------------------------------------------------


def load_like_cli(path: Path, packed: bool = True) -> ValueError | None:
    """What ``runtime-serve --model-id path`` does with a GGUF before it builds the model (which
    keeps block types packed unless ``packed`` is False); the clean error it reports, or None
    when everything loads."""
    try:
        read_gguf_header(path)
        checkpoint = load_gguf_checkpoint(path)
        for _name, _array in checkpoint.tensors(packed=packed):
            pass
    except GGUFError as e:
        return e
    try:
        model_config_from_hf(checkpoint.config)
    except ValueError as e:
        return e
    return None


def measured(fn: Callable[[], object]) -> tuple[object, float, int]:
    """``fn()``'s result, its wall time in seconds and its peak traced allocation in bytes."""
    started = not tracemalloc.is_tracing()  # python -X tracemalloc traces already
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    before, _ = tracemalloc.get_traced_memory()
    start = time.perf_counter()
    try:
        result = fn()
    finally:
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        if started:
            tracemalloc.stop()
    return result, elapsed, peak - before


def check_case(path: Path, data: bytes, packed: bool) -> ValueError | None:
    """Load ``data`` written to ``path``: a clean error or none, in time and memory."""
    path.write_bytes(data)
    error, elapsed, peak = measured(lambda: load_like_cli(path, packed))
    assert elapsed < TIME_LIMIT_S, f"took {elapsed:.2f} s"
    assert peak < MEMORY_LIMIT, f"allocated {peak / 2**20:.0f} MiB"
    if error is not None:
        message = str(error)
        assert "\n" not in message and "\r" not in message, message
        assert len(message.replace(str(path), "")) <= MAX_MESSAGE, message[:1000]
    return error


class Base:
    """A valid file, its layout, and where its mutated copies are written. Not a dataclass, whose
    fields (a third of a megabyte) hypothesis would print for a failing case."""

    def __init__(self, data: bytes, layout: Layout, case: Path) -> None:
        self.data, self.layout, self.case = data, layout, case

    def __repr__(self) -> str:
        return f"Base({len(self.data)} bytes)"


def _bases(folder: Path, split_max_tensors: int = 0) -> tuple[Base, ...]:
    files = write_base_gguf(folder / "base.gguf", split_max_tensors)
    load_like_cli(files[0], packed=False)  # imports and first calls stay out of the cases
    data = [f.read_bytes() for f in files]
    cases = [f.with_name(f.name.replace("base", "case")) for f in files]
    return tuple(Base(d, walk(d), c) for d, c in zip(data, cases, strict=True))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    (single,) = _bases(tmp_path_factory.mktemp("gguf_fuzz"))
    return single


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Base, ...]:
    """The base model in two gguf-split shards; the first holds the metadata."""
    return _bases(tmp_path_factory.mktemp("gguf_fuzz_split"), split_max_tensors=7)


# ---- strategies ----------------------------------------------------------------------------------

FUZZ = settings(
    max_examples=300,
    deadline=1000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Both ways of reading the blocks, one per case: dequantizing every one costs most of a case.
PACKED = st.booleans()
# Keys the loader reads that the base file lacks.
EXTRA_KEYS = (
    "split.count",
    "split.no",
    "split.tensors.count",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.rope.scaling.original_context_length",
    "llama.attention.key_length",
    "llama.expert_count",
    "llama.expert_used_count",
    "tokenizer.ggml.padding_token_id",
)
_EDGE_INTS = (0, 1, 2, 3, 4, 7, 64, 256, -1, -(2**31), 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1)
_EDGE_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-6, 1e30, float("nan"), float("inf"), -float("inf"))


def new_value(field: Field, file_size: int) -> st.SearchStrategy[int]:
    """Values worth trying in ``field``: edges of its width, the file size, near the old value."""
    top = 1 << (8 * field.width)
    near = [field.value + d for d in (-1, 1, -8, 8, 32, file_size)] + [field.value * 2]
    sizes = [file_size - 1, file_size, file_size + 1, file_size // 2, file_size - field.offset]
    powers = [(1 << b) + d for b in (8, 16, 31, 32, 53, 62, 63, 64) for d in (-1, 0, 1)]
    edges = sorted({v % top for v in [*range(10), 31, 32, 33, 64, *near, *sizes, *powers]})
    choices = [st.sampled_from(edges), st.integers(0, top - 1)]
    if field.kind in TYPE_FIELDS:
        choices.append(st.integers(0, 45))
    return st.one_of(choices)


def mutate_field(data: bytearray, base: Base, draw: Callable, kinds: tuple[str, ...]) -> None:
    """Overwrite one field of one of ``kinds`` ("retype": a scalar type id to another scalar type
    of the same width, which keeps the layout parseable but changes what the value means)."""
    present = {f.kind for f in base.layout.fields} | {"retype"}
    kind = draw(st.sampled_from([k for k in kinds if k in present]))
    if kind == "retype":
        fields = [f for f in base.layout.fields if f.kind in ("value_type", "array_type")]
        field = draw(st.sampled_from([f for f in fields if f.value in WIDTHS]))
        width = WIDTHS[field.value]
        value = draw(st.sampled_from([t for t, w in WIDTHS.items() if w == width]))
    else:
        field = draw(st.sampled_from([f for f in base.layout.fields if f.kind == kind]))
        value = draw(new_value(field, len(base.data)))
    data[field.offset : field.offset + field.width] = value.to_bytes(field.width, "little")


def scalars(vtype: int) -> st.SearchStrategy[Any]:
    """Any value of a scalar type, edges (NaN, infinities, the integer limits) first."""
    fmt = FORMATS[vtype]
    if fmt in "fd":
        return st.one_of(st.sampled_from(_EDGE_FLOATS), st.floats(width=32 if fmt == "f" else 64))
    if fmt == "?":
        return st.booleans()
    bits = 8 * WIDTHS[vtype]
    low, high = (
        (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if fmt.islower() else (0, (1 << bits) - 1)
    )
    return st.one_of(
        st.sampled_from([v for v in _EDGE_INTS if low <= v <= high]), st.integers(low, high)
    )


def typed_values() -> st.SearchStrategy[tuple[int, Any]]:
    """``(value type, value)`` of every kind, kept short: the point is the type, not the size."""
    scalar_type = st.sampled_from(sorted(FORMATS))
    return st.one_of(
        scalar_type.flatmap(lambda t: scalars(t).map(lambda v: (t, v))),
        st.text(max_size=12).map(lambda v: (STRING, v)),
        scalar_type.flatmap(
            lambda t: st.lists(scalars(t), max_size=6).map(lambda vs: (ARRAY, (t, vs)))
        ),
        st.lists(st.text(max_size=8), max_size=4).map(lambda vs: (ARRAY, (STRING, vs))),
    )


def rewrite_metadata(data: bytes, draw: Callable) -> bytes:
    """One metadata key (present or one the loader reads) set to a value of any type."""
    layout = walk(data)
    key = draw(st.sampled_from(sorted(layout.entries) + list(EXTRA_KEYS)), label="key")
    vtype, value = draw(typed_values(), label="value")
    return with_metadata(data, layout, key, vtype, value)


# ---- the fixture and the harness ----------------------------------------------------------------


def test_base_file_is_valid_and_walked(base: Base, tmp_path: Path) -> None:
    """The walker agrees with our reader and gguf's own, the encoder rewrites a value to the same
    bytes, and the base file loads without error."""
    path = tmp_path / "base.gguf"
    path.write_bytes(base.data)
    header = read_gguf_header(path)
    reference = gguf.GGUFReader(path)
    assert [t.name for t in header.tensors] == [t.name for t in reference.tensors] == list(TENSORS)
    assert [t.offset for t in header.tensors] == [int(t.data_offset) for t in reference.tensors]
    data_start = header.tensors[0].offset - base.layout.tensor_offsets[0]
    assert data_start == -(-base.layout.header_end // ALIGNMENT) * ALIGNMENT
    assert {f.kind for f in base.layout.fields} == set(FIELD_KINDS)
    assert base.layout.entries.keys() == header.metadata.keys()
    assert header.metadata["tokenizer.ggml.tokens"] == tuple(TOKENS)
    assert with_metadata(base.data, base.layout, "llama.block_count", 4, 1) == base.data
    assert load_like_cli(path, packed=True) is None
    assert load_like_cli(path, packed=False) is None


def test_measurement_sees_large_allocations_and_time() -> None:
    """The memory and time limits can fail: numpy buffers are traced, and time is wall time."""
    _, _, peak = measured(lambda: np.ones(2 * MEMORY_LIMIT, np.uint8).sum())
    assert peak >= 2 * MEMORY_LIMIT
    _, elapsed, _ = measured(lambda: time.sleep(0.05))
    assert elapsed >= 0.05


# ---- what the fuzz found, kept as plain cases --------------------------------------------------


def set_field(base: Base, kind: str, index: int, value: int) -> bytes:
    """``base`` with the ``index``-th field of ``kind`` set to ``value``."""
    field = [f for f in base.layout.fields if f.kind == kind][index]
    data = bytearray(base.data)
    data[field.offset : field.offset + field.width] = value.to_bytes(field.width, "little")
    return bytes(data)


def test_quantized_vector_is_dequantized_when_packing(base: Base) -> None:
    """A 1-D tensor in a block type went to the packer, which needs rows (ValueError in unpack)."""
    norm = list(TENSORS).index("blk.0.attn_norm.weight")
    assert (
        check_case(
            base.case,
            set_field(base, "ggml_type", norm, gguf.GGMLQuantizationType.Q4_0),
            packed=True,
        )
        is None
    )
    tensors = dict(load_gguf_checkpoint(base.case).tensors(packed=True))
    array = tensors["model.layers.0.input_layernorm.weight"]
    assert isinstance(array, np.ndarray) and array.shape == (256,)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        # The key ran into the bytes after it and was printed whole.
        pytest.param(
            lambda b: set_field(b, "key_length", 0, 185),
            r"'general\.architecture.*\.\.\.",
            id="long key",
        ),
        # The reader took any integer type; llama.cpp and gguf-py require uint32.
        pytest.param(
            lambda b: with_metadata(b.data, b.layout, "general.alignment", 5, 64),
            "general.alignment must be a uint32",
            id="int32 alignment",
        ),
        # numpy's repr of the array spans two lines.
        pytest.param(
            lambda b: with_metadata(b.data, b.layout, "general.architecture", ARRAY, (4, [7] * 9)),
            r"architecture \[7, 7, 7, 7, 7, 7, 7, 7, 7\] is not supported",
            id="array architecture",
        ),
    ],
)
def test_found_errors(base: Base, mutate: Callable[[Base], bytes], message: str) -> None:
    error = check_case(base.case, mutate(base), packed=True)
    assert isinstance(error, GGUFError)
    assert re.search(message, str(error)), str(error)


@pytest.mark.parametrize("key", ["split.count", "split.no", "split.tensors.count"])
def test_split_metadata_that_is_not_an_integer(shards: tuple[Base, ...], key: str) -> None:
    """An array in split.* metadata was compared like an int: "the truth value of an array is
    ambiguous" instead of a GGUFError."""
    first = with_metadata(shards[0].data, shards[0].layout, key, ARRAY, (2, [0, 1]))
    shards[1].case.write_bytes(shards[1].data)
    error = check_case(shards[0].case, first, packed=True)
    assert isinstance(error, GGUFError)
    assert re.search(rf"{re.escape(key)} must be an integer >= \d, got \[0, 1\]", str(error))


@pytest.mark.parametrize("key", ["llama.context_length", "llama.expert_count"])
def test_infinite_size_in_metadata(base: Base, key: str) -> None:
    data = with_metadata(base.data, base.layout, key, 6, float("inf"))  # float32
    assert isinstance(check_case(base.case, data, packed=True), ValueError)


# ---- the properties ------------------------------------------------------------------------------


# Fields whose new value leaves the header parseable, so the case reaches the loader's checks.
VALUE_KINDS = ("scalar", "alignment", "retype", "dim", "ggml_type", "data_offset")


@pytest.mark.parametrize("kinds", [FIELD_KINDS, VALUE_KINDS], ids=["any_field", "values_only"])
@FUZZ
@given(data=st.data())
def test_mutated_header_fields(base: Base, kinds: tuple[str, ...], data: st.DataObject) -> None:
    mutated = bytearray(base.data)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        mutate_field(mutated, base, data.draw, kinds)
    check_case(base.case, bytes(mutated), data.draw(PACKED, label="packed"))


@FUZZ
@given(st.data())
def test_rewritten_metadata(base: Base, data: st.DataObject) -> None:
    mutated = base.data
    for _ in range(data.draw(st.integers(1, 3), label="rewrites")):
        mutated = rewrite_metadata(mutated, data.draw)
    check_case(base.case, mutated, data.draw(PACKED, label="packed"))


@FUZZ
@given(st.data())
def test_truncated_file(base: Base, data: st.DataObject) -> None:
    bounds = {b for f in base.layout.fields for b in (f.offset, f.offset + f.width)}
    bounds |= {base.layout.header_end + d for d in range(-2, 80)}
    cut = data.draw(
        st.one_of(
            st.sampled_from(sorted(bounds)).map(lambda b: max(0, b - 1)),
            st.sampled_from(sorted(bounds)),
            st.integers(0, len(base.data) - 1),
        ),
        label="cut",
    )
    mutated = bytearray(base.data)
    if data.draw(st.booleans(), label="also mutate a field"):
        mutate_field(mutated, base, data.draw, FIELD_KINDS)
    check_case(base.case, bytes(mutated[:cut]), data.draw(PACKED, label="packed"))


@FUZZ
@given(st.data())
def test_flipped_bytes(base: Base, data: st.DataObject) -> None:
    mutated = bytearray(base.data)
    header = st.integers(0, base.layout.header_end - 1)
    anywhere = st.integers(0, len(base.data) - 1)
    for _ in range(data.draw(st.integers(1, 8), label="flips")):
        position = data.draw(st.one_of(header, header, anywhere), label="position")
        mutated[position] ^= data.draw(st.integers(1, 255), label="xor")
    check_case(base.case, bytes(mutated), data.draw(PACKED, label="packed"))


@FUZZ
@given(st.data())
def test_mutated_split_shards(shards: tuple[Base, ...], data: st.DataObject) -> None:
    """Either shard of a split model, rewritten and then mutated, loaded through the first (split.*
    metadata, the shard names, tensors spread over two files)."""
    assert [s.case.name for s in shards] == ["case-00001-of-00002.gguf", "case-00002-of-00002.gguf"]
    files = [s.data for s in shards]
    index = data.draw(st.integers(0, len(shards) - 1), label="shard")
    for _ in range(data.draw(st.integers(0, 2), label="rewrites")):
        files[index] = rewrite_metadata(files[index], data.draw)
    rewritten = Base(files[index], walk(files[index]), shards[index].case)
    mutated = bytearray(rewritten.data)
    for _ in range(data.draw(st.integers(0, 2), label="mutations")):
        mutate_field(mutated, rewritten, data.draw, (*FIELD_KINDS, "retype", "retype"))
    files[index] = bytes(mutated)
    shards[1].case.write_bytes(files[1])
    check_case(shards[0].case, files[0], data.draw(PACKED, label="packed"))
