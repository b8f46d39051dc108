"""Every supported GGUF architecture, round-tripped: HF model -> GGUF (test-side writer) -> ours.

For each architecture a tiny random transformers model is saved with ``save_pretrained`` and
written as GGUF the way llama.cpp's converter does (``tests/models/gguf_writer``). Loading that
file must give (a) exactly the safetensors tensors, by name, and (b) a config from which
transformers builds the same model: it loads our tensors with no missing or unexpected keys and
produces bit-identical logits. Weights sit on a 1/128 grid so every transform (Gemma's +1 included)
is exact in float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from jax_llm_runtime.runtime.loading.gguf.loader import Checkpoint, GGUFError, load_gguf_checkpoint
from tests.models.gguf_writer import write_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
DEEPSEEK = dict(
    TINY,
    num_key_value_heads=4,
    n_routed_experts=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    **MOE,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
# gpt-oss's own rope: yarn without truncating the ramp.
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}
GEMMA4 = dict(
    head_dim=16,
    global_head_dim=32,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    hidden_size_per_layer_input=0,
)
LLAMA4 = dict(intermediate_size=32, intermediate_size_mlp=96, head_dim=16, num_local_experts=4)
QWEN35 = dict(
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    full_attention_interval=2,
    rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]},
)
PROMPT_LEN = 12  # longer than the sliding windows below


def _config(name: str, **kwargs: Any) -> Any:
    return getattr(transformers, name)(**kwargs)


CASES = {
    "llama": lambda: _config("LlamaConfig", **TINY, attention_bias=True),
    "mixtral": lambda: _config("MixtralConfig", **TINY, num_local_experts=3, num_experts_per_tok=2),
    "qwen2": lambda: _config("Qwen2Config", **TINY, tie_word_embeddings=True),
    "qwen3": lambda: _config("Qwen3Config", **TINY, head_dim=32),
    "qwen2moe": lambda: _config(
        "Qwen2MoeConfig", **TINY, **MOE, num_experts=3, shared_expert_intermediate_size=48
    ),
    # llama.cpp always renormalizes Qwen3-MoE routing, as the released models do.
    "qwen3moe": lambda: _config(
        "Qwen3MoeConfig", **TINY, **MOE, num_experts=4, norm_topk_prob=True, head_dim=16
    ),
    "phi3": lambda: _config(
        "Phi3Config",
        **TINY,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=32,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.25, 1.5, 2.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0],
        },
    ),
    # query_pre_attn_scalar: llama.cpp uses head_dim below 27B, so the tiny model does too.
    "gemma2": lambda: _config(
        "Gemma2Config",
        **{**TINY, "num_hidden_layers": 3},
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=10.0,
    ),
    # llama.cpp takes the 27B layer count (46) as the sign for hidden_size / heads scaling.
    "gemma2_27b_scaling": lambda: _config(
        "Gemma2Config",
        **{**TINY, "num_hidden_layers": 46},
        head_dim=32,
        query_pre_attn_scalar=16,
    ),
    # Seven layers: five local, one global, one local (llama.cpp's fixed pattern of six).
    "gemma3": lambda: _config(
        "Gemma3TextConfig",
        **{**TINY, "num_hidden_layers": 7},
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        final_logit_softcapping=15.0,
        rope_theta=100000.0,
        rope_local_base_freq=20000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    "stablelm": lambda: _config(
        "StableLmConfig", **TINY, qk_layernorm=True, use_qkv_bias=True, partial_rotary_factor=0.25
    ),
    "stablelm_parallel": lambda: _config("StableLmConfig", **TINY, use_parallel_residual=True),
    "glm4": lambda: _config("Glm4Config", **TINY, head_dim=16, partial_rotary_factor=0.5),
    "deepseek_v3": lambda: _config(
        "DeepseekV3Config",
        **DEEPSEEK,
        q_lora_rank=24,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_scaling=YARN,
    ),
    "deepseek_v3_no_q_lora": lambda: _config(
        "DeepseekV3Config", **DEEPSEEK, q_lora_rank=None, n_group=1, topk_group=1
    ),
    "deepseek_v2": lambda: _config(
        "DeepseekV2Config",
        **DEEPSEEK,
        q_lora_rank=None,
        n_group=2,
        topk_group=1,
        topk_method="group_limited_greedy",
    ),
    # One next-token-prediction layer in the file (the converter's default), skipped on load.
    "glm4_moe": lambda: _config(
        "Glm4MoeConfig",
        **{**TINY, **MOE, "num_hidden_layers": 3},
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        head_dim=16,
        use_qk_norm=True,
        attention_bias=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
    ),
    "minimax_m2": lambda: _config(
        "MiniMaxM2Config",
        **{**TINY, "intermediate_size": 32},
        head_dim=16,
        rotary_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # Three layers: sliding, full, sliding (llama.cpp's fixed alternation).
    "gpt_oss": lambda: _config(
        "GptOssConfig",
        **{**TINY, "num_hidden_layers": 3},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        rope_parameters=GPT_OSS_YARN,
    ),
    # Gemma 4: full layers twice as wide with one KV head whose values are its keys (no attn_v),
    # on the default proportional rope (a quarter of the pairs turn); the last layer is full.
    "gemma4": lambda: _config(
        "Gemma4TextConfig",
        **{**TINY, "num_hidden_layers": 3},
        **GEMMA4,
        final_logit_softcapping=3.0,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    ),
    "gemma4_moe": lambda: _config(
        "Gemma4TextConfig",
        **{**TINY, "num_hidden_layers": 3},
        **GEMMA4,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    # Llama 4 as llama.cpp runs it (chunks of 8192, every 4th layer without rope and with the
    # query temperature), MoE in every second layer as in Maverick.
    "llama4": lambda: _config(
        "Llama4TextConfig",
        **{**TINY, **LLAMA4, "num_hidden_layers": 4},
        interleave_moe_layer_step=2,
    ),
    # Qwen3-Next: three value heads per key head, narrower than the key heads, a 3-wide conv,
    # full attention in every second layer (llama.cpp's full_attention_interval).
    "qwen3next": lambda: _config(
        "Qwen3NextConfig",
        **{**TINY, **MOE, "num_hidden_layers": 4},
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=8,
        linear_value_head_dim=4,
        linear_conv_kernel_dim=3,
        full_attention_interval=2,
        num_experts=4,
        shared_expert_intermediate_size=48,
    ),
    # Qwen3.5: two value heads per key head (tiled in the file), multimodal rope sections.
    "qwen35": lambda: _config("Qwen3_5TextConfig", **{**TINY, "num_hidden_layers": 4}, **QWEN35),
    "qwen35_moe": lambda: _config(
        "Qwen3_5MoeTextConfig",
        **{**TINY, **MOE, "num_hidden_layers": 4},
        **QWEN35,
        num_experts=4,
        shared_expert_intermediate_size=48,
    ),
    # A sliding window of 0: every layer attends to everything, with rope.
    "llama4_full_attention": lambda: _config(
        "Llama4TextConfig",
        **{**TINY, **LLAMA4},
        attention_chunk_size=None,
        no_rope_layers=[1, 1],
        attn_temperature_tuning=False,
    ),
}


def _random_model(hf_config: Any, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    saved = model.state_dict()  # parameters and persistent buffers (DeepSeek's routing bias)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name in saved and tensor.is_floating_point():
                tensor.copy_(torch.randint(-32, 33, tensor.shape) / 128)
    return model


def _saved_tensors(model: Any, folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    model.save_pretrained(folder)
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _assert_same_tensors(checkpoint: Checkpoint, expected: dict[str, np.ndarray]) -> None:
    got = dict(checkpoint.tensors())
    assert checkpoint.num_tensors == len(got)
    assert sorted(got) == sorted(expected)
    for name, array in got.items():
        assert array.dtype == np.float32, name
        np.testing.assert_array_equal(array, expected[name], err_msg=name)


def _assert_same_model(
    original: Any, checkpoint: Checkpoint, folder: Path, atol: float = 0.0
) -> None:
    """transformers rebuilds ``original`` from our config dict and tensors, logit for logit
    (within ``atol`` where the file holds a tensor only to within rounding)."""
    from safetensors.numpy import save_file

    folder.mkdir()
    config = {k: v for k, v in checkpoint.config.items() if k != "rope_freq_factors"}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(dict(checkpoint.tensors()), folder / "model.safetensors")
    ours, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert type(ours) is type(original)
    assert not any(info.values()), info
    # Loaded tensors live in the file's memory map at its offsets; some of PyTorch's CPU kernels
    # sum in another order from a pointer that is not 64-byte aligned (a gemma4_moe round trip
    # differed in the last bit on an AMD EPYC). Fresh copies are aligned as the original's are.
    with torch.no_grad():
        for param in ours.parameters():
            param.data = param.data.clone()
    tokens = torch.randint(0, original.config.vocab_size, (2, PROMPT_LEN), generator=_seeded())
    with torch.no_grad():
        expected, got = original(tokens).logits, ours.eval()(tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)


def _seeded() -> Any:
    return torch.Generator().manual_seed(1)


def _round_trip(hf_config: Any, tmp_path: Path, **writer_options: Any) -> Checkpoint:
    model = _random_model(hf_config)
    expected = _saved_tensors(model, tmp_path / "hf")
    files = write_gguf(model, model.config, tmp_path / "model.gguf", **writer_options)
    checkpoint = load_gguf_checkpoint(files[0])
    _assert_same_tensors(checkpoint, expected)
    _assert_same_model(model, checkpoint, tmp_path / "ours")
    return checkpoint


# The converter stores the Gated DeltaNet's A_log as -exp(A_log): log undoes it to within
# float32 rounding, not bit for bit (test_gated_delta_net_round_trip).
INEXACT = ("qwen3next", "qwen35", "qwen35_moe")


@pytest.mark.parametrize("case", [case for case in CASES if case not in INEXACT])
def test_round_trip(case: str, tmp_path: Path) -> None:
    _round_trip(CASES[case](), tmp_path)


@pytest.mark.parametrize("case", INEXACT)
def test_gated_delta_net_round_trip(case: str, tmp_path: Path) -> None:
    """HF's exact tensors but A_log, which comes back to within float32 rounding, and a config
    from which transformers rebuilds the model."""
    model = _random_model(CASES[case]())
    expected = _saved_tensors(model, tmp_path / "hf")
    files = write_gguf(model, model.config, tmp_path / "model.gguf")
    checkpoint = load_gguf_checkpoint(files[0])
    got = dict(checkpoint.tensors())
    assert sorted(got) == sorted(expected)
    for name, array in got.items():
        if name.endswith("A_log"):
            np.testing.assert_allclose(array, expected[name], rtol=0, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(array, expected[name], err_msg=name)
    _assert_same_model(model, checkpoint, tmp_path / "ours", atol=1e-5)


def test_deepseek_legacy_kv_b(tmp_path: Path) -> None:
    """Files from before the k_b/v_b split hold HF's kv_b_proj as one attn_kv_b."""
    checkpoint = _round_trip(CASES["deepseek_v3"](), tmp_path, split_kv_b=False)
    assert checkpoint.config["architectures"] == ["DeepseekV3ForCausalLM"]


