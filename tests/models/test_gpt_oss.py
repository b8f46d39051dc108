"""gpt-oss against HF transformers on tiny random models (see harness.py): attention sinks,
alternating sliding-window and full layers, yarn rope, biased attention, a biased router and
biased experts with the clamped SwiGLU; then the same model over 1, 2 and 4 fake CPU devices.

transformers initialises the sinks, the router bias and the expert biases to zero or nearly, and
the clamp's limit of 7 is never reached by a tiny model's activations; the tests draw those
weights larger and lower the limit, so that each feature moves the logits.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.harness import TINY, check_model, load_ours

WINDOW = 8
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}


def gpt_oss_config(**fields):
    import transformers

    base = {
        **TINY,
        "intermediate_size": 32,
        "head_dim": 16,
        "num_local_experts": 8,  # a decode of 3 rows (6 slots) gathers its experts
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "rope_parameters": YARN,
        "swiglu_limit": 0.2,
        "pad_token_id": 0,
    }
    config = transformers.GptOssConfig(**{**base, **fields})
    config._experts_implementation = "eager"  # the per-expert loop: the plain reference
    config._attn_implementation = "eager"
    return config


def save_gpt_oss(config, folder: Path, seed: int = 0):
    """A seeded random gpt-oss with sinks and biases drawn large enough to matter, saved as
    safetensors; returns the HF model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    scales = {"sinks": 1.0, "router.bias": 0.5, "proj_bias": 0.1}
    with torch.no_grad():
        for name, param in model.named_parameters():
            for suffix, std in scales.items():
                if name.endswith(suffix):
                    param.normal_(0.0, std)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def test_gpt_oss_against_hf(tmp_path):
    hf_model = save_gpt_oss(gpt_oss_config(), tmp_path)
    model = load_ours(tmp_path)
    cfg = model.config
    assert cfg.sliding_layers == (True, False)
    assert cfg.attention.sinks and cfg.attention.qkv_bias and cfg.attention.o_bias
    assert cfg.attention.rope.rope_type == "yarn" and not cfg.attention.rope.truncate
    assert cfg.moe.swiglu_clamp == (1.702, 0.2)
    check_model(model, hf_model)
    check_hidden_states(model, hf_model)


def check_hidden_states(model, hf_model) -> None:
    """The cache-free path (embeddings, prompt scoring) takes the sinks too."""
    import torch

    ids = np.random.default_rng(3).integers(0, 256, (2, 12)).astype(np.int32)
    positions = np.broadcast_to(np.arange(12, dtype=np.int32), ids.shape)
    ours = model.spec.hidden_states(
        model.config, model.weights, ids, positions, np.asarray([12, 12], np.int32)
    )
    with torch.no_grad():
        ref = hf_model.model(torch.tensor(ids, dtype=torch.long)).last_hidden_state.numpy()
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)


def test_gpt_oss_default_rope_and_limit(tmp_path):
    """A config that names no rope gets transformers' gpt-oss yarn; the limit of 7 holds."""
    config = gpt_oss_config(rope_parameters=None, swiglu_limit=7.0, num_hidden_layers=3)
    hf_model = save_gpt_oss(config, tmp_path, seed=1)
    model = load_ours(tmp_path)
    rope = model.config.attention.rope
    assert (rope.factor, rope.original_max_position_embeddings, rope.theta) == (32, 4096, 150000)
    check_model(model, hf_model, seed=1)


def test_released_config_translates():
    """The released checkpoints' config.json: ``rope_scaling`` (not ``rope_parameters``) with a
    separate ``rope_theta``, an MXFP4 ``quantization_config``, 24 alternating layers."""
    from jax_llm_runtime.models.families.gpt_oss import gpt_oss_config_from_hf

    hf = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64,
        "hidden_size": 2880, "intermediate_size": 2880, "max_position_embeddings": 131072,
        "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 24,
        "num_local_experts": 32, "num_experts_per_tok": 4, "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False,
        },
        "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "vocab_size": 201088,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "quantization_config": {"quant_method": "mxfp4"},
    }  # fmt: skip
    cfg = gpt_oss_config_from_hf(hf)
    rope = cfg.attention.rope
    assert (rope.rope_type, rope.factor, rope.theta, rope.truncate) == ("yarn", 32, 150000, False)
    assert rope.original_max_position_embeddings == 4096
    assert cfg.attention.sliding_window == 128 and cfg.sliding_layers == (True, False) * 12
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.swiglu_clamp) == (32, 4, (1.702, 7.0))
    assert cfg.segments == ((0, 24, True),)


