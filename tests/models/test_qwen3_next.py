"""Hybrid linear-attention models against HF transformers on tiny random models (harness.py):
Qwen3-Next (fused projections, MoE with a gated shared expert, a dense layer between MoE ones),
Qwen3.5 dense, and a multimodal Qwen3.5-MoE checkpoint served as its text model; the
gated delta rule's two forms and the causal convolution against transformers' torch fallbacks;
Qwen3-Next and Qwen3.5 under tensor parallelism on 4 fake CPU devices (and a split layer's
one collective).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.models.harness import TINY, check_against_hf, check_model, load_ours, save_random_model

HYBRID = dict(
    TINY,
    num_hidden_layers=4,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    pad_token_id=0,
)
# Linear, full, linear, full: the layer scan's segments alternate.
LAYER_TYPES = ["linear_attention", "full_attention"] * 2
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)


def _config(name: str, **fields):
    import transformers

    config = getattr(transformers, name)(**{**HYBRID, **fields})
    config._experts_implementation = "eager"
    return config


def test_qwen3_next(tmp_path):
    # Three value heads per key head, value heads narrower than key heads, a 3-wide conv.
    odd = dict(linear_num_value_heads=6, linear_value_head_dim=4, linear_conv_kernel_dim=3)
    hf = _config("Qwen3NextConfig", layer_types=LAYER_TYPES, mlp_only_layers=[2], **odd, **MOE)
    model = check_against_hf(hf, tmp_path)
    cfg = model.config
    assert cfg.linear_layers == (True, False, True, False)
    assert cfg.linear_attention.fused_projections
    assert cfg.moe_layers == (True, True, False, True)
    # K/V pages for the two full-attention layers only.
    assert cfg.cache_shapes(5, 4)[0] == (2, 5, 4, 2, 16)


def test_qwen3_5_dense_default_layer_types(tmp_path):
    """Also the cache-free hidden states (embeddings, prompt logprobs) of a ragged batch."""
    import torch

    from jax_llm_runtime.models.decoder import hidden_states

    hf = _config("Qwen3_5TextConfig", rope_parameters={"rope_theta": 1e4,
                 "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]})  # fmt: skip
    hf_model = save_random_model(hf, tmp_path, seed=1)
    model = load_ours(tmp_path)
    check_model(model, hf_model, seed=1)
    assert model.config.linear_layers == (True, True, True, False)  # full_attention_interval 4
    assert model.config.attention.rope.rotary_dim == 8
    lengths = np.asarray([7, 12])
    tokens = np.random.default_rng(0).integers(1, 256, (2, 12)).astype(np.int32)
    positions = np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))
    ours = np.asarray(hidden_states(model.config, model.weights, tokens, positions, lengths))
    for row, n in enumerate(lengths):
        with torch.no_grad():
            ref = hf_model.model(torch.tensor(tokens[row : row + 1, :n])).last_hidden_state
        np.testing.assert_allclose(ours[row, :n], ref[0].numpy(), atol=1e-4)


def test_qwen3_5_moe_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """A multimodal Qwen3.5-MoE checkpoint (text model under ``model.language_model``, vision
    tower skipped) against HF's MoE text model with the same weights."""
    import json

    import torch
    import transformers

    text = {**HYBRID, "layer_types": LAYER_TYPES, **MOE}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64)
    hf = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    hf.text_config._experts_implementation = "eager"
    torch.manual_seed(0)
    full = transformers.Qwen3_5MoeForConditionalGeneration(hf).eval()
    full.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "Qwen3_5MoeForConditionalGeneration"
    ]
    text_model = transformers.Qwen3_5MoeForCausalLM(hf.text_config).eval()
    text_model.model.load_state_dict(full.model.language_model.state_dict())
    text_model.lm_head.load_state_dict(full.lm_head.state_dict())
    model = load_ours(tmp_path)
    assert not model.config.linear_attention.fused_projections
    check_model(model, text_model)


