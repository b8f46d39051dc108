"""DeepSeek V2/V3 multi-head latent attention against HF's attention modules.

Each case builds two seeded random HF attention layers, loads their state dicts through our
weight rules, and checks per-position outputs of (a) one ragged paged prefill step, (b) chunked
prefill followed by decode steps, and (c) the cache-free causal form, all against HF run on each
whole sequence. The paged runs use shuffled pages with random garbage in every page, and check
that pages nobody owns are left as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.layers.mla import (
    MLA_WEIGHT_RULES,
    MLAConfig,
    mla_cache_shapes,
    mla_causal,
    mla_config_from_hf,
    mla_weight_shapes,
    paged_mla,
)
from jax_llm_runtime.models.weights import load_weights
from jax_llm_runtime.pallas_kernels.paged_attention import KVCache

HIDDEN = 64
NUM_LAYERS = 2
PROMPT_LENS = (5, 13, 22)
NEW_TOKENS = 5
PAGE_SIZE = 4
PREFILL_CHUNK = 8
ATOL = 1e-5

TINY_MLA = dict(
    vocab_size=128,
    hidden_size=HIDDEN,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=64,
)
# mscale differs from mscale_all_dim, so both yarn gains are exercised: the cos/sin gain
# mscale(factor, 1.0) / mscale(factor, 0.707) and the softmax's mscale(factor, 0.707) ** 2.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

CASES = {
    "v3-lora-default": ("v3", dict(q_lora_rank=24, rope_parameters=DEFAULT_ROPE)),
    "v3-plain-yarn": ("v3", dict(q_lora_rank=None, rope_parameters=YARN)),
    "v3-halves-bias": (
        "v3",
        dict(q_lora_rank=24, rope_interleave=False, attention_bias=True, rope_parameters=YARN),
    ),
    "v2-lora-yarn": ("v2", dict(q_lora_rank=24, rope_parameters=YARN)),
    "v2-plain-default": ("v2", dict(q_lora_rank=None, rope_parameters=DEFAULT_ROPE)),
}


@dataclass(frozen=True)
class Reference:
    """HF's attention layers for one case and our config and weights built from them."""

    version: str  # "v2" or "v3"
    hf_config: Any
    rotary: Any  # the HF model's rotary module
    layers: list  # HF attention modules, one per layer
    cfg: MLAConfig
    weights: dict[str, jax.Array]  # stacked fields, as ``mla_weight_shapes`` names them

    def layer_weights(self, layer: int) -> dict[str, jax.Array]:
        return {name: w[layer] for name, w in self.weights.items()}

    def hf_outputs(self, layer: int, x: np.ndarray) -> np.ndarray:  # [seq_len, hidden]
        """HF's causal attention over one whole sequence ``x`` [seq_len, hidden]."""
        import torch

        seq_len = x.shape[0]
        hidden = torch.from_numpy(x)[None]
        position_ids = torch.arange(seq_len)[None]
        # Eager attention adds the mask to the scores: 0 where visible, a large negative above
        # the diagonal, shaped [batch, 1, q, kv].
        mask = torch.full((seq_len, seq_len), torch.finfo(torch.float32).min).triu(1)[None, None]
        with torch.no_grad():
            # V2's rotary module returns complex freqs_cis, V3's a (cos, sin) pair.
            embeddings = self.rotary(hidden, position_ids)
            out, _ = self.layers[layer](
                hidden_states=hidden, position_embeddings=embeddings, attention_mask=mask
            )
        return out[0].numpy()


def build_reference(version: str, overrides: dict[str, Any], seed: int = 0) -> Reference:
    import torch

    if version == "v2":
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as modeling
        from transformers.models.deepseek_v2.configuration_deepseek_v2 import (
            DeepseekV2Config as Config,
        )

        attention_cls, rotary_cls = modeling.DeepseekV2Attention, modeling.DeepseekV2RotaryEmbedding
    else:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import (
            DeepseekV3Config as Config,
        )

        attention_cls, rotary_cls = modeling.DeepseekV3Attention, modeling.DeepseekV3RotaryEmbedding
    hf_config = Config(**TINY_MLA, **overrides)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    layers = [attention_cls(hf_config, layer_idx=i).eval() for i in range(NUM_LAYERS)]
    for layer in layers:
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if name.endswith("layernorm.weight"):
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))  # not all ones
                elif name.endswith("bias"):
                    param.copy_(0.1 * torch.randn_like(param))
    tensors = [
        (f"model.layers.{i}.self_attn.{name}", tensor.numpy())
        for i, layer in enumerate(layers)
        for name, tensor in layer.state_dict().items()
    ]
    cfg = mla_config_from_hf(hf_config.to_dict())
    weights = load_weights(
        mla_weight_shapes(cfg, HIDDEN, NUM_LAYERS), MLA_WEIGHT_RULES, tensors, np.float32
    )
    return Reference(version, hf_config, rotary_cls(hf_config), layers, cfg, weights)


