"""Marlin-layout 4-bit checkpoints (candle-vllm, AutoGPTQ, vLLM): un-shuffled at load into the
``HostPacked`` their GPTQ or AWQ originals load to, bit for bit, and run against HF
transformers. Test folders are written by ``marlin_fixtures``' own forward packer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.gptq import pack_awq
from jax_llm_runtime.pallas_kernels.dequant_matmul.marlin import (
    awq_zeros_from_marlin,
    from_marlin,
)
from jax_llm_runtime.runtime.loading.hf_loader import HFCheckpointError, load_hf_checkpoint
from tests.models.gptq_awq_fixtures import (
    awq_config,
    gptq_config,
    quantize,
    random_ints,
    write_quantized_llama,
)
from tests.models.marlin_fixtures import (
    marlin_awq_zeros,
    pack_marlin,
    to_awq_marlin,
    to_marlin,
)

# Every projection's output a multiple of 64 (Marlin's runs), inputs of 256 and 512 rows.
LLAMA = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
K, N = 256, 128


def _nibble(b: np.ndarray, word: int, nibble: int) -> int:
    return int((b.view(np.uint32)[0, word] >> (4 * nibble)) & 15)


def test_layout_by_hand():
    """Single codes placed where the mma.m16n8k16 fragments put them: thread 0 holds rows 0, 1,
    8, 9 of column 0 (nibbles 0, 4, 1, 5 after the dequantizer's interleave) and of column 8;
    column 1 belongs to thread 4, whose 32 codes start at word 16."""
    for (row, col), (word, nibble) in {
        (0, 0): (0, 0),
        (1, 0): (0, 4),
        (8, 0): (0, 1),
        (9, 0): (0, 5),
        (0, 8): (0, 2),
        (0, 16): (1, 0),
        (0, 1): (16, 0),
        (2, 0): (4, 0),
    }.items():
        codes = np.zeros((16, 64), np.uint8)
        codes[row, col] = 5
        b, _ = pack_marlin(codes, np.ones((1, 64), np.float16), -1)
        assert _nibble(b, word, nibble) == 5, (row, col)
        assert np.count_nonzero(b) == 1
        assert np.argwhere(
            from_marlin(b, np.ones((1, 64), np.float16), group_size=-1).codes
        ).tolist() == [[row, col]]


@pytest.mark.parametrize("group_size", [32, 128, 256, -1])
def test_round_trip(group_size):
    """Grouped scales (several groups) and single ones (one group over ``in``, -1 or not)."""
    ints = random_ints(K, N, group_size, np.random.default_rng(group_size + 7), zeros=(8, 8))
    b, s = pack_marlin(ints.codes, ints.scales, group_size)
    assert b.shape == (K // 16, 2 * N) and b.dtype == np.int32 and s.shape == ints.scales.shape
    if group_size != 256:  # one row of 128 scales: only the shuffled order differs
        assert not np.array_equal(s, ints.scales)
    packed = from_marlin(b, s, group_size=group_size)
    np.testing.assert_array_equal(packed.codes, ints.codes)
    np.testing.assert_array_equal(packed.d, ints.scales)
    np.testing.assert_array_equal(packed.z, ints.zeros)
    assert packed.bits == 4 and packed.z.dtype == np.uint8 and packed.d.dtype == np.float16


def test_awq_zeros_round_trip():
    ints = random_ints(K, N, 32, np.random.default_rng(3))
    plain = pack_awq(ints.codes, ints.zeros, ints.scales, group_size=32).qzeros
    shuffled = marlin_awq_zeros(ints.zeros)
    assert not np.array_equal(shuffled, plain)
    zeros = awq_zeros_from_marlin(shuffled)
    assert zeros.dtype == np.uint8
    np.testing.assert_array_equal(zeros, ints.zeros)


def test_shape_errors():
    ints = random_ints(64, 64, 32, np.random.default_rng(0), zeros=(8, 8))
    b, s = pack_marlin(ints.codes, ints.scales, 32)
    with pytest.raises(ValueError, match="out a multiple of 64"):
        from_marlin(b[:, :64], s[:, :32], group_size=32)
    with pytest.raises(ValueError, match="scales has shape"):
        from_marlin(b, s[:1], group_size=32)
    with pytest.raises(ValueError, match="B must be a 2-D int32"):
        from_marlin(b.astype(np.int64), s, group_size=32)


# --- folders ---------------------------------------------------------------------------------


def _packed(folder: Path) -> dict[str, HostPacked | np.ndarray]:
    checkpoint = load_hf_checkpoint(folder)
    items = dict(checkpoint.tensors(packed=True))
    assert len(items) == checkpoint.num_tensors
    return items


def _same_load(a: Path, b: Path) -> None:
    """Both folders load to the same items, HostPacked field for field, bit for bit."""
    left, right = _packed(a), _packed(b)
    assert left.keys() == right.keys()
    quantized = 0
    for name, value in left.items():
        other = right[name]
        if isinstance(value, HostPacked):
            quantized += 1
            assert isinstance(other, HostPacked) and value.bits == other.bits
            for field in ("codes", "d", "z"):
                x, y = getattr(value, field), getattr(other, field)
                assert x.dtype == y.dtype
                np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_array_equal(value, other)
    assert quantized == 14


MARLIN_CONFIGS = {
    # candle-vllm and AutoGPTQ >= 0.8 (and transformers' GPTQConfig) name the layout this way
    "gptq-checkpoint_format": lambda g: gptq_config(g, True, "marlin"),
    # AutoGPTQ 0.7
    "gptq-is_marlin_format": lambda g: gptq_config(g, True) | {"is_marlin_format": True},
    # vLLM's own "marlin" method
    "marlin": lambda g: {"quant_method": "marlin", "group_size": g},
}


@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("flavour", sorted(MARLIN_CONFIGS))
def test_marlin_folder_loads_as_its_gptq(tmp_path, flavour, group_size):
    gptq = write_quantized_llama(tmp_path / "gptq", gptq_config(group_size, sym=True), **LLAMA)
    marlin = to_marlin(
        gptq,
        tmp_path / "marlin",
        MARLIN_CONFIGS[flavour](group_size),
        workspace=flavour == "gptq-checkpoint_format",
    )
    keys = json.loads((marlin.folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.down_proj.B" in keys and not any(".qweight" in k for k in keys)
    _same_load(gptq.folder, marlin.folder)


def test_awq_marlin_folder_loads_as_its_awq(tmp_path):
    awq = write_quantized_llama(tmp_path / "awq", awq_config(128), **LLAMA)
    converted = to_awq_marlin(awq, tmp_path / "awq-marlin")
    name = "model-00001-of-00002.safetensors"
    assert (converted.folder / name).read_bytes() != (awq.folder / name).read_bytes()
    _same_load(awq.folder, converted.folder)


def test_convert_awq_reads_awq_marlin_folders(tmp_path):
    """``tools/convert_awq.py`` on ``convert_awq_marlin.py``'s output: the GPTQ folder it writes
    loads as the AWQ original does."""
    from tests.models.test_gptq_awq import convert_awq

    awq = write_quantized_llama(tmp_path / "awq", awq_config(128), **LLAMA)
    converted = to_awq_marlin(awq, tmp_path / "awq-marlin")
    assert convert_awq.main([str(converted.folder), str(tmp_path / "gptq")]) == 0
    _same_load(awq.folder, tmp_path / "gptq")


def test_awq_zeros_that_cannot_be_told_apart(tmp_path):
    """Random codes sit nowhere near their zeros: neither reading wins, and the load says so."""
    from safetensors.numpy import save_file

    ints = random_ints(K, N, 128, np.random.default_rng(1))
    t = pack_awq(ints.codes, ints.zeros, ints.scales, group_size=128)
    folder = tmp_path / "m"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": awq_config(128)}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {"l.qweight": t.qweight, "l.qzeros": t.qzeros, "l.scales": t.scales}
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(
        HFCheckpointError, match=r"cannot tell whether qzeros.*fits [0-9]+ of the [0-9]+ groups"
    ) as e:
        list(load_hf_checkpoint(folder).tensors(packed=True))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("column_means", [0.0, 0.01], ids=["centred", "column-means"])
def test_awq_zeros_read_as_the_codes_say(group_size, column_means):
    """Quantized weights (even with each column's weights off centre by half their spread):
    plain zeros read plainly, shuffled ones in Marlin's order. (A layer this size with one group
    per column and such column means is as small as the test still tells apart.)"""
    from jax_llm_runtime.runtime.loading.hf_quant import QuantConfig

    rng = np.random.default_rng(2)
    w = rng.normal(0, 0.02, (512, 1024)) + rng.normal(0, column_means, (1, 1024))
    ints = quantize(w.astype(np.float32), group_size, sym=False)
    t = pack_awq(ints.codes, ints.zeros, ints.scales, group_size=group_size)
    quant = QuantConfig(method="awq", bits=4, group_size=group_size)
    for qzeros in (t.qzeros, marlin_awq_zeros(ints.zeros)):
        packed = quant.host_packed({"qweight": t.qweight, "qzeros": qzeros, "scales": t.scales})
        np.testing.assert_array_equal(packed.z, ints.zeros)


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        (gptq_config(128, True, "marlin", bits=8), "Marlin with bits=8 is not supported"),
        (gptq_config(128, False, "marlin"), "Marlin with sym=False is not supported"),
        (gptq_config(128, True, "marlin") | {"desc_act": True}, "desc_act=True is not supported"),
        ({"quant_method": "marlin", "group_size": 128, "bits": 3}, "bits=3"),
        (awq_config(128) | {"checkpoint_format": "marlin"}, "AWQ with checkpoint_format 'marlin'"),
    ],
)
def test_unsupported_marlin_configs_are_one_line_errors(tmp_path, quant, message):
    from safetensors.numpy import save_file

    ints = random_ints(K, N, 128, np.random.default_rng(0), zeros=(8, 8))
    b, s = pack_marlin(ints.codes, ints.scales, 128)
    folder = tmp_path / "m"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": quant}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"l.B": b, "l.s": s}, str(folder / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=message) as e:
        load_hf_checkpoint(folder)
    assert "\n" not in str(e.value)


def test_incomplete_marlin_linear(tmp_path):
    from safetensors.numpy import save_file

    ints = random_ints(K, N, 128, np.random.default_rng(0), zeros=(8, 8))
    b, s = pack_marlin(ints.codes, ints.scales, 128)
    folder = tmp_path / "m"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"]}
    config["quantization_config"] = gptq_config(128, True, "marlin")
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"l.B": b}, str(folder / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"l\.B but no l\.s"):
        load_hf_checkpoint(folder)
    save_file({"l.s": s}, str(folder / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"l\.s but no l\.B"):
        load_hf_checkpoint(folder)
    # Marlin tensors under a config that does not say Marlin (AutoGPTQ's quantize_config.json,
    # which is not read, may be where it says so)
    config["quantization_config"] = gptq_config(128, True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"l.B": b, "l.s": s}, str(folder / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match=r"l\.B is a Marlin-layout tensor.*gptq without"):
        load_hf_checkpoint(folder)


# --- end to end against HF transformers ------------------------------------------------------


@pytest.mark.parametrize("method", ["gptq-marlin", "awq-marlin"])
def test_marlin_llama_matches_hf(tmp_path, method):
    """Our engine on the Marlin folder against HF on the dequantized float weights."""
    from tests.models.harness import check_model, load_ours

    if method == "gptq-marlin":
        gptq = write_quantized_llama(tmp_path / "q", gptq_config(128, sym=True), **LLAMA)
        model = to_marlin(gptq, tmp_path / "m", gptq_config(128, True, "marlin"))
    else:
        awq = write_quantized_llama(tmp_path / "q", awq_config(128), **LLAMA)
        model = to_awq_marlin(awq, tmp_path / "m")
    check_model(load_ours(model.folder), model.hf_model)
