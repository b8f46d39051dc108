"""Gemma 4 and Llama 4 (text) against HF transformers on tiny random models (see harness.py),
and under tensor parallelism on 4 fake CPU devices (see tests/runtime/test_tensor_parallel.py).

Gemma 4: plain RMSNorm weights, v norm, attention scale 1, a scalar per layer, full layers
with wider heads and fewer KV heads whose values are their keys, on a proportional rope, and
the MoE block beside the MLP. Llama 4: chunked attention, layers without rope with a query
temperature, L2 q/k norm, and MoE layers (alone or alternating with dense ones) whose top
expert sees its input times its sigmoid weight. Norm weights, layer scalars and router scales
are randomised (HF initialises them to ones) so that a mix-up shows.
"""

from __future__ import annotations

import pytest

from tests.models.harness import (
    TINY,
    check_last_logits,
    greedy_hf,
    greedy_paged,
    load_ours,
    prompts,
)

WINDOW = 8


def _gemma4_config(**fields):
    import transformers

    base = dict(
        TINY,
        num_hidden_layers=3,
        head_dim=16,
        global_head_dim=32,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        hidden_size_per_layer_input=0,
        pad_token_id=0,
        final_logit_softcapping=3.0,
    )
    config = transformers.Gemma4TextConfig(**{**base, **fields})
    config.architectures = ["Gemma4ForCausalLM"]
    config._experts_implementation = "eager"  # the per-expert loop: the plain reference
    return config


def _randomised(hf_config, folder, seed: int = 0):
    """A seeded random HF model whose norm weights, layer scalars and router scales are random
    too (HF initialises them to ones), saved as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name or name.endswith(("layer_scalar", "scale")):
                tensor.copy_(0.5 + torch.rand_like(tensor))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _check(hf_config, folder):
    hf_model = _randomised(hf_config, folder)
    model = load_ours(folder)
    # The harness's ``check_model``, reading the vocabulary of a multimodal config's text model.
    ids = prompts(hf_model.config.get_text_config().vocab_size)
    check_last_logits(model, hf_model, ids)
    assert greedy_paged(model, ids) == [greedy_hf(hf_model, p) for p in ids]
    return model


def test_gemma4_wide_full_layers_with_values_from_keys(tmp_path):
    hf = _gemma4_config(attention_k_eq_v=True, num_global_key_value_heads=1)
    model = _check(hf, tmp_path)
    att = model.config.attention
    assert (att.head_dim, att.head_dims, att.num_kv_heads) == (32, (16, 32), 2)
    assert model.config.sliding_layers == (True, False, False)  # the last layer is full


def test_gemma4_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """Gemma4ForConditionalGeneration: the text model under ``model.language_model``, the
    vision tower skipped; full layers with their own v projection, widened like the rest."""
    import transformers

    text = _gemma4_config(rope_parameters=_ROPES).to_dict()
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    hf = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    hf.architectures = ["Gemma4ForConditionalGeneration"]
    model = _check(hf, tmp_path)
    assert model.config.attention.rope.factor == 2.0
    assert not model.config.attention.full_values_from_keys


_ROPES = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100.0, "factor": 2.0,
    },
}  # fmt: skip


def test_gemma4_moe_block_beside_the_mlp(tmp_path):
    """enable_moe_block: every layer's dense MLP and top-2 of 4 experts side by side, the router
    on the normed, scaled residual stream, each expert's weight times its learned scale."""
    hf = _gemma4_config(
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24
    )
    model = _check(hf, tmp_path)
    assert model.config.moe_beside_mlp and model.config.segments == ((0, 3, True),)