def test_qwen3_5_moe_checkpoint_with_fused_expert_stacks(tmp_path):
    """Qwen3.5-MoE as its released checkpoints store the experts: one ``gate_up_proj``
    ``[experts, 2 * inter, hidden]`` (gate rows first) and one ``down_proj`` per layer, the
    layout transformers holds them in (its save_pretrained writes one tensor per expert, which
    the other tests check against HF): the same weights as the per-expert checkpoint's."""
    import re

    import jax
    from safetensors.numpy import load_file, save_file

    hf = _config("Qwen3_5MoeTextConfig", layer_types=LAYER_TYPES, **MOE)
    hf.architectures = ["Qwen3_5MoeForCausalLM"]
    save_random_model(hf, tmp_path)
    per_expert = load_ours(tmp_path).weights
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    expert = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(\w+)_proj\.weight")
    fused, parts = {}, {}
    for name, value in tensors.items():
        match = expert.fullmatch(name)
        if match is None:
            fused[name] = value
        else:
            parts.setdefault(match[1], {}).setdefault(match[3], {})[int(match[2])] = value
    for prefix, kinds in parts.items():
        stack = {kind: np.stack([e[i] for i in sorted(e)]) for kind, e in kinds.items()}
        fused[prefix + "gate_up_proj"] = np.concatenate([stack["gate"], stack["up"]], axis=1)
        fused[prefix + "down_proj"] = stack["down"]
    assert len(parts) == 4 and not any(expert.fullmatch(n) for n in fused)
    save_file(fused, path, metadata={"format": "pt"})
    stacked = load_ours(tmp_path).weights
    assert jax.tree.structure(stacked.state) == jax.tree.structure(per_expert.state)
    for a, b in zip(jax.tree.leaves(stacked.state), jax.tree.leaves(per_expert.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _gated_delta_inputs(seed: int, seq_len: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    batch, k_heads, v_heads, dk, dv = 2, 2, 4, 8, 6
    q = torch.randn(batch, seq_len, k_heads, dk, generator=g)
    k = torch.randn(batch, seq_len, k_heads, dk, generator=g)
    v = torch.randn(batch, seq_len, v_heads, dv, generator=g)
    decay = -torch.rand(batch, seq_len, v_heads, generator=g) * 2
    beta = torch.rand(batch, seq_len, v_heads, generator=g)
    state = torch.randn(batch, v_heads, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize(("seq_len", "chunk_size"), [(1, 4), (11, 4), (150, 64)])
def test_gated_delta_rule_forms_match_transformers(seq_len, chunk_size):
    import jax.numpy as jnp
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from jax_llm_runtime.models.layers import gated_delta_rule as gdr

    q, k, v, decay, beta, state = _gated_delta_inputs(seq_len, seq_len)
    kw = dict(g=decay, beta=beta, initial_state=state, output_final_state=True,
              use_qk_l2norm_in_kernel=True)  # fmt: skip
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(q, k, v, **kw)
    chunk_out, chunk_state = hf.torch_chunk_gated_delta_rule(q, k, v, chunk_size=chunk_size, **kw)
    np.testing.assert_allclose(chunk_out.numpy(), ref_out.numpy(), atol=1e-4)
    np.testing.assert_allclose(chunk_state.numpy(), ref_state.numpy(), atol=1e-4)
    qn, kn = gdr.normed_queries_keys(jnp.asarray(q.numpy()), jnp.asarray(k.numpy()), 4)
    args = (qn, kn, *(jnp.asarray(t.numpy()) for t in (v, decay, beta, state)))
    for out, new_state in (gdr.recurrent(*args), gdr.chunked(*args, chunk_size=chunk_size)):
        np.testing.assert_allclose(np.asarray(out), ref_out.numpy(), atol=1e-4)
        np.testing.assert_allclose(np.asarray(new_state), ref_state.numpy(), atol=1e-4)


def test_padding_tokens_leave_the_state_unchanged():
    import jax.numpy as jnp

    from jax_llm_runtime.models.layers import gated_delta_rule as gdr

    q, k, v, decay, beta, state = (jnp.asarray(t.numpy()) for t in _gated_delta_inputs(0, 9))
    qn, kn = gdr.normed_queries_keys(q, k, 4)
    real = 6
    pad = jnp.arange(9)[None, :, None] >= real
    decay, beta = jnp.where(pad, 0.0, decay), jnp.where(pad, 0.0, beta)
    want = gdr.recurrent(qn[:, :real], kn[:, :real], v[:, :real], decay[:, :real],
                         beta[:, :real], state)[1]  # fmt: skip
    for rule in (gdr.recurrent, gdr.chunked):
        got = rule(
            qn, kn, v, decay, beta, state, **({"chunk_size": 4} if rule is gdr.chunked else {})
        )
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want), atol=1e-5)


def test_causal_conv_matches_transformers_with_state():
    import jax.numpy as jnp
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from jax_llm_runtime.models.layers import gated_delta_rule as gdr

    g = torch.Generator().manual_seed(0)
    channels, kernel, seq_len = 6, 4, 5
    x = torch.randn(1, channels, seq_len, generator=g)
    weight = torch.randn(channels, kernel, generator=g)
    whole = hf.causal_conv1d_fn(x, weight, None, activation="silu")  # from a zero state
    head = 2  # the first two tokens, then the rest continuing from their state
    first, state = gdr.causal_conv(
        jnp.asarray(x[:, :, :head].numpy().transpose(0, 2, 1)),
        jnp.zeros((1, kernel - 1, channels)),
        jnp.asarray(weight.numpy()),
        jnp.asarray([head]),
    )
    rest, _ = gdr.causal_conv(
        jnp.asarray(x[:, :, head:].numpy().transpose(0, 2, 1)),
        state,
        jnp.asarray(weight.numpy()),
        jnp.asarray([seq_len - head]),
    )
    ours = np.concatenate([np.asarray(first), np.asarray(rest)], axis=1)
    np.testing.assert_allclose(ours, whole.numpy().transpose(0, 2, 1), atol=1e-5)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ],
)
def test_unsupported_config_is_a_one_line_error(fields, message):
    from jax_llm_runtime.models.registry import model_config_from_hf

    hf = {**HYBRID, "num_hidden_layers": 2, "architectures": ["Qwen3_5ForCausalLM"], **fields}
    with pytest.raises(ValueError, match=message) as error:
        model_config_from_hf(hf)
    assert "\n" not in str(error.value)