def test_gpt_oss_moe_block_on_both_expert_paths():
    """The MoE block against transformers' on weights drawn large (so the clamp and the biases
    bite), through the grouped path (a batch) and the gathered one (single tokens)."""
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from jax_llm_runtime.models.families.gpt_oss import gpt_oss_config_from_hf
    from jax_llm_runtime.models.layers.moe import moe_mlp

    hf = gpt_oss_config(hidden_size=32, intermediate_size=16, swiglu_limit=0.5)
    torch.manual_seed(0)
    block = GptOssMLP(hf).float().eval()
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    gate_up, gate_up_b = sd["experts.gate_up_proj"], sd["experts.gate_up_proj_bias"]
    lw = {
        "router": sd["router.weight"].T, "router_b": sd["router.bias"],
        "e_gate": gate_up[..., ::2], "e_up": gate_up[..., 1::2],
        "e_gate_b": gate_up_b[..., ::2], "e_up_b": gate_up_b[..., 1::2],
        "e_down": sd["experts.down_proj"], "e_down_b": sd["experts.down_proj_bias"],
    }  # fmt: skip
    cfg = gpt_oss_config_from_hf(hf.to_dict()).moe
    x = np.random.default_rng(1).standard_normal((3, 5, 32)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x))[0].numpy()
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(moe_mlp(cfg, jnp.asarray(x), lw), want, atol=1e-5, rtol=0)
    for s, t in ((0, 0), (1, 2), (2, 4)):
        alone = moe_mlp(cfg, jnp.asarray(x[s : s + 1, t : t + 1]), lw)
        np.testing.assert_allclose(alone[0, 0], want[s, t], atol=1e-5, rtol=0)


def test_interleaved_gate_up_that_does_not_split_is_a_clear_error():
    from jax_llm_runtime.models.families.gpt_oss import GPT_OSS_WEIGHT_RULES
    from jax_llm_runtime.models.weights import WeightLoadError, load_host_weights

    shapes = {"e_gate": (1, 2, 4, 3), "e_up": (1, 2, 4, 3)}
    good = np.arange(2 * 4 * 6, dtype=np.float32).reshape(2, 4, 6)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    host = load_host_weights(shapes, GPT_OSS_WEIGHT_RULES, [(key, good)], np.float32)
    np.testing.assert_array_equal(host["e_gate"][0], good[..., 0::2])
    np.testing.assert_array_equal(host["e_up"][0], good[..., 1::2])
    with pytest.raises(WeightLoadError, match="does not interleave 3 \\+ 3 output columns"):
        load_host_weights(shapes, GPT_OSS_WEIGHT_RULES, [(key, good[..., :5])], np.float32)


