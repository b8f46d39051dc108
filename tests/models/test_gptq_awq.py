"""GPTQ and AWQ 4-bit checkpoints: the packers and unpackers of
``pallas_kernels.dequant_matmul.gptq`` against independent dequantizers of the published formats,
``runtime.loading.hf_loader`` on tiny quantized Llama folders, ``tools/convert_awq.py``, and the errors.
Test checkpoints are packed here from random weights (see ``gptq_awq_fixtures``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.gptq import (
    from_awq,
    from_gptq,
    pack_awq,
    pack_gptq,
)
from jax_llm_runtime.runtime.loading.hf_loader import HFCheckpointError, load_hf_checkpoint
from tests.models.gptq_awq_fixtures import (
    LINEARS,
    awq_config,
    dequantize,
    gptq_config,
    random_ints,
    reference_awq,
    reference_gptq,
    write_quantized_llama,
)

ROOT = Path(__file__).resolve().parents[2]
K, N = 256, 96


def _load_tool():
    spec = importlib.util.spec_from_file_location(
        "convert_awq_under_test", ROOT / "tools/convert_awq.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


convert_awq = _load_tool()


def _same(packed: HostPacked, ints, bits: int = 4) -> None:
    assert packed.bits == bits
    np.testing.assert_array_equal(packed.codes, ints.codes)
    np.testing.assert_array_equal(packed.z, ints.zeros)
    np.testing.assert_array_equal(packed.d, ints.scales)
    assert packed.codes.dtype == np.uint8 and packed.z.dtype == np.uint8
    assert packed.d.dtype == np.float16


# --- packing round trips against the published formats ---------------------------------------


@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_round_trip_and_reference(group_size, checkpoint_format):
    rng = np.random.default_rng(group_size + len(checkpoint_format))
    # The reference (AutoGPTQ's) masks v1 zeros to 4 bits, so it cannot read a zero of 16.
    ints = random_ints(
        K, N, group_size, rng, zeros=(1, 15) if checkpoint_format == "gptq" else (0, 15)
    )
    t = pack_gptq(
        ints.codes,
        ints.zeros,
        ints.scales,
        group_size=group_size,
        checkpoint_format=checkpoint_format,
    )
    groups = 1 if group_size == -1 else K // group_size
    assert t.qweight.shape == (K // 8, N) and t.qweight.dtype == np.int32
    assert t.qzeros.shape == (groups, N // 8) and t.qzeros.dtype == np.int32
    assert t.scales.shape == (groups, N) and t.g_idx.shape == (K,)
    packed = from_gptq(
        t.qweight, t.qzeros, t.scales, t.g_idx,
        bits=4, group_size=group_size, sym=False, checkpoint_format=checkpoint_format,
    )  # fmt: skip
    _same(packed, ints)
    ref = reference_gptq(t.qweight, t.qzeros, t.scales, t.g_idx, checkpoint_format)
    np.testing.assert_array_equal(dequantize(packed), ref)


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_8bit_round_trip_and_reference(checkpoint_format):
    """8-bit GPTQ: four codes per int32 word, zeros up to 255 (a v1 zero of 256 cannot load)."""
    rng = np.random.default_rng(8)
    low = 1 if checkpoint_format == "gptq" else 0
    ints = random_ints(K, N, 32, rng, zeros=(low, 255), bits=8)
    t = pack_gptq(
        ints.codes, ints.zeros, ints.scales,
        group_size=32, bits=8, checkpoint_format=checkpoint_format,
    )  # fmt: skip
    assert t.qweight.shape == (K // 4, N) and t.qzeros.shape == (K // 32, N // 4)
    packed = from_gptq(
        t.qweight, t.qzeros, t.scales, t.g_idx,
        bits=8, group_size=32, sym=False, checkpoint_format=checkpoint_format,
    )  # fmt: skip
    _same(packed, ints, bits=8)
    ref = reference_gptq(t.qweight, t.qzeros, t.scales, t.g_idx, checkpoint_format, bits=8)
    np.testing.assert_array_equal(dequantize(packed), ref)
    if checkpoint_format == "gptq":
        top = pack_gptq(
            ints.codes, np.full_like(ints.zeros, 256, dtype=np.int64), ints.scales,
            group_size=32, bits=8,
        )  # fmt: skip
        with pytest.raises(ValueError, match="256"):
            from_gptq(top.qweight, top.qzeros, top.scales, None, bits=8, group_size=32, sym=False)


def test_gptq_v1_layout_by_hand():
    """Symmetric v1: every zero 8 is stored as 7 in each nibble; code k of row 0 sits at bit 4k."""
    codes = np.zeros((32, 8), np.uint8)
    codes[:8, 0] = np.arange(8)
    t = pack_gptq(codes, np.full((1, 8), 8), np.ones((1, 8), np.float16), group_size=-1)
    assert t.qzeros.view(np.uint32)[0, 0] == 0x77777777
    assert t.qweight.view(np.uint32)[0, 0] == 0x76543210
    packed = from_gptq(t.qweight, t.qzeros, t.scales, None, bits=4, group_size=-1, sym=True)
    assert (packed.z == 8).all()


def test_gptq_v1_zero_of_sixteen():
    """v1 readers add one to each stored nibble without masking, so a stored 15 is a zero of 16."""
    rng = np.random.default_rng(3)
    ints = random_ints(64, 16, 32, rng, zeros=(16, 16))
    t = pack_gptq(ints.codes, ints.zeros, ints.scales, group_size=32)
    assert (t.qzeros.view(np.uint32) == 0xFFFFFFFF).all()
    _same(from_gptq(t.qweight, t.qzeros, t.scales, t.g_idx, bits=4, group_size=32, sym=False), ints)


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_round_trip_and_reference(group_size):
    ints = random_ints(K, N, group_size, np.random.default_rng(7 + group_size))
    t = pack_awq(ints.codes, ints.zeros, ints.scales, group_size=group_size)
    assert t.qweight.shape == (K, N // 8) and t.qweight.dtype == np.int32
    packed = from_awq(t.qweight, t.qzeros, t.scales, bits=4, group_size=group_size)
    _same(packed, ints)
    ref = reference_awq(t.qweight, t.qzeros, t.scales, group_size)
    np.testing.assert_array_equal(dequantize(packed), ref)


def test_awq_interleave_by_hand():
    """Column c of a group of 8 sits in nibble (0, 4, 1, 5, 2, 6, 3, 7)[c]."""
    codes = np.tile(np.arange(8, dtype=np.uint8), (32, 1))
    t = pack_awq(codes, np.zeros((1, 8), np.uint8), np.ones((1, 8), np.float16), group_size=-1)
    assert t.qweight.view(np.uint32)[0, 0] == 0x75316420


def test_packed_weight_dequantizes_the_same():
    """The HostPacked goes through the runtime's own dequantizer to the same floats."""
    from jax_llm_runtime.pallas_kernels.dequant_matmul import dequantize as device_dequantize

    ints = random_ints(K, N, 64, np.random.default_rng(11), zeros=(1, 15))
    t = pack_gptq(ints.codes, ints.zeros, ints.scales, group_size=64)
    packed = from_gptq(t.qweight, t.qzeros, t.scales, t.g_idx, bits=4, group_size=64, sym=False)
    np.testing.assert_array_equal(
        np.asarray(device_dequantize(packed.to_device())), dequantize(ints)
    )


