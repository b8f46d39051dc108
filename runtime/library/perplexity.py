"""Perplexity of a model on a text, computed the way llama.cpp's ``llama-perplexity`` does by
default, so the two numbers can be compared on the same GGUF and the same bytes of text.

The method (llama.cpp's ``tools/perplexity/perplexity.cpp``, no ``--ppl-stride``):

1. The whole text is tokenized once. When the tokenizer adds a BOS, one BOS is put in front
   (llama.cpp's ``common_tokenize(..., add_special=true)``); nothing else is added. (llama.cpp
   reads special-token text such as ``<|im_end|>`` as plain text, HF tokenizers as the special
   token; the default text holds none.)
2. The tokens are cut into ``len(tokens) // n_ctx`` chunks of ``n_ctx`` tokens; the tail that
   does not fill a chunk is dropped. At least two chunks are needed.
3. Each chunk is evaluated on its own from an empty context, at positions ``0 .. n_ctx - 1``.
   When the tokenizer adds a BOS, the chunk's first token is *replaced* by BOS.
4. Only the second half is scored, so every scored token has at least ``n_ctx / 2`` tokens of
   context: the logits at positions ``first = n_ctx // 2 .. n_ctx - 2`` predict the tokens at
   ``first + 1 .. n_ctx - 1`` (``n_ctx - first - 1`` tokens per chunk).
5. Each scored token's negative log-likelihood is ``-log_softmax(logits)[token]`` over the
   float32 logits; the NLLs and their squares are summed in float64.
6. ``PPL = exp(mean NLL)``; the ``±`` is llama.cpp's: the standard error of the mean NLL,
   ``sqrt((mean(NLL²) - mean(NLL)²) / (count - 1))``, times PPL.

The model runs through the architecture's cache-free forward (``hidden_states`` then
``lm_head`` on the scored half only), one jitted function of the fixed shape ``[1, n_ctx]``.

The default text is the terms of the GNU GPL version 3 (preamble through "END OF TERMS AND
CONDITIONS", about 7,000 SmolLM2 tokens of English prose). Its licence allows verbatim copies.
It is read from numpy's bundled licence file (numpy's Linux wheels ship libgfortran, and the GPL
text with it) or from Debian's ``/usr/share/common-licenses/GPL-3``, whichever holds the exact
bytes pinned by SHA-256 below.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.loading import builder
from jax_llm_runtime.runtime.loading.builder import LoadedModel
from jax_llm_runtime.runtime.text.tokenizer import Tokenizer

REFERENCE_TEXT_NAME = "GNU GPL v3 terms"
REFERENCE_TEXT_START = "GNU GENERAL PUBLIC LICENSE\n                       Version 3, 29 June 2007"
REFERENCE_TEXT_END = "END OF TERMS AND CONDITIONS"
REFERENCE_TEXT_SHA256 = "c68cfec778c71335f7b43a6ac23a1447ece79fc85eb3c6817c7119b7f7a360df"
DEBIAN_GPL3 = Path("/usr/share/common-licenses/GPL-3")
MIN_CTX = 4  # smaller chunks score no token, or one


class PerplexityError(ValueError):
    """The text or the settings cannot give a perplexity; the message says what to change."""


@dataclass(frozen=True)
class PerplexityResult:
    """One run: ``ppl`` ± ``ppl_error`` over ``num_scored`` tokens of ``num_chunks`` chunks.

    ``running_ppl[i]`` is the perplexity over chunks ``0..i`` (llama.cpp prints these as
    ``[1]...,[2]...``).
    """

    ppl: float
    ppl_error: float
    num_tokens: int
    num_chunks: int
    num_scored: int
    running_ppl: tuple[float, ...]


def reference_text() -> str:
    """The pinned default text (see the module docstring); PerplexityError when no source on
    this machine holds its exact bytes."""
    candidates = [*_numpy_licence_files(), DEBIAN_GPL3]
    for path in candidates:
        text = _slice(path)
        if text is not None and text_sha256(text) == REFERENCE_TEXT_SHA256:
            return text
    raise PerplexityError(
        f"the {REFERENCE_TEXT_NAME} (SHA-256 {REFERENCE_TEXT_SHA256[:12]}...) is in neither "
        f"numpy's licence files nor {DEBIAN_GPL3}; pass a text file instead"
    )


def read_text_file(path: Path) -> str:
    """A text file as llama.cpp's ``-f`` reads it: the bytes as UTF-8, one final newline dropped."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PerplexityError(f"cannot read {path} as UTF-8 text: {e}") from e
    return text[:-1] if text.endswith("\n") else text


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_model(config: EngineConfig, dequantize: bool = False) -> LoadedModel:
    """``runtime.loading.builder.load_model`` (quantized tensors packed unless ``dequantize``), for an
    architecture with a cache-free forward to score text with."""
    model = builder.load_model(config, packed=not dequantize)
    if model.spec.hidden_states is None or model.spec.lm_head is None:
        raise PerplexityError(
            f"{model.spec.hf_architecture} has no cache-free forward to score text"
        )
    return _with_kv_cache_dtype(model, config.kv_cache_dtype)