@pytest.fixture(params=list(CASES), scope="module")
def ref(request) -> Reference:
    version, overrides = CASES[request.param]
    return build_reference(version, overrides)


class PagedMLA:
    """Sequences run side by side through one latent cache, each on its own shuffled pages."""

    def __init__(self, ref: Reference, max_len: int, num_seqs: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.ref = ref
        pages_per_seq = -(-max_len // PAGE_SIZE)
        num_pages = num_seqs * pages_per_seq + 3  # a few pages that nobody owns
        k_shape, v_shape = mla_cache_shapes(ref.cfg, NUM_LAYERS, num_pages, PAGE_SIZE)
        self.cache = KVCache(
            k=jnp.asarray(rng.standard_normal(k_shape, np.float32)),
            v=jnp.zeros(v_shape, jnp.float32),
        )
        pages = rng.permutation(num_pages)
        self.unowned = pages[num_seqs * pages_per_seq :]
        self.garbage = np.asarray(self.cache.k)[:, self.unowned]
        self.page_indices = pages[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
        self.page_indices = self.page_indices.astype(np.int32)
        self.kv_lens = np.zeros(num_seqs, np.int32)
        self.attend = jax.jit(paged_mla, static_argnums=0)

    def step(self, xs: list[np.ndarray]) -> list[list[np.ndarray]]:
        """Append ``xs[i]`` [n_i, hidden] (maybe n_i == 0) to sequence i; every layer's outputs,
        ``[layer][seq]`` of shape [n_i, hidden]."""
        num_seqs = len(xs)
        q_lens = np.asarray([len(x) for x in xs], np.int32)
        q_len = max(1, int(q_lens.max()))
        x = np.zeros((num_seqs, q_len, HIDDEN), np.float32)
        positions = np.zeros((num_seqs, q_len), np.int32)
        for i, xi in enumerate(xs):
            x[i, : len(xi)] = xi
            positions[i, : len(xi)] = np.arange(self.kv_lens[i], self.kv_lens[i] + len(xi))
        kv_lens = np.where(q_lens > 0, self.kv_lens + q_lens, 0).astype(np.int32)
        batch = StepBatch.padded(
            np.zeros_like(positions), positions, q_lens, kv_lens, self.page_indices
        )
        # The step's rows as the batch lays them out: each sequence's tokens in turn, then padding
        # (with q_len 1, row i is sequence i).
        keep = np.arange(q_len)[None, :] < q_lens[:, None]
        flat = x.reshape(num_seqs, HIDDEN) if q_len == 1 else np.zeros((x.size // HIDDEN, HIDDEN))
        if q_len > 1:
            flat[: keep.sum()] = x[keep]
        starts = np.arange(num_seqs) if q_len == 1 else np.asarray(batch.q_starts[:-1])
        outs = []
        for layer in range(NUM_LAYERS):
            lw = self.ref.layer_weights(layer)
            out, self.cache = self.attend(
                self.ref.cfg,
                jnp.asarray(flat, jnp.float32),
                lw,
                self.cache,
                jnp.int32(layer),
                batch,
            )
            out = np.asarray(out)
            assert np.isfinite(out).all()
            outs.append([out[s : s + len(xi)] for s, xi in zip(starts, xs, strict=True)])
        self.kv_lens = self.kv_lens + q_lens
        return outs

    def check_untouched(self) -> None:
        assert self.cache.v.shape[-1] == 0
        np.testing.assert_array_equal(np.asarray(self.cache.k)[:, self.unowned], self.garbage)


def hidden_states(lengths: tuple[int, ...], seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, HIDDEN)).astype(np.float32) for n in lengths]


def test_config_matches_hf_modules(ref):
    """Scale, rope gain, frequencies and pairing read from the HF config agree with HF's modules."""
    cfg, hf_layer = ref.cfg, ref.layers[0]
    assert cfg.softmax_scale == pytest.approx(hf_layer.scaling, rel=1e-12)
    assert cfg.rope.attention_scale == pytest.approx(ref.rotary.attention_scaling, rel=1e-12)
    np.testing.assert_allclose(cfg.rope.inv_freq(), ref.rotary.inv_freq.numpy(), rtol=1e-6)
    assert cfg.rope.interleaved == (ref.version == "v2" or ref.hf_config.rope_interleave)
    assert cfg.cache_head_dim == 16 + 8
    if cfg.mscale_all_dim is not None:
        assert cfg.softmax_scale != pytest.approx(cfg.qk_head_dim**-0.5)


def test_ragged_prefill_matches_hf(ref):
    xs = hidden_states(PROMPT_LENS)
    runner = PagedMLA(ref, max(PROMPT_LENS), len(xs) + 1)
    outs = runner.step([*xs, xs[0][:0]])  # the last sequence is padding: no tokens at all
    for layer in range(NUM_LAYERS):
        for i, x in enumerate(xs):
            np.testing.assert_allclose(
                outs[layer][i], ref.hf_outputs(layer, x), atol=ATOL, rtol=0, err_msg=f"seq {i}"
            )
    runner.check_untouched()


def test_chunked_prefill_then_decode_matches_hf(ref):
    xs = hidden_states(tuple(n + NEW_TOKENS for n in PROMPT_LENS), seed=2)
    runner = PagedMLA(ref, max(map(len, xs)), len(xs), seed=3)
    ours: list[list[list[np.ndarray]]] = [[[] for _ in xs] for _ in range(NUM_LAYERS)]

    def run(chunks: list[np.ndarray]) -> None:
        for layer, outs in enumerate(runner.step(chunks)):
            for i, out in enumerate(outs):
                ours[layer][i].append(out)

    for start in range(0, max(PROMPT_LENS), PREFILL_CHUNK):
        run(
            [x[start : min(start + PREFILL_CHUNK, n)] for x, n in zip(xs, PROMPT_LENS, strict=True)]
        )
    for step in range(NEW_TOKENS):
        run([x[n + step : n + step + 1] for x, n in zip(xs, PROMPT_LENS, strict=True)])
    for layer in range(NUM_LAYERS):
        for i, x in enumerate(xs):
            np.testing.assert_allclose(
                np.concatenate(ours[layer][i]),
                ref.hf_outputs(layer, x),
                atol=ATOL,
                rtol=0,
                err_msg=f"layer {layer}, seq {i}",
            )
    runner.check_untouched()


def test_causal_matches_hf(ref):
    xs = hidden_states(PROMPT_LENS, seed=4)
    seq_len = max(PROMPT_LENS)
    x = np.zeros((len(xs), seq_len, HIDDEN), np.float32)
    for i, xi in enumerate(xs):
        x[i, : len(xi)] = xi
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (len(xs), seq_len))
    lengths = np.asarray(PROMPT_LENS, np.int32)
    attend = jax.jit(mla_causal, static_argnums=0)
    for layer in range(NUM_LAYERS):
        out = np.asarray(attend(ref.cfg, x, ref.layer_weights(layer), positions, lengths))
        assert np.isfinite(out).all()
        for i, xi in enumerate(xs):
            np.testing.assert_allclose(
                out[i, : len(xi)], ref.hf_outputs(layer, xi), atol=ATOL, rtol=0
            )


def test_config_validation():
    from jax_llm_runtime.models.layers.rotary import RopeConfig

    rope = RopeConfig(theta=10000.0, rotary_dim=8)
    base = dict(
        num_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope=rope,
    )
    with pytest.raises(ValueError, match="rotary_dim"):
        MLAConfig(**{**base, "qk_rope_head_dim": 4})
    with pytest.raises(ValueError, match="q_lora_rank"):
        MLAConfig(**{**base, "q_lora_rank": 0})
    with pytest.raises(ValueError, match="mscale_all_dim"):
        MLAConfig(**base, mscale_all_dim=1.0)
    # A cache built for ordinary attention (a V array with features) is refused up front.
    cfg = MLAConfig(**base)
    cache = KVCache(k=jnp.zeros((1, 2, 4, 1, 16)), v=jnp.zeros((1, 2, 4, 1, 16)))
    ids = jnp.zeros((1, 1), jnp.int32)
    batch = StepBatch.padded(ids, ids, np.ones(1, np.int32), np.ones(1, np.int32), ids)
    with pytest.raises(ValueError, match="mla_cache_shapes"):
        paged_mla(cfg, jnp.zeros((1, HIDDEN)), {}, cache, jnp.int32(0), batch)