# --- errors ----------------------------------------------------------------------------------


def _gptq_tensors(group_size=32, k=64, n=16):
    ints = random_ints(k, n, group_size, np.random.default_rng(0), zeros=(1, 15))
    return pack_gptq(ints.codes, ints.zeros, ints.scales, group_size=group_size)


def test_gptq_errors():
    t = _gptq_tensors()
    args = (t.qweight, t.qzeros, t.scales)
    with pytest.raises(ValueError, match="only 4 and 8-bit"):
        from_gptq(*args, t.g_idx, bits=3, group_size=32, sym=False)
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(
            *args, np.random.default_rng(0).permutation(t.g_idx), bits=4, group_size=32, sym=False
        )
    with pytest.raises(ValueError, match="sym=True"):
        from_gptq(*args, t.g_idx, bits=4, group_size=32, sym=True)
    with pytest.raises(ValueError, match="checkpoint_format 'marlin'"):
        from_gptq(*args, t.g_idx, bits=4, group_size=32, checkpoint_format="marlin")
    with pytest.raises(ValueError, match="int32"):
        from_gptq(t.qweight.astype(np.int16), *args[1:], None, bits=4, group_size=32, sym=False)
    with pytest.raises(ValueError, match="qzeros has shape"):
        from_gptq(t.qweight, t.qzeros[:1], t.scales, None, bits=4, group_size=32, sym=False)
    with pytest.raises(ValueError, match="does not divide"):
        from_gptq(*args, None, bits=4, group_size=48, sym=False)
    with pytest.raises(ValueError, match="float16 exactly"):
        from_gptq(
            t.qweight,
            t.qzeros,
            t.scales.astype(np.float32) * (1 + 2**-20),
            None,
            bits=4,
            group_size=32,
            sym=False,
        )
    with pytest.raises(ValueError, match=r"1\.\.16"):
        pack_gptq(
            np.zeros((64, 16), np.uint8), np.zeros((2, 16), np.uint8), t.scales, group_size=32
        )