def _with_kv_cache_dtype(model: LoadedModel, name: str) -> LoadedModel:
    """``model`` whose cache-free attention rounds K and V as a ``--kv-cache-dtype name`` cache
    stores them (a float dtype; "auto" as the server resolves it: ``resolve_kv_cache_dtype``)."""
    stored = builder.resolve_kv_cache_dtype(
        name, model.dtype, builder.takes_int8_activations(model.weights)
    )
    if stored == model.dtype:
        return model
    attention = getattr(model.config, "attention", None)
    if name.startswith("fp8") or not hasattr(attention, "round_kv_to"):
        raise PerplexityError(
            f"--kv-cache-dtype {name} is not modelled by the cache-free forward of "
            f"{model.spec.hf_architecture}; use auto, float32, float16 or bfloat16"
        )
    attention = dataclasses.replace(attention, round_kv_to=stored.name)
    return dataclasses.replace(model, config=dataclasses.replace(model.config, attention=attention))


def adds_bos(tokenizer: Tokenizer) -> bool:
    """Whether encoding with special tokens puts a BOS in front (llama.cpp's ``add_bos``)."""
    bos = tokenizer.bos_token_id
    with_specials = tokenizer.encode("a", add_special_tokens=True)
    plain = tokenizer.encode("a", add_special_tokens=False)
    return bos is not None and with_specials[:1] == [bos] and plain[:1] != [bos]


