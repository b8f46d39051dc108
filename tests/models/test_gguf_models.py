"""Every GGUF architecture end to end: tiny HF model -> GGUF (written the way llama.cpp's
converter lays it out) -> our loader and model -> the harness's checks against the HF model
(last-position logits of ragged prompts, and 16 greedy tokens through the paged cache).

``tests/runtime/test_gguf_archs.py`` proves the loader returns HF's exact tensors and config;
this proves our models run those files the way HF runs the originals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jax_llm_runtime.runtime.loading.gguf.loader import load_gguf_checkpoint
from tests.models.gguf_writer import write_gguf
from tests.models.harness import check_model, load_checkpoint
from tests.runtime.test_gguf_archs import CASES, GEMMA4, TINY, _random_model

# The 46-layer case only checks a metadata rule; the other Gemma 2 case covers the model.
MODEL_CASES = [case for case in CASES if case != "gemma2_27b_scaling"]


@pytest.mark.parametrize("case", MODEL_CASES)
def test_gguf_model_matches_hf(case: str, tmp_path: Path) -> None:
    hf_model = _random_model(CASES[case]())
    files = write_gguf(hf_model, hf_model.config, tmp_path / "model.gguf")
    check_model(load_checkpoint(load_gguf_checkpoint(files[0])), hf_model)


def test_quantized_gguf_runs_like_its_dequantized_weights(tmp_path: Path) -> None:
    """A Q8_0 file: our model on it equals HF on the dequantized tensors (same numbers)."""
    import torch

    hf_model = _random_model(CASES["qwen3"]())
    files = write_gguf(hf_model, hf_model.config, tmp_path / "model.gguf", qtype="q8_0")
    checkpoint = load_gguf_checkpoint(files[0])
    state = {name: torch.from_numpy(array) for name, array in checkpoint.tensors()}
    hf_model.load_state_dict(state, strict=False)
    check_model(load_checkpoint(checkpoint), hf_model)


def test_gpt_oss_mxfp4_experts_stay_packed(tmp_path: Path) -> None:
    """gpt-oss with MXFP4 expert stacks (llama.cpp's MXFP4_MOE files): the experts load packed
    in the E2M1 codebook form, and our model on them runs like HF on gguf's dequantization."""
    import torch

    from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedWeight

    hf_model = _random_model(CASES["gpt_oss"]())
    files = write_gguf(
        hf_model,
        hf_model.config,
        tmp_path / "model.gguf",
        qtype=lambda name: "mxfp4" if name.endswith("_exps.weight") else "f32",
    )
    checkpoint = load_gguf_checkpoint(files[0])
    state = {name: torch.from_numpy(array) for name, array in checkpoint.tensors()}
    assert not hf_model.load_state_dict(state, strict=False).unexpected_keys
    model = load_checkpoint(checkpoint)
    layers = model.weights.model(model.config).segments[0].layers
    for stack in (layers.ffn.e_gate, layers.ffn.e_up, layers.ffn.e_down):
        value = stack.kernel.get_value()
        assert isinstance(value, PackedWeight) and value.codebook == "e2m1", type(value)
    check_model(model, hf_model)


@pytest.mark.parametrize("case", ["gemma4_moe", "llama4"])
def test_quantized_fused_expert_stacks(case: str, tmp_path: Path) -> None:
    """Q8_0 files of models whose HF expert stacks hold gate and up in one (Gemma 4's
    ``[experts, 2 * inter, hidden]``, Llama 4's ``[experts, hidden, 2 * inter]``): the stacks
    stay packed and are cut in two packed (Gemma 4's narrower heads are dequantized to be
    padded); our model runs like HF on the dequantized tensors."""
    import torch

    from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedWeight

    hf_model = _random_model(CASES[case]())
    files = write_gguf(hf_model, hf_model.config, tmp_path / "model.gguf", qtype="q8_0")
    checkpoint = load_gguf_checkpoint(files[0])
    state = {name: torch.from_numpy(array) for name, array in checkpoint.tensors()}
    assert not hf_model.load_state_dict(state, strict=False).unexpected_keys
    model = load_checkpoint(checkpoint)
    stacks = [
        segment[field]
        for segment in model.weights["segments"]
        for field in ("e_gate", "e_up", "e_down")
        if field in segment
    ]
    assert stacks and all(isinstance(stack, PackedWeight) for stack in stacks)
    check_model(model, hf_model)


def _gemma4_e2b_config() -> Any:
    """Gemma 4 E2B's parts on a tiny model: per-layer embeddings, and the last two of five layers
    reusing the K/V of the last earlier sliding and full layers, with MLPs twice as wide."""
    import transformers

    sliding, full = "sliding_attention", "full_attention"
    return transformers.Gemma4TextConfig(
        **{
            **TINY,
            **GEMMA4,
            "num_hidden_layers": 5,
            "layer_types": [sliding, full, sliding, sliding, full],
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": TINY["vocab_size"],
            "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True,
        }
    )


@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
def test_gemma4_per_layer_embeddings_and_kv_sharing(qtype: str, tmp_path: Path) -> None:
    """Gemma 4 E2B/E4B files: the KV-sharing layers have no attn_k/attn_v, their MLP widths come
    as one feed_forward_length per layer, the per-layer embeddings as per_layer_* tensors. Our
    model runs like HF on the file's tensors (rounded to F16, or Q8_0 where rows split into
    blocks)."""
    import torch

    hf_model = _random_model(_gemma4_e2b_config())
    files = write_gguf(hf_model, hf_model.config, tmp_path / "model.gguf", qtype=qtype)
    checkpoint = load_gguf_checkpoint(files[0])
    state = {name: torch.from_numpy(array) for name, array in checkpoint.tensors()}
    loaded = hf_model.load_state_dict(state, strict=False)
    # Every HF tensor comes from the file but the head, which is tied to the embedding.
    assert not loaded.unexpected_keys and loaded.missing_keys == ["lm_head.weight"], loaded
    model = load_checkpoint(checkpoint)
    cfg = model.config
    assert cfg.kv_sources == (0, 1, 2, 2, 1) and cfg.per_layer_input_size == 8
    assert cfg.layer_intermediate_sizes == (96, 96, 96, 192, 192)
    check_model(model, hf_model)