def test_awq_errors():
    ints = random_ints(64, 16, 32, np.random.default_rng(0))
    t = pack_awq(ints.codes, ints.zeros, ints.scales, group_size=32)
    with pytest.raises(ValueError, match="only 4-bit"):
        from_awq(t.qweight, t.qzeros, t.scales, bits=3, group_size=32)
    with pytest.raises(ValueError, match="scales has shape"):
        from_awq(t.qweight, t.qzeros, t.scales, bits=4, group_size=16)
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_awq(ints.codes + 16, ints.zeros, ints.scales, group_size=32)


def _tiny_folder(folder: Path, quant: dict | None, tensors: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"]}
    if quant is not None:
        config["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        (gptq_config(32, False) | {"bits": 3}, "gptq with bits=3 is not supported"),
        (awq_config(32) | {"bits": 8}, "awq with bits=8 is not supported"),
        (gptq_config(32, False, "bitblas"), "checkpoint_format 'bitblas' is not supported"),
        (gptq_config(32, False) | {"pack_dtype": "int16"}, "pack_dtype 'int16'"),
        (awq_config(32) | {"version": "gemv"}, "AWQ version 'gemv' is not supported"),
        (awq_config(32) | {"zero_point": False}, "zero_point=False"),
    ],
)
def test_unsupported_configs_are_one_line_errors(tmp_path, quant, message):
    t = _gptq_tensors()
    folder = _tiny_folder(
        tmp_path / "m", quant, {"l.qweight": t.qweight, "l.qzeros": t.qzeros, "l.scales": t.scales}
    )
    with pytest.raises(HFCheckpointError, match=message) as e:
        load_hf_checkpoint(folder)
    assert "\n" not in str(e.value)


def test_act_order_fails_at_load(tmp_path):
    t = _gptq_tensors()
    g_idx = np.random.default_rng(0).permutation(t.g_idx).astype(np.int32)
    quant = gptq_config(32, False) | {"desc_act": True}
    tensors = {"l.qweight": t.qweight, "l.qzeros": t.qzeros, "l.scales": t.scales, "l.g_idx": g_idx}
    with pytest.raises(HFCheckpointError, match=r"l\.g_idx: .*desc_act=True"):
        load_hf_checkpoint(_tiny_folder(tmp_path / "m", quant, tensors))
    # desc_act=True with groups in input order (static groups) loads.
    tensors["l.g_idx"] = t.g_idx
    checkpoint = load_hf_checkpoint(_tiny_folder(tmp_path / "ok", quant, tensors))
    assert [k for k, _ in checkpoint.tensors()] == ["l.weight"]


def test_incomplete_or_undeclared_linears(tmp_path):
    t = _gptq_tensors()
    with pytest.raises(HFCheckpointError, match=r"l\.qweight but no l\.scales"):
        load_hf_checkpoint(
            _tiny_folder(
                tmp_path / "a",
                gptq_config(32, False),
                {"l.qweight": t.qweight, "l.qzeros": t.qzeros},
            )
        )
    with pytest.raises(HFCheckpointError, match=r"l\.qzeros but no l\.qweight"):
        load_hf_checkpoint(
            _tiny_folder(tmp_path / "b", gptq_config(32, False), {"l.qzeros": t.qzeros})
        )
    with pytest.raises(HFCheckpointError, match="no quantization_config"):
        load_hf_checkpoint(_tiny_folder(tmp_path / "c", None, {"l.qweight": t.qweight}))


def test_bad_tensor_names_the_linear(tmp_path):
    t = _gptq_tensors()
    tensors = {"l.qweight": t.qweight, "l.qzeros": t.qzeros, "l.scales": t.scales[:1]}
    checkpoint = load_hf_checkpoint(_tiny_folder(tmp_path / "m", gptq_config(32, False), tensors))
    with pytest.raises(HFCheckpointError, match="gptq linear l: scales has shape"):
        list(checkpoint.tensors())


# --- tiny Llama folders ----------------------------------------------------------------------


def _check_linears(folder: Path, expected: dict) -> dict[str, HostPacked]:
    """Every projection comes out as one HostPacked item; everything else as an array."""
    checkpoint = load_hf_checkpoint(folder)
    items = list(checkpoint.tensors(packed=True))
    assert len(items) == checkpoint.num_tensors
    packed = {k: v for k, v in items if isinstance(v, HostPacked)}
    assert set(packed) == {f"{prefix}.weight" for prefix in expected}
    for prefix, ints in expected.items():
        _same(packed[f"{prefix}.weight"], ints)
    names = [k for k, _ in items]
    assert len(names) == len(set(names))
    assert all(isinstance(v, np.ndarray) for k, v in items if k not in packed)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    return packed