def test_fused_qkv_is_split(tmp_path: Path) -> None:
    """``--fuse-qkv`` files (one attn_qkv, llama rows interleaved) load as separate q/k/v."""
    _round_trip(CASES["llama"](), tmp_path, fuse_qkv=True)


@pytest.mark.parametrize("case", ["gpt_oss", "llama4"])
def test_fused_gate_up_experts(case: str, tmp_path: Path) -> None:
    """``--fuse-gate-up-exps`` files (one stack of gate rows then up rows) load as HF's fused
    stacks (gpt-oss's interleaved)."""
    _round_trip(CASES[case](), tmp_path, fuse_gate_up_exps=True)


def test_qwen35_moe_fused_gate_up_experts(tmp_path: Path) -> None:
    """A ``--fuse-gate-up-exps`` Qwen3.5-MoE file (gate rows then up rows in one stack per
    layer, as the released checkpoints hold them) loads into the same model as the file with
    separate stacks."""
    from tests.models.harness import load_checkpoint

    model = _random_model(CASES["qwen35_moe"]())
    loaded = []
    for name, fuse in (("fused", True), ("split", False)):
        files = write_gguf(model, model.config, tmp_path / f"{name}.gguf", fuse_gate_up_exps=fuse)
        loaded.append(load_checkpoint(load_gguf_checkpoint(files[0])).weights)
    fused, split = (jax.tree.leaves(w.state) for w in loaded)
    assert len(fused) == len(split)
    for a, b in zip(fused, split, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_squeezed_shared_expert_gate(tmp_path: Path) -> None:
    """Older converters squeezed Qwen2-MoE's [1, hidden] shared-expert gate to [hidden]."""
    model = _random_model(CASES["qwen2moe"]())
    expected = _saved_tensors(model, tmp_path / "hf")
    squeezed = {k: v.squeeze(0) if "shared_expert_gate" in k else v for k, v in expected.items()}
    files = write_gguf(squeezed, model.config, tmp_path / "old.gguf")
    _assert_same_tensors(load_gguf_checkpoint(files[0]), expected)


def test_q8_0(tmp_path: Path) -> None:
    model = _random_model(CASES["qwen3moe"]())
    expected = _saved_tensors(model, tmp_path / "hf")
    files = write_gguf(model, model.config, tmp_path / "q8.gguf", qtype="q8_0")
    got = dict(load_gguf_checkpoint(files[0]).tensors())
    assert sorted(got) == sorted(expected)
    for name, array in got.items():
        # Q8_0 keeps each block of 32 to within half a step of its largest magnitude / 127.
        scale = np.abs(expected[name]).max() / 127
        np.testing.assert_allclose(array, expected[name], rtol=0, atol=scale, err_msg=name)


def test_llama3_rope_freqs_go_to_config(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    hf_config = _config("LlamaConfig", **TINY, rope_scaling=rope)
    model = _random_model(hf_config)
    expected = _saved_tensors(model, tmp_path / "hf")
    files = write_gguf(model, model.config, tmp_path / "llama3.gguf")
    checkpoint = load_gguf_checkpoint(files[0])
    _assert_same_tensors(checkpoint, expected)  # rope_freqs is not yielded
    # HF's llama3 frequencies are the plain ones divided by these factors.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    factors = checkpoint.config["rope_freq_factors"]
    np.testing.assert_allclose(factors, (plain / scaled).numpy(), rtol=1e-5)
    assert "rope_scaling" not in checkpoint.config


def test_split_gguf_loads_all_shards(tmp_path: Path) -> None:
    model = _random_model(CASES["qwen3moe"]())
    expected = _saved_tensors(model, tmp_path / "hf")
    files = write_gguf(model, model.config, tmp_path / "moe.gguf", split_into=3)
    assert [f.name for f in files] == [f"moe-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    checkpoint = load_gguf_checkpoint(files[0])
    _assert_same_tensors(checkpoint, expected)
    single = write_gguf(model, model.config, tmp_path / "single.gguf")
    assert checkpoint.config == load_gguf_checkpoint(single[0]).config

    with pytest.raises(GGUFError, match=r"pass moe-00001-of-00003\.gguf"):
        load_gguf_checkpoint(files[1])
    files[2].unlink()
    with pytest.raises(GGUFError, match=r"moe-00003-of-00003\.gguf \(3 of 3\) is missing"):
        load_gguf_checkpoint(files[0])


def test_split_gguf_shards_must_match(tmp_path: Path) -> None:
    model = _random_model(CASES["qwen3"]())
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_gguf(model, model.config, tmp_path / "a" / "m.gguf", split_into=3)
    b = write_gguf(model, model.config, tmp_path / "b" / "m.gguf", split_into=2)
    b[1].replace(a[1])  # shard 2 of 2 where shard 2 of 3 belongs
    with pytest.raises(GGUFError, match="not shard 2 of 3"):
        load_gguf_checkpoint(a[0])


def test_split_gguf_folder_resolves_to_first_shard(tmp_path: Path) -> None:
    from jax_llm_runtime.runtime.loading.sources import resolve_model_source

    model = _random_model(CASES["qwen3"]())
    files = write_gguf(model, model.config, tmp_path / "m.gguf", split_into=3)
    resolved = resolve_model_source(str(tmp_path))
    assert (resolved.kind, resolved.path) == ("gguf", files[0])
    assert resolve_model_source(str(tmp_path), weight_file=files[0].name).path == files[0]


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "x.gguf", "mamba9")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="'mamba9' is not supported") as error:
        load_gguf_checkpoint(tmp_path / "x.gguf")
    assert "llama, qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma2, gemma3" in str(error.value)
    assert "\n" not in str(error.value)


def test_hub_first_shard_fetches_all_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    from jax_llm_runtime.runtime.loading.sources import resolve_model_source

    asked = []

    def snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        asked.extend(allow_patterns)
        for no in (1, 2):
            (tmp_path / "Q8_0").mkdir(exist_ok=True)
            (tmp_path / "Q8_0" / f"m-0000{no}-of-00002.gguf").write_bytes(b"GGUF")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    resolved = resolve_model_source("owner/model", weight_file="Q8_0/m-00001-of-00002.gguf")
    assert asked == ["Q8_0/m-*-of-00002.gguf"]
    assert resolved.path == tmp_path / "Q8_0" / "m-00001-of-00002.gguf"


@pytest.mark.parametrize(
    "case", ["gemma3", "deepseek_v3", "phi3", "stablelm", "mixtral", "gpt_oss", "gemma4", "llama4"]
)
def test_wrong_typed_metadata_raises_gguf_error_or_loads(case: str, tmp_path: Path) -> None:
    """Any ``<arch>.*`` key replaced by a value of the wrong type or size: GGUFError or a load,
    never another exception."""
    import gguf

    from jax_llm_runtime.runtime.loading.gguf.reader import read_gguf_header

    model = _random_model(CASES[case]())
    source = write_gguf(model, model.config, tmp_path / "m.gguf")[0]
    metadata = read_gguf_header(source).metadata
    arch = metadata["general.architecture"]
    keys = [k for k in metadata if k.startswith(f"{arch}.")]
    keys += [f"{arch}.attention.sliding_window_pattern", f"{arch}.rope.scaling.type"]
    t = gguf.GGUFValueType
    values = [("x", t.STRING), (-3, t.INT32), (True, t.BOOL), (10**6, t.UINT32), (0.5, t.FLOAT32)]
    for key in keys:
        for value, vtype in values:
            bad = _rewritten(source, tmp_path / "bad.gguf", key, value, vtype)
            try:
                for _ in load_gguf_checkpoint(bad).tensors():
                    pass
            except GGUFError:
                pass


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("embedding_length_per_layer_input", 2, "has no tensor per_layer_token_embd"),
        ("attention.shared_kv_layers", 3, "leaves none of the 3 layers"),
    ],
)
def test_gemma4_per_layer_parts_that_do_not_fit_are_one_line_errors(
    key: str, value: int, message: str, tmp_path: Path
):
    """Gemma 4 metadata for per-layer embeddings without their table, or KV sharing over every
    layer: refused by name, never loaded into a wrong model."""
    import gguf

    model = _random_model(CASES["gemma4"]())
    source = write_gguf(model, model.config, tmp_path / "m.gguf")[0]
    bad = _rewritten(
        source, tmp_path / "bad.gguf", f"gemma4.{key}", value, gguf.GGUFValueType.UINT32
    )
    with pytest.raises(GGUFError, match=message):
        load_gguf_checkpoint(bad)


