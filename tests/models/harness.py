"""Check one architecture against HF transformers on a tiny random-weight checkpoint.

A test builds a ``transformers`` config, and ``check_against_hf`` saves a seeded random model as
safetensors, loads it through our HF loader and registry, and compares (a) last-position logits of
a ragged batch of whole prompts and (b) greedy tokens decoded through the paged KV cache after a
chunked prefill, with shuffled pages and random garbage in every page no sequence owns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.layers.linear_attention import HybridCache
from jax_llm_runtime.models.registry import get_model_spec
from jax_llm_runtime.pallas_kernels.paged_attention import KVCache
from jax_llm_runtime.runtime.loading.gguf.loader import Checkpoint
from jax_llm_runtime.runtime.loading.hf_loader import load_hf_checkpoint

PROMPT_LENS = (5, 13, 22)
NEW_TOKENS = 16
PAGE_SIZE = 4
PREFILL_CHUNK = 8
LOGIT_ATOL = 1e-4


@dataclass(frozen=True)
class Loaded:
    spec: Any
    config: Any
    weights: Any


# A tiny shape every architecture test starts from (GQA: 4 query heads over 2 KV heads).
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def save_random_model(hf_config: Any, folder: Path, seed: int = 0) -> Any:
    """A float32 HF model with seeded random weights, saved as safetensors; returns the model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def save_tiny_byte_llama(folder: Path) -> Any:
    """Save a ``TINY`` random Llama over the byte tokenizer in ``folder``, with no EOS (so every
    request runs to its ``max_tokens``); return the HF model."""
    from transformers import LlamaConfig

    from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer

    config = LlamaConfig(**{**TINY, "vocab_size": VOCAB_SIZE, "bos_token_id": 256})
    config.eos_token_id = None
    hf_model = save_random_model(config, folder)
    save_byte_tokenizer(folder)
    return hf_model


def load_ours(folder: Path) -> Loaded:
    return load_checkpoint(load_hf_checkpoint(folder))


def load_checkpoint(checkpoint: Checkpoint) -> Loaded:
    """Our model from any checkpoint (HF folder or GGUF), through the registry."""
    spec = get_model_spec(checkpoint.config["architectures"][0])
    config = spec.config_from_hf(checkpoint.config)
    weights = spec.load(config, checkpoint.tensors(packed=True), np.float32, checkpoint.num_tensors)
    return Loaded(spec, config, weights)


class PagedRunner:
    """Sequences decoded side by side through one KV cache, each on its own shuffled pages."""

    def __init__(self, model: Loaded, max_len: int, num_seqs: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        cfg = model.config
        self.model = model
        self.pages_per_seq = -(-max_len // PAGE_SIZE)
        num_pages = num_seqs * self.pages_per_seq + 3  # a few pages that nobody owns
        k_shape, v_shape = cfg.cache_shapes(num_pages, PAGE_SIZE)
        self.cache = KVCache(
            k=rng.standard_normal(k_shape, np.float32), v=rng.standard_normal(v_shape, np.float32)
        )
        linear = getattr(cfg, "linear_attention", None)
        if linear is not None:  # state slots full of garbage: a new sequence must ignore it
            conv, rec = linear.state_shapes(cfg.num_linear_layers, num_seqs)
            conv, rec = rng.standard_normal(conv, np.float32), rng.standard_normal(rec, np.float32)
            self.cache = HybridCache(self.cache, conv, rec)
        pages = rng.permutation(num_pages)[: num_seqs * self.pages_per_seq]
        self.page_indices = pages.reshape(num_seqs, self.pages_per_seq).astype(np.int32)
        self.kv_lens = np.zeros(num_seqs, np.int32)
        self.forward = jax.jit(model.spec.forward, static_argnums=0)

    def step(self, new_tokens: list[list[int]]) -> np.ndarray:  # [num_seqs, vocab] float32
        """Append ``new_tokens[i]`` (maybe none) to sequence i; logits at each one's last token."""
        q_len = max(1, max(len(t) for t in new_tokens))
        if q_len > 1:  # prefill steps padded to whole chunks: fewer shapes to compile
            q_len = -(-q_len // PREFILL_CHUNK) * PREFILL_CHUNK
        num_seqs = len(new_tokens)
        tokens = np.zeros((num_seqs, q_len), np.int32)
        positions = np.zeros((num_seqs, q_len), np.int32)
        q_lens = np.asarray([len(t) for t in new_tokens], np.int32)
        for i, toks in enumerate(new_tokens):
            tokens[i, : len(toks)] = toks
            positions[i, : len(toks)] = np.arange(self.kv_lens[i], self.kv_lens[i] + len(toks))
        kv_lens = np.where(q_lens > 0, self.kv_lens + q_lens, 0).astype(np.int32)
        batch = StepBatch.padded(tokens, positions, q_lens, kv_lens, self.page_indices)
        logits, self.cache = self.forward(self.model.config, self.model.weights, self.cache, batch)
        self.kv_lens = self.kv_lens + q_lens
        return np.asarray(logits)


def prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).tolist() for n in PROMPT_LENS]


def check_last_logits(model: Loaded, hf_model: Any, ids: list[list[int]]) -> None:
    """Whole prompts in one ragged step: last-position logits match HF's."""
    import torch

    runner = PagedRunner(model, max(map(len, ids)), len(ids))
    ours = runner.step(ids)
    for i, prompt in enumerate(ids):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0, -1].numpy()
        np.testing.assert_allclose(ours[i], ref, atol=LOGIT_ATOL, rtol=0, err_msg=f"prompt {i}")