def text_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """The whole text's tokens, with one BOS in front when the tokenizer adds one."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if adds_bos(tokenizer):
        tokens = [tokenizer.bos_token_id, *tokens]
    return tokens


def check_ctx(n_ctx: int) -> None:
    if n_ctx < MIN_CTX:
        raise PerplexityError(f"--ctx-size must be >= {MIN_CTX}, got {n_ctx}")


def make_chunks(
    tokens: Sequence[int], n_ctx: int, bos_token_id: int | None, max_chunks: int | None = None
) -> np.ndarray:  # [num_chunks, n_ctx] int32
    """Cut tokens into whole chunks of ``n_ctx``; each chunk starts with ``bos_token_id`` when
    given. ``max_chunks`` keeps only the first ones (llama.cpp's ``--chunks``)."""
    check_ctx(n_ctx)
    if len(tokens) < 2 * n_ctx:
        raise PerplexityError(
            f"the text has {len(tokens)} tokens; --ctx-size {n_ctx} needs at least {2 * n_ctx} "
            "(two chunks): use a longer text or a smaller --ctx-size"
        )
    if max_chunks is not None and max_chunks < 1:
        raise PerplexityError(f"--chunks must be >= 1, got {max_chunks}")
    num_chunks = len(tokens) // n_ctx
    if max_chunks is not None:
        num_chunks = min(num_chunks, max_chunks)
    chunks = np.asarray(tokens[: num_chunks * n_ctx], np.int32).reshape(num_chunks, n_ctx)
    if bos_token_id is not None:
        chunks[:, 0] = bos_token_id
    return chunks


def summarize(nll: np.ndarray, num_tokens: int) -> PerplexityResult:  # nll: [num_chunks, scored]
    """llama.cpp's final estimate from every scored token's negative log-likelihood."""
    nll = np.asarray(nll, np.float64)
    flat = nll.reshape(-1)
    count = flat.size
    mean = flat.mean()
    ppl = math.exp(mean)
    variance = float(np.mean(flat * flat) - mean * mean)
    error = math.sqrt(variance / (count - 1)) * ppl if variance > 0 and count > 1 else 0.0
    cumulative = np.cumsum(nll.sum(axis=1)) / (nll.shape[1] * np.arange(1, nll.shape[0] + 1))
    return PerplexityResult(
        ppl=ppl,
        ppl_error=error,
        num_tokens=num_tokens,
        num_chunks=nll.shape[0],
        num_scored=count,
        running_ppl=tuple(math.exp(x) for x in cumulative),
    )


class ChunkScorer:
    """The negative log-likelihoods of one chunk's scored half, through one jitted function of
    shape ``[1, n_ctx]`` (compiled by ``compile()`` or on the first call)."""

    def __init__(self, model: LoadedModel, n_ctx: int) -> None:
        check_ctx(n_ctx)
        limit = model.config.max_position_embeddings
        if n_ctx > limit:
            raise PerplexityError(
                f"--ctx-size {n_ctx} exceeds the model's context length {limit}; use a smaller one"
            )
        self.n_ctx = n_ctx
        self.weights = model.weights
        self._fn = jax.jit(
            functools.partial(
                _chunk_nll, model.spec.hidden_states, model.spec.lm_head, model.config
            )
        )
        self._compiled: Any = None

    def compile(self) -> float:
        """Compile ahead of time; returns the seconds it took."""
        start = time.perf_counter()
        tokens = jax.ShapeDtypeStruct((1, self.n_ctx), jnp.int32)
        self._compiled = self._fn.lower(self.weights, tokens).compile()
        return time.perf_counter() - start

    def __call__(self, chunk: np.ndarray) -> np.ndarray:  # [n_ctx] -> [n_ctx - n_ctx//2 - 1]
        fn = self._fn if self._compiled is None else self._compiled
        return np.asarray(fn(self.weights, jnp.asarray(chunk[None], jnp.int32)))[0]


def evaluate(
    scorer: ChunkScorer,
    chunks: np.ndarray,  # [num_chunks, n_ctx] int32
    num_tokens: int,
    on_chunk: Callable[[int, float], None] | None = None,
) -> PerplexityResult:
    """Score every chunk; ``on_chunk(index, running_ppl)`` is called after each."""
    rows = []
    total = 0.0
    for i, chunk in enumerate(chunks):
        rows.append(scorer(chunk))
        total += float(np.sum(rows[-1], dtype=np.float64))
        if on_chunk is not None:
            on_chunk(i, math.exp(total / (len(rows) * rows[-1].size)))
    return summarize(np.stack(rows), num_tokens)


def _chunk_nll(
    hidden_states: Callable[..., jax.Array],
    lm_head: Callable[..., jax.Array],
    cfg: Any,
    weights: Any,
    tokens: jax.Array,  # [num_seqs, n_ctx] int32
) -> jax.Array:  # [num_seqs, n_ctx - n_ctx // 2 - 1] float32
    num_seqs, n_ctx = tokens.shape
    first = n_ctx // 2
    positions = jnp.broadcast_to(jnp.arange(n_ctx, dtype=jnp.int32), (num_seqs, n_ctx))
    lengths = jnp.full((num_seqs,), n_ctx, jnp.int32)
    h = hidden_states(cfg, weights, tokens, positions, lengths)  # [num_seqs, n_ctx, hidden]
    logits = lm_head(cfg, weights, h[:, first : n_ctx - 1]).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)  # [num_seqs, scored, vocab]
    targets = tokens[:, first + 1 :]
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


def _numpy_licence_files() -> list[Path]:
    try:
        files = importlib.metadata.distribution("numpy").files or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [Path(str(f.locate())) for f in files if f.name.upper().startswith("LICENSE")]


def _slice(path: Path) -> str | None:
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    start = text.find(REFERENCE_TEXT_START)
    end = text.find(REFERENCE_TEXT_END, max(start, 0))
    if start < 0 or end < 0:
        return None
    return text[start : end + len(REFERENCE_TEXT_END)]