def test_gemma4_per_layer_embeddings_and_kv_sharing(tmp_path):
    """Gemma 4 E2B's parts: per-layer embeddings, and the last two layers reusing the K/V of the
    last earlier sliding and full layers with MLPs twice as wide. The cache holds only the
    first three layers; the cache-free path (embeddings, scoring) matches HF's hidden states."""
    import numpy as np
    import torch

    from jax_llm_runtime.models.decoder import hidden_states

    types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    hf = _gemma4_config(
        num_hidden_layers=5, layer_types=[*types, "full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
        num_kv_shared_layers=2, use_double_wide_mlp=True,
    )  # fmt: skip
    model = _check(hf, tmp_path)
    cfg = model.config
    assert cfg.kv_sources == (0, 1, 2, 2, 1) and cfg.num_kv_layers == 3
    assert cfg.layer_intermediate_sizes == (128, 128, 128, 256, 256)
    assert cfg.segments == ((0, 3, False), (3, 5, False))

    hf_model = _randomised(hf, tmp_path / "again")
    ids = prompts(256)[2]
    with torch.no_grad():
        ref = hf_model.model(torch.tensor([ids])).last_hidden_state[0].numpy()
    n = len(ids)
    ours = hidden_states(
        cfg, model.weights, np.asarray([ids]), np.arange(n)[None], np.asarray([n])
    )[0]
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=1e-4)