@pytest.mark.parametrize(
    "quant",
    [
        gptq_config(32, sym=True),
        gptq_config(-1, sym=False),
        gptq_config(32, False, "gptq_v2"),
        awq_config(32),
    ],
    ids=["gptq-sym-g32", "gptq-asym-g-1", "gptq_v2-asym-g32", "awq-g32"],
)
def test_hf_loader_yields_host_packed(tmp_path, quant):
    model = write_quantized_llama(tmp_path / "q", quant)
    index = json.loads((model.folder / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = "model.layers.0.self_attn.q_proj"
    assert index[f"{prefix}.qweight"] != index[f"{prefix}.qzeros"]  # one linear over two shards
    assert len(model.linears) == 2 * len(LINEARS)
    _check_linears(model.folder, model.linears)


def test_convert_awq_loads_identically(tmp_path):
    awq = write_quantized_llama(tmp_path / "awq", awq_config(32))
    (awq.folder / "tokenizer.json").write_text("{}")
    assert convert_awq.main([str(awq.folder), str(tmp_path / "gptq")]) == 0
    out = tmp_path / "gptq"
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (
        config["quant_method"] == "gptq" and config["sym"] is False and config["group_size"] == 32
    )
    has_zero = any((ints.zeros == 0).any() for ints in awq.linears.values())
    assert config["checkpoint_format"] == ("gptq_v2" if has_zero else "gptq")
    assert (out / "tokenizer.json").read_text() == "{}"
    original = _check_linears(awq.folder, awq.linears)
    converted = _check_linears(out, awq.linears)
    for name, packed in original.items():
        for field in ("codes", "d", "z"):
            np.testing.assert_array_equal(getattr(converted[name], field), getattr(packed, field))
    floats = dict(load_hf_checkpoint(awq.folder).tensors(packed=True))
    for name, array in load_hf_checkpoint(out).tensors(packed=True):
        if not isinstance(array, HostPacked):
            np.testing.assert_array_equal(array, floats[name])


@pytest.mark.parametrize(
    ("zeros", "sym", "checkpoint_format"),
    [((8, 8), True, "gptq"), ((1, 15), False, "gptq"), ((0, 15), False, "gptq_v2")],
)
def test_convert_awq_flavour(tmp_path, zeros, sym, checkpoint_format):
    """All zeros 8: symmetric v1; zeros 1..15: asymmetric v1; a zero of 0: v2 (v1 cannot)."""
    ints = random_ints(64, 16, 32, np.random.default_rng(5), zeros=zeros)
    ints.zeros[0, 0] = zeros[0]
    t = pack_awq(ints.codes, ints.zeros, ints.scales, group_size=32)
    src = _tiny_folder(
        tmp_path / "awq",
        awq_config(32),
        {"l.qweight": t.qweight, "l.qzeros": t.qzeros, "l.scales": t.scales},
    )
    config = convert_awq.convert(src, tmp_path / "gptq")
    assert (config["sym"], config["checkpoint_format"]) == (sym, checkpoint_format)
    ((_, packed),) = load_hf_checkpoint(tmp_path / "gptq").tensors(packed=True)
    _same(packed, ints)


def test_convert_awq_rejects_other_input(tmp_path, capsys):
    t = _gptq_tensors()
    src = _tiny_folder(
        tmp_path / "g",
        gptq_config(32, False),
        {"l.qweight": t.qweight, "l.qzeros": t.qzeros, "l.scales": t.scales},
    )
    assert convert_awq.main([str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "is not an AWQ checkpoint" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# --- end to end against HF transformers ------------------------------------------------------


@pytest.mark.parametrize(
    "quant",
    [
        gptq_config(32, sym=True),
        gptq_config(-1, sym=False),
        gptq_config(32, sym=True, bits=8),
        gptq_config(64, sym=False, checkpoint_format="gptq_v2", bits=8),
        awq_config(32),
    ],
    ids=["gptq-sym-g32", "gptq-asym-g-1", "gptq8-sym-g32", "gptq8-v2-asym-g64", "awq-g32"],
)
def test_quantized_llama_matches_hf(tmp_path, quant):
    """Our engine on the packed checkpoint against HF on the dequantized float weights."""
    from tests.models.harness import check_model, load_ours

    model = write_quantized_llama(tmp_path / "q", quant)
    check_model(load_ours(model.folder), model.hf_model)