def test_sinks_join_the_softmax_denominator():
    """The reference kernel against the formula: p = exp(s) / (sum(exp(s)) + exp(sink))."""
    from jax_llm_runtime.pallas_kernels.paged_attention import paged_attention

    rng = np.random.default_rng(0)
    num_heads, num_kv_heads, head_dim, page_size, kv_len = 4, 2, 8, 4, 7
    q = rng.standard_normal((1, 1, num_heads, head_dim)).astype(np.float32)
    k_cache = rng.standard_normal((1, 3, page_size, num_kv_heads, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal(k_cache.shape).astype(np.float32)
    k_cache[0, 2] = np.nan  # a page nobody owns
    sinks = rng.standard_normal(num_heads).astype(np.float32) * 2
    pages = np.asarray([[1, 0]], np.int32)
    out = paged_attention(
        jnp.asarray(q), k_cache, v_cache, jnp.int32(0), np.asarray([[kv_len - 1]], np.int32),
        pages, np.asarray([kv_len], np.int32), scale=0.5, sinks=jnp.asarray(sinks),
    )  # fmt: skip
    k = k_cache[0, pages[0]].reshape(-1, num_kv_heads, head_dim)[:kv_len]
    v = v_cache[0, pages[0]].reshape(-1, num_kv_heads, head_dim)[:kv_len]
    for h in range(num_heads):
        kv = h // (num_heads // num_kv_heads)
        scores = k[:, kv] @ q[0, 0, h] * 0.5
        p = np.exp(scores) / (np.exp(scores).sum() + np.exp(sinks[h]))
        np.testing.assert_allclose(np.asarray(out)[0, 0, h], p @ v[:, kv], atol=1e-5, rtol=0)


def test_sinks_run_on_the_reference_only():
    from jax_llm_runtime.pallas_kernels.paged_attention import attention
    from jax_llm_runtime.pallas_kernels.paged_attention.ops import (
        implementation,
        ragged_implementation,
    )

    q = jax.ShapeDtypeStruct((1, 1, 4, 8), jnp.float32)
    cache = jax.ShapeDtypeStruct((1, 3, 4, 2, 8), jnp.float32)
    for impl in ("auto", "cpu"):
        assert implementation(impl, q, cache, cache, native_ok=True, sinks=True) == "reference"
        flat = jax.ShapeDtypeStruct((2, 4, 8), jnp.float32)
        assert ragged_implementation(impl, flat, cache, cache, 2, True, sinks=True) == "reference"
    zeros = jnp.zeros(cache.shape)
    with pytest.raises(ValueError, match="native paged-attention kernel does not take attention"):
        attention(
            jnp.zeros(q.shape), zeros, zeros, jnp.int32(0), jnp.zeros((1, 1), jnp.int32),
            jnp.zeros((1, 3), jnp.int32), jnp.ones((1,), jnp.int32), scale=1.0,
            sinks=jnp.zeros(4), impl="native",
        )  # fmt: skip


def sharded_config():
    """Heads, KV heads and experts that split over 2 and 4 devices."""
    from tests.models.tiny_tokenizer import VOCAB_SIZE

    return gpt_oss_config(
        vocab_size=VOCAB_SIZE,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        bos_token_id=256,
        eos_token_id=None,
    )


@pytest.mark.slow
def test_gpt_oss_over_2_and_4_devices(tmp_path: Path) -> None:
    """Heads and KV heads split by tensor parallelism (each device its heads' sinks), experts
    replicated or split by expert parallelism: the greedy tokens never change."""
    from tests.models.tiny_tokenizer import save_byte_tokenizer
    from tests.runtime.test_tensor_parallel import check_split, run_sharded

    save_gpt_oss(sharded_config(), tmp_path)
    save_byte_tokenizer(tmp_path)
    replicated = run_sharded(tmp_path, "1,4")
    assert replicated["4"]["tokens"] == replicated["1"]["tokens"]
    split = run_sharded(tmp_path, "1,2,4", {"expert_parallel": True})
    check_split(split)
    for size, result in split.items():
        assert set(result["expert_bytes"]) == {split["1"]["expert_bytes"][0] // int(size)}
    assert split["1"]["tokens"] == replicated["1"]["tokens"]


# The OCP Microscaling spec's FP4 E2M1 values, code 0 to 15 (sign bit, then exponent and
# mantissa), written out independently of the runtime's table.
E2M1 = np.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float ``[..., out, in]`` matrix as MXFP4 ``blocks`` and ``scales`` (each block of 32
    scaled so that its largest magnitude lands within the E2M1 range, each value rounded to
    the nearest code)."""
    *lead, out, k = w.shape
    groups = w.reshape(*lead, out, k // 32, 32).astype(np.float32)
    amax = np.abs(groups).max(axis=-1)
    exponent = np.clip(np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127, 127).astype(int)
    scaled = groups / np.ldexp(1.0, exponent)[..., None]
    codes = np.abs(scaled[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # Contiguous: safetensors' numpy writer stores an array's memory as it lies.
    scales = (exponent + 127).astype(np.uint8)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(scales)


def dequantize_mxfp4_spec(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The spec's value of every element, ``[..., out, in]`` float32."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    with np.errstate(over="ignore", invalid="ignore"):  # 255 (NaN) and 6 * 2 ** 127 (inf)
        scale = np.ldexp(np.float32(1), scales.astype(int) - 127)
        values = E2M1[codes] * np.where(scales == 255, np.float32(np.nan), scale)[..., None]
    return values.reshape(*scales.shape[:-1], -1).astype(np.float32)


def test_mxfp4_dequantizes_bit_exactly():
    """Every code under every exponent whose products are normal float32 numbers (3..254, and
    255, NaN), against transformers' own MXFP4 dequantization in float32 and against the
    spec's table, on the host and the device. (Exponents 0..2 make subnormals, which XLA:CPU
    flushes to zero.)"""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jax_llm_runtime.pallas_kernels.dequant_matmul import dequantize
    from jax_llm_runtime.pallas_kernels.dequant_matmul.host import dequantize_host
    from jax_llm_runtime.pallas_kernels.dequant_matmul.mxfp4 import from_mxfp4

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 252, 2, 16), dtype=np.uint8)  # [experts, out, in/32, 16]
    scales = np.broadcast_to(np.arange(3, 255, dtype=np.uint8)[None, :, None], (3, 252, 2))
    scales = rng.permuted(scales, axis=1)
    scales[0, 0, 0] = 255
    packed = from_mxfp4(blocks, np.ascontiguousarray(scales))
    theirs = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales.copy()), dtype=torch.float32
    ).numpy()  # [experts, in, out]
    spec = np.swapaxes(dequantize_mxfp4_spec(blocks, scales), -1, -2)
    host = dequantize_host(packed)
    device = np.asarray(dequantize(packed.to_device()))
    assert np.isnan(host[0, :32, 0]).all() and np.isnan(device[0, :32, 0]).all()
    theirs[0, :32, 0] = np.nan  # transformers reads 255 as 2 ** 128
    for ours in (host, device):
        np.testing.assert_array_equal(ours.view(np.uint32), spec.view(np.uint32))
        finite = np.isfinite(theirs)
        np.testing.assert_array_equal(ours[finite].view(np.uint32), theirs[finite].view(np.uint32))
    assert np.isinf(spec).any() and np.isinf(host[np.isinf(spec)]).all()  # 6 * 2 ** 127


def save_mxfp4_gpt_oss(config, folder: Path, seed: int = 0):
    """A random gpt-oss saved as an MXFP4 checkpoint (experts as ``*_blocks``/``*_scales``);
    returns the HF float model holding exactly the values the MXFP4 experts stand for."""
    import json

    import torch
    from safetensors.numpy import load_file, save_file

    hf_model = save_gpt_oss(config, folder, seed)
    tensors = load_file(folder / "model.safetensors")
    params = dict(hf_model.named_parameters())
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = quantize_mxfp4(np.swapaxes(tensors.pop(name), -1, -2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        exact = np.swapaxes(dequantize_mxfp4_spec(blocks, scales), -1, -2)
        with torch.no_grad():
            params[name].copy_(torch.from_numpy(np.ascontiguousarray(exact)))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config_path = folder / "config.json"
    hf_config = json.loads(config_path.read_text())
    hf_config["quantization_config"] = {"quant_method": "mxfp4"}
    config_path.write_text(json.dumps(hf_config))
    return hf_model


def test_gpt_oss_mxfp4_experts_stay_packed(tmp_path):
    from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedWeight

    hf_model = save_mxfp4_gpt_oss(gpt_oss_config(), tmp_path, seed=2)
    model = load_ours(tmp_path)
    layers = model.weights.model(model.config).segments[0].layers
    for stack in (layers.ffn.e_gate, layers.ffn.e_up, layers.ffn.e_down):
        value = stack.kernel.get_value()
        assert isinstance(value, PackedWeight) and value.codebook == "e2m1", type(value)
    check_model(model, hf_model, seed=2)


@pytest.mark.slow
def test_gpt_oss_mxfp4_experts_split_over_4_devices(tmp_path: Path) -> None:
    """MXFP4 expert stacks split by expert parallelism, codes and exponents together."""
    from tests.models.tiny_tokenizer import save_byte_tokenizer
    from tests.runtime.test_tensor_parallel import check_split, run_sharded

    save_mxfp4_gpt_oss(sharded_config(), tmp_path)
    save_byte_tokenizer(tmp_path)
    results = run_sharded(tmp_path, "1,4", {"expert_parallel": True})
    check_split(results)
    single = results["1"]["expert_bytes"][0]
    assert set(results["4"]["expert_bytes"]) == {single // 4}