def test_linear_key_heads_that_do_not_divide_are_a_one_line_error(tmp_path):
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import configure_model
    from jax_llm_runtime.runtime.parallel.sharding import ShardingError

    hf = {**HYBRID, "architectures": ["Qwen3NextForCausalLM"], **MOE}
    config = EngineConfig(model_id=str(tmp_path), tensor_parallel_size=4)
    message = r"2 linear-attention key heads \(linear_num_key_heads\) do not divide by --tensor-p"
    with pytest.raises(ShardingError, match=message) as error:
        configure_model(config, hf)
    assert "\n" not in str(error.value)
    configure_model(EngineConfig(model_id=str(tmp_path), tensor_parallel_size=2), hf)


# Four key heads, so that every linear-attention layer splits over 4 devices.
TP_QWEN3_NEXT = dict(
    layer_types=LAYER_TYPES,
    mlp_only_layers=[2],
    linear_num_key_heads=4,
    linear_num_value_heads=12,
    linear_value_head_dim=4,
    linear_conv_kernel_dim=3,
    **MOE,
)
TP_QWEN3_5 = dict(layer_types=LAYER_TYPES, linear_num_key_heads=4, linear_num_value_heads=8)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "fields", "extra"),
    [
        ("Qwen3NextConfig", TP_QWEN3_NEXT, {"expert_parallel": True}),
        ("Qwen3_5TextConfig", TP_QWEN3_5, {}),
    ],
    ids=["qwen3_next", "qwen3_5"],
)
def test_tensor_parallel_over_4_devices(tmp_path, name, fields, extra):
    """On 4 fake CPU devices as on one: the last-position logits match HF's, and the greedy
    tokens are HF's for sequences run side by side (chunked prefill, a fork of ``n = 2``) and
    after preemption; each device holds a quarter of the state slots and of every
    linear-attention weight but the per-head norm (``hybrid_tensor_parallel_run.py``)."""
    import json

    import torch

    from tests.models.harness import LOGIT_ATOL, greedy_hf
    from tests.models.tiny_tokenizer import save_byte_tokenizer
    from tests.runtime.hybrid_tensor_parallel_run import NEW_TOKENS, prompts
    from tests.runtime.test_tensor_parallel import BASE, run_on_four_devices

    ids = {k: BASE[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")}
    hf_model = save_random_model(_config(name, **ids, **fields), tmp_path)
    save_byte_tokenizer(tmp_path)
    results = run_on_four_devices(
        "hybrid_tensor_parallel_run.py", str(tmp_path), "1,4", json.dumps(extra)
    )
    tokens = prompts(hf_model.config.vocab_size)
    with torch.no_grad():
        logits = [hf_model(torch.tensor([p])).logits[0, -1].numpy() for p in tokens]
    hf_model.generation_config.eos_token_id = None
    expected = [greedy_hf(hf_model, p)[:NEW_TOKENS] for p in tokens]
    for size, result in results.items():
        np.testing.assert_allclose(result["logits"], logits, atol=LOGIT_ATOL, rtol=0, err_msg=size)
        assert result["tokens"] == [*expected, expected[1], expected[1]], size
        assert result["preempted"] == expected and result["preemptions"] > 0, size
    one, four = results["1"], results["4"]
    for part, held in four["state_bytes"].items():
        assert held == [one["state_bytes"][part][0] // 4] * 4, part
    for field, held in four["field_bytes"].items():
        whole = one["field_bytes"][field][0]
        assert held == ([whole] if field == "la_norm" else [whole // 4]) * 4, field


def test_a_split_layer_communicates_once_after_its_output_projection():
    """Over 4 devices a linear-attention layer, a prompt chunk or a decode step, runs on each
    device's own heads: its weights, convolution and state slots split alike, so the compiled
    step holds one all-reduce (the output projection's partial sums) and nothing that moves
    q, k, v or the states between devices (``linear_attention_collectives_run.py``)."""
    from tests.runtime.test_tensor_parallel import run_on_four_devices

    results = run_on_four_devices("linear_attention_collectives_run.py")
    assert sorted(results) == [f"{p}/{k}" for p in ("fused", "split") for k in ("chunk", "decode")]
    for step, found in results.items():
        assert found == {"all-reduce": 1}, step


def test_int8_linear_attention_matches_hf_on_dequantized_weights(tmp_path):
    """``--isq int8`` packs the linear-attention projections too (b and a stay float)."""
    import dataclasses

    import torch

    from jax_llm_runtime.models.layers.linear import QuantizedWeight
    from jax_llm_runtime.models.registry import get_model_spec
    from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint
    from tests.models.harness import Loaded
    from tests.models.test_int8 import PROJECTIONS, _round_trip

    hf = _config("Qwen3_5TextConfig", num_hidden_layers=2, layer_types=LAYER_TYPES[:2])
    hf_model = save_random_model(hf, tmp_path)
    checkpoint = load_hf_checkpoint(tmp_path)
    spec = get_model_spec("Qwen3_5ForCausalLM")
    config = dataclasses.replace(spec.config_from_hf(checkpoint.config), quantization="int8")
    weights = spec.load(config, checkpoint.tensors(), np.float32, checkpoint.num_tensors)
    linear = weights["segments"][0]
    assert isinstance(linear["la_q"], QuantizedWeight)
    assert not isinstance(linear["la_b"], QuantizedWeight)
    packed = (*PROJECTIONS, "in_proj_qkv", "in_proj_z", "out_proj")
    with torch.no_grad():
        for name, module in hf_model.named_modules():
            if name.rsplit(".", 1)[-1] in packed:
                module.weight.copy_(_round_trip(module.weight))
    check_model(Loaded(spec, config, weights), hf_model)