def _rewritten(source: Path, target: Path, key: str, value: Any, vtype: Any) -> Path:
    """``source`` written again as ``target`` (float32 tensors) with metadata ``key`` set to
    ``value`` of GGUF type ``vtype``."""
    import gguf

    from jax_llm_runtime.runtime.loading.gguf.reader import dequantize_tensor, read_gguf_header

    header = read_gguf_header(source)
    data = np.memmap(source, dtype=np.uint8, mode="r")
    writer = gguf.GGUFWriter(target, header.metadata["general.architecture"])
    for k, v in header.metadata.items():
        if k in (key, "general.architecture"):
            continue
        if isinstance(v, (np.ndarray, tuple)):  # per-layer arrays (Gemma 4), token lists
            writer.add_array(k, v.tolist() if isinstance(v, np.ndarray) else list(v))
        else:
            writer.add_key_value(k, v, _value_type(v))
    writer.add_key_value(key, value, vtype)
    for info in header.tensors:
        writer.add_tensor(info.name, dequantize_tensor(data, info))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _value_type(value: Any) -> Any:
    import gguf

    t = gguf.GGUFValueType
    if isinstance(value, str):
        return t.STRING
    if isinstance(value, bool):
        return t.BOOL
    return t.UINT32 if isinstance(value, int) else t.FLOAT32