def test_gemma4_bfloat16_checkpoint_keeps_its_per_layer_table_in_bfloat16(tmp_path):
    """Served in float32, a bfloat16 checkpoint's per-layer embedding table (E2B's: 9.4 GB in
    float32) stays in bfloat16, holding the same values: the logits and greedy tokens still
    match HF's float32 run of the same checkpoint. A float32 checkpoint's table is float32."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import configure_model
    from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint
    from tests.models.harness import Loaded

    hf = _gemma4_config(
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, num_kv_shared_layers=1
    )
    _randomised(hf, tmp_path / "f32").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tables = {}
    for name in ("f32", "bf16"):
        checkpoint = load_hf_checkpoint(tmp_path / name)
        engine = EngineConfig(model_id=str(tmp_path / name), dtype="float32")
        spec, cfg = configure_model(engine, checkpoint.config)
        weights = spec.load(cfg, checkpoint.tensors(packed=True), np.float32)
        tables[name] = weights["ple_embed"]
        assert weights["embed"].dtype == jnp.float32
    assert tables["f32"].dtype == jnp.float32 and tables["bf16"].dtype == jnp.bfloat16
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    reference = hf_model.model.embed_tokens_per_layer.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(tables["bf16"], np.float32), reference)
    model = Loaded(spec, cfg, weights)
    ids = prompts(256)
    check_last_logits(model, hf_model, ids)
    assert greedy_paged(model, ids) == [greedy_hf(hf_model, p) for p in ids]


def test_gemma4_saved_config_of_ten_layers_or_more():
    """transformers saves ``per_layer_config`` with zero-padded layer keys ("04" of 12 layers),
    as every released Gemma 4 has ten layers or more."""
    from jax_llm_runtime.models.registry import model_config_from_hf

    types = (["sliding_attention"] * 4 + ["full_attention"]) * 2 + ["sliding_attention"] * 2
    hf = _gemma4_config(num_hidden_layers=12, layer_types=types).to_dict()
    assert sorted(hf["per_layer_config"]) == ["04", "09", "11"]  # the last layer is full
    _, cfg = model_config_from_hf(hf)
    assert cfg.attention.head_dims == (16, 32)
    assert [i for i, s in enumerate(cfg.sliding_layers) if not s] == [4, 9, 11]


def test_gemma4_kv_sharing_without_an_earlier_layer_of_its_kind_is_refused():
    from jax_llm_runtime.models.registry import model_config_from_hf

    hf = _gemma4_config(num_kv_shared_layers=2).to_dict()  # leaves no full layer to reuse
    hf["layer_types"] = ["sliding_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"^Gemma 4 num_kv_shared_layers=2 leaves no earlier"):
        model_config_from_hf(hf)


@pytest.mark.parametrize(("field", "value"), [("attention_bias", True)])
def test_gemma4_unsupported_parts_are_refused(field, value):
    from jax_llm_runtime.models.registry import model_config_from_hf

    hf = {**_gemma4_config().to_dict(), field: value}
    with pytest.raises(ValueError, match=f"^Gemma 4 .*{field}={value!r}"):
        model_config_from_hf(hf)


@pytest.mark.slow
def test_gemma4_tensor_parallel_over_2_and_4_devices(tmp_path):
    """Greedy tokens do not change with the tensor-parallel size; the full layers' 2 KV heads
    are repeated to the sliding layers' 4, so every layer splits over 4 devices. The last layer
    reuses the K/V of the full layer before it with an MLP twice as wide, beside per-layer
    embeddings (E2B's parts), through the engine."""
    from tests.models.tiny_tokenizer import save_byte_tokenizer
    from tests.runtime.test_tensor_parallel import BASE, check_split, run_sharded

    hf = _gemma4_config(
        **{k: BASE[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")},
        num_attention_heads=8,
        num_key_value_heads=4,
        attention_k_eq_v=True,
        num_global_key_value_heads=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=BASE["vocab_size"],
        num_kv_shared_layers=1,
        use_double_wide_mlp=True,
    )
    _randomised(hf, tmp_path)
    save_byte_tokenizer(tmp_path)
    check_split(run_sharded(tmp_path, "1,4"))


@pytest.mark.slow
def test_gemma4_moe_block_with_expert_parallelism(tmp_path):
    """The MoE block's experts split over 4 devices (expert parallelism) beside the split MLP
    and attention: the one-device tokens."""
    from tests.models.tiny_tokenizer import save_byte_tokenizer
    from tests.runtime.test_tensor_parallel import BASE, check_split, run_sharded

    hf = _gemma4_config(
        **{k: BASE[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")},
        num_attention_heads=8,
        num_key_value_heads=4,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=24,
    )
    _randomised(hf, tmp_path)
    save_byte_tokenizer(tmp_path)
    results = run_sharded(tmp_path, "1,4", {"expert_parallel": True})
    check_split(results)
    assert set(results["4"]["expert_bytes"]) == {results["1"]["expert_bytes"][0] // 4}


# Llama 4: 4 layers, every 4th without rope (so layer 3 attends to everything with the query
# temperature), the others in chunks of 8 positions; prompts of up to 22 tokens plus 16 decoded
# cross several chunks. A floor scale of 4 makes the temperature change within the prompts.
LLAMA4 = dict(
    TINY,
    num_hidden_layers=4,
    head_dim=16,
    intermediate_size=32,
    intermediate_size_mlp=96,
    num_local_experts=4,
    num_experts_per_tok=1,
    attention_chunk_size=8,
    floor_scale=4,
    attn_scale=0.5,
    pad_token_id=0,
)


def _llama4_config(**fields):
    import transformers

    config = transformers.Llama4TextConfig(**{**LLAMA4, **fields})
    config.architectures = ["Llama4ForCausalLM"]
    return config


def test_llama4_chunked_nope_layers_and_moe(tmp_path):
    model = _check(_llama4_config(), tmp_path)
    cfg = model.config
    assert cfg.chunked_layers == (True, True, True, False)
    assert cfg.nope_layers == (False, False, False, True)
    assert cfg.segments == ((0, 4, True),)
    assert cfg.attention.rope.interleaved


def _chunk_case(seed: int = 0):
    """One layer's cache holding 2 sequences on shuffled pages of 4 (the unused rows NaN), and
    their queries: a 6-row chunk at positions 7..12 of a 13-long sequence, and a decode row at
    position 9."""
    import numpy as np

    rng = np.random.default_rng(seed)
    num_pages, page_size, kv_heads, head_dim = 10, 4, 2, 8
    k = np.full((1, num_pages, page_size, kv_heads, head_dim), np.nan, np.float32)
    v = k.copy()
    pages = rng.permutation(num_pages)[:8].reshape(2, 4).astype(np.int32)
    kv_lens = np.asarray([13, 10], np.int32)
    for s in range(2):
        for t in range(kv_lens[s]):
            page, row = pages[s, t // page_size], t % page_size
            k[0, page, row], v[0, page, row] = rng.standard_normal((2, kv_heads, head_dim))
    q = rng.standard_normal((7, 4, head_dim)).astype(np.float32)
    positions = np.asarray([7, 8, 9, 10, 11, 12, 9], np.int32)
    q_starts = np.asarray([0, 6, 7], np.int32)
    return k, v, pages, kv_lens, q, positions, q_starts


def _dense_chunked(k, v, pages, kv_len, q, positions, chunk):
    """Softmax attention of ``q`` over one sequence's keys, masked causally within chunks."""
    import numpy as np

    rows = k[0, pages].reshape(-1, *k.shape[3:])[:kv_len], v[0, pages].reshape(-1, *v.shape[3:])
    keys, values = rows[0], rows[1][:kv_len]
    keys = np.repeat(keys, q.shape[1] // keys.shape[1], axis=1)  # [t, heads, d]
    values = np.repeat(values, q.shape[1] // values.shape[1], axis=1)
    scores = np.einsum("qhd,thd->hqt", q, keys) / np.sqrt(q.shape[-1])
    t, p = np.arange(kv_len)[None, :], positions[:, None]
    scores = np.where((t <= p) & (t // chunk == p // chunk), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqt,thd->qhd", probs, values)


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_chunked_attention_mask_in_the_references(impl):
    """Padded and ragged calls with an attention chunk see only their own chunk's keys; the
    native kernel has no chunk mask, so a chunked call runs the reference whatever is asked."""
    import jax.numpy as jnp
    import numpy as np

    from jax_llm_runtime.pallas_kernels.paged_attention import attention, ragged_attention

    k, v, pages, kv_lens, q, positions, q_starts = _chunk_case()
    chunk, scale = 4, 8**-0.5
    want = np.concatenate(
        [
            _dense_chunked(k, v, pages[0], 13, q[:6], positions[:6], chunk),
            _dense_chunked(k, v, pages[1], 10, q[6:], positions[6:], chunk),
        ]
    )
    common = dict(scale=scale, attention_chunk=jnp.int32(chunk), impl=impl)
    layer = jnp.int32(0)
    k, v = jnp.asarray(k), jnp.asarray(v)
    ragged = ragged_attention(
        q, k, v, layer, positions, q_starts, pages, kv_lens, **common
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(ragged), want, atol=1e-5)
    padded = attention(
        q[None, :6], k, v, layer, positions[None, :6], pages[:1], kv_lens[:1], **common
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(padded[0]), want[:6], atol=1e-5)


def test_llama4_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """Llama4ForConditionalGeneration: the text model under ``language_model``, the vision
    model and projector skipped; two experts per token here."""
    import transformers

    vision = transformers.Llama4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
        projector_output_dim=64, rope_theta=10000,
    )  # fmt: skip
    text = _llama4_config(num_experts_per_tok=2).to_dict()
    hf = transformers.Llama4Config(text_config=text, vision_config=vision)
    hf.architectures = ["Llama4ForConditionalGeneration"]
    model = _check(hf, tmp_path)
    assert model.config.moe.top_k == 2


def test_llama4_dense_first_layers_and_no_qk_norm(tmp_path):
    """``moe_layers`` after a dense first layer (its MLP of ``intermediate_size_mlp``), no q/k
    norm, no temperature tuning."""
    hf = _llama4_config(moe_layers=[1, 2, 3], use_qk_norm=False, attn_temperature_tuning=False)
    model = _check(hf, tmp_path)
    assert model.config.segments == ((0, 1, False), (1, 4, True))
    assert model.config.attention.query_temperature is None


def test_llama4_moe_layers_alternating_with_dense_ones(tmp_path):
    """Maverick's layout: every second layer MoE, the others dense; each run of alike layers is
    its own segment, and the stacked fields of the dense and the MoE layers skip the others."""
    model = _check(_llama4_config(interleave_moe_layer_step=2), tmp_path)
    assert model.config.segments == ((0, 1, False), (1, 2, True), (2, 3, False), (3, 4, True))


@pytest.mark.slow
def test_llama4_tensor_parallel_with_expert_parallelism(tmp_path):
    """Greedy tokens do not change with the tensor-parallel size, with the routed experts
    replicated or split over the devices (expert parallelism)."""
    from tests.models.tiny_tokenizer import save_byte_tokenizer
    from tests.runtime.test_tensor_parallel import BASE, check_split, run_sharded

    hf = _llama4_config(
        **{k: BASE[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")},
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    _randomised(hf, tmp_path)
    save_byte_tokenizer(tmp_path)
    split = run_sharded(tmp_path, "1,2,4", {"expert_parallel": True})
    check_split(split)
    replicated = run_sharded(tmp_path, "4")
    assert replicated["4"]["tokens"] == split["1"]["tokens"]