def greedy_paged(model: Loaded, ids: list[list[int]]) -> list[list[int]]:
    """Mixed steps, as the engine runs them: every sequence whose prompt is in decodes one token
    per step while the longer prompts are still prefilled ``PREFILL_CHUNK`` tokens at a time in
    the same steps (a step of decode rows and prefill chunks of several sequences)."""
    runner = PagedRunner(model, max(map(len, ids)) + NEW_TOKENS, len(ids), seed=1)
    out: list[list[int]] = [[] for _ in ids]
    done = [0] * len(ids)  # prompt tokens fed so far
    while any(len(o) < NEW_TOKENS for o in out):
        new = []
        for prompt, seq, fed in zip(ids, out, done, strict=True):
            if fed < len(prompt):
                new.append(prompt[fed : fed + PREFILL_CHUNK])
            else:
                new.append([seq[-1]] if len(seq) < NEW_TOKENS else [])
        logits = runner.step(new)
        for i, chunk in enumerate(new):
            done[i] += len(chunk) if done[i] < len(ids[i]) else 0
            if chunk and done[i] == len(ids[i]):
                out[i].append(int(logits[i].argmax()))
    return out


def greedy_hf(hf_model: Any, prompt: list[int]) -> list[int]:
    import torch

    hf_model.generation_config.eos_token_id = None  # random weights: never stop early
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf_model.generate(
            ids,
            # Explicit, or generate would mask every prompt token equal to pad_token_id.
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def check_against_hf(hf_config: Any, folder: Path, seed: int = 0) -> Loaded:
    """Both checks of the module docstring; returns our loaded model for extra assertions."""
    hf_model = save_random_model(hf_config, folder, seed)
    model = load_ours(folder)
    check_model(model, hf_model, seed)
    return model


def check_model(model: Loaded, hf_model: Any, seed: int = 0) -> None:
    """Our loaded ``model`` against the HF model it was converted from."""
    ids = prompts(hf_model.config.vocab_size, seed)
    check_last_logits(model, hf_model, ids)
    assert greedy_paged(model, ids) == [greedy_hf(hf_model, p) for p in ids]


def prompt_batch(config: Any, ids: list[int], padded: int, page_size: int) -> tuple[Any, StepBatch]:
    """A random-filled paged KV cache (five spare pages; unused pages hold noise) and a one-row
    prefill batch of ``ids`` padded to ``padded`` tokens on shuffled pages."""
    rng = np.random.default_rng(0)
    pages = padded // page_size
    k_shape, v_shape = config.cache_shapes(pages + 5, page_size)
    cache = KVCache(
        rng.standard_normal(k_shape, np.float32), rng.standard_normal(v_shape, np.float32)
    )
    page_indices = rng.permutation(pages + 5)[:pages][None].astype(np.int32)
    n = np.asarray([len(ids)])
    tokens = np.zeros((1, padded), np.int32)
    tokens[0, : len(ids)] = ids
    return cache, StepBatch.padded(tokens, np.arange(padded)[None], n, n, page_indices)


def check_vision_loading_is_strict(
    spec: Any, vision_config: Any, folder: Path, missing: str, extra: str, reshaped: str
) -> None:
    """A vision encoder's loading refuses a checkpoint without the tensor ``missing``, one with
    the unknown tensor ``extra``, and one whose ``reshaped`` has the wrong shape, naming each."""
    captured: dict[str, np.ndarray] = {}
    list(spec.vision.split_tensors(load_hf_checkpoint(folder).tensors(), captured))
    assert missing in captured and reshaped in captured
    without = {k: v for k, v in captured.items() if k != missing}
    _refused(spec, vision_config, without, missing.rsplit(".", 2)[-2])
    _refused(spec, vision_config, captured | {extra: np.zeros(3)}, extra.rsplit(".", 2)[-2])
    _refused(spec, vision_config, captured | {reshaped: np.zeros((3, 3))}, "shape")


def _refused(spec: Any, vision_config: Any, tensors: dict, match: str) -> None:
    from jax_llm_runtime.models.weights import WeightLoadError

    try:
        spec.vision.load(vision_config, tensors, np.float32)
    except WeightLoadError as e:
        assert match in str(e), (match, str(e))
    else:
        raise AssertionError(f"loading was not refused ({match})")
