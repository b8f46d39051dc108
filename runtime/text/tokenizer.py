"""Text <-> token ids through HF fast tokenizers, chat templates, and streaming detokenization.

A ``Tokenizer`` comes from a GGUF file (transformers rebuilds the fast tokenizer from the GGUF
vocabulary, once per file: ``tokenizer_cache`` keeps it for later starts) or from an HF folder (``tokenizer.json``/``tokenizer_config.json``). Remote code is
never run: a folder whose config asks for a custom class (``auto_map``) gets the generic fast
tokenizer over its ``tokenizer.json``.

Chat prompts: ``apply_chat_template`` renders the template (which already writes the BOS the
model expects), so callers encode the result with ``add_special_tokens=False``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jax_llm_runtime.runtime.loading.gguf.loader import read_gguf_header
from jax_llm_runtime.runtime.text import tokenizer_cache
from jax_llm_runtime.runtime.text.chat_template import render_chat_template

# Tokenizer metadata that llama.cpp treats as end of generation.
_GGUF_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)
# Real text reaches a clean character boundary within a few tokens; a stream that does not (a
# model emitting invalid UTF-8 forever) is released as U+FFFDs so the window stays bounded.
_MAX_UNCLEAN_TOKENS = 64
_LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, NotImplementedError)
# GGUF pre-tokenizer types that split every digit on its own before the GPT-2 regex (llama.cpp's
# "\p{N}" step). transformers rebuilds these as plain GPT-2 byte-level tokenizers, which
# tokenizes whitespace before a digit differently from the model's own tokenizer.
_GGUF_DIGIT_SPLIT_PRE = frozenset({"smollm"})


class TokenizerError(ValueError):
    """A tokenizer could not be loaded, or was given token ids outside its vocabulary."""


class Tokenizer:
    """An HF fast tokenizer plus what serving needs: end-of-sequence ids and the chat template.

    ``vocab_size`` counts added tokens too (``len`` of the HF tokenizer); a model's embedding
    table may be larger. ``eos_token_ids`` are all ids that end generation.
    """

    def __init__(
        self, hf_tokenizer: Any, eos_token_ids: frozenset[int], chat_template: str | None
    ) -> None:
        self._hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self.chat_template = chat_template
        self.reasoning_markers = detect_reasoning_markers(hf_tokenizer.get_vocab(), chat_template)

    @property
    def hf(self) -> Any:
        """The wrapped HF fast tokenizer (for libraries that take one, e.g. grammar matching)."""
        return self._hf

    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        """Build the tokenizer stored in a GGUF file. EOS ids are the file's eos/eot/eom ids."""
        # Bounds-check the file first: transformers parses it with gguf.GGUFReader, which can
        # loop forever on a crafted file.
        metadata = read_gguf_header(path).metadata

        def build() -> Any:
            from transformers import AutoTokenizer

            try:
                hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            except _LOAD_ERRORS as e:
                raise TokenizerError(f"cannot build a tokenizer from {path}: {e}") from e
            if metadata.get("tokenizer.ggml.pre") in _GGUF_DIGIT_SPLIT_PRE:
                _split_digits(hf)
            return hf

        hf = tokenizer_cache.load_or_build(path, build)
        eos = {metadata[k] for k in _GGUF_EOS_KEYS if isinstance(metadata.get(k), int)}
        template = metadata.get("tokenizer.chat_template") or _default_template(hf)
        return cls(hf, _with_hf_eos(eos, hf), template)

    @classmethod
    def from_pretrained_dir(cls, folder: Path) -> Tokenizer:
        """Load ``tokenizer.json``/``tokenizer_config.json`` from an HF folder, never running its
        code. EOS ids: the tokenizer's, plus ``eos_token_id`` of config.json and
        generation_config.json (an int or a list)."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        tokenizer_config = _read_json(folder / "tokenizer_config.json")
        try:
            if "auto_map" in tokenizer_config:
                hf = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
            else:
                hf = AutoTokenizer.from_pretrained(
                    str(folder), trust_remote_code=False, local_files_only=True
                )
        except _LOAD_ERRORS as e:
            raise TokenizerError(f"cannot load a tokenizer from {folder}: {e}") from e
        eos: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            value = _read_json(folder / name).get("eos_token_id")
            values = value if isinstance(value, list) else [value]
            eos.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
        return cls(hf, _with_hf_eos(eos, hf), _default_template(hf))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text to token ids. ``add_special_tokens`` adds what the tokenizer is configured to add
        (usually a BOS); pass False for text rendered by ``apply_chat_template``."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text; incomplete UTF-8 becomes U+FFFD. Raises TokenizerError for ids
        outside ``[0, vocab_size)``."""
        ids = list(token_ids)
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise TokenizerError(
                    f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages with the model's template in the sandbox (see ``chat_template``).

        The tokenizer's special tokens (``bos_token``, ``eos_token``, ...) are template variables,
        overridable through ``kwargs``. Encode the result with ``add_special_tokens=False``.
        Raises ChatTemplateError (a ValueError), also when the model has no template.
        """
        variables = {**self._hf.special_tokens_map, **kwargs}
        bos, eos = variables.pop("bos_token", None), variables.pop("eos_token", None)
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt, bos, eos, **variables
        )

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh streaming decoder for one sequence's output tokens."""
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas.

    Each push re-decodes only a short window (the tokens since the last-but-one clean boundary)
    and returns the text that window gained, so the cost per token stays constant. A trailing
    U+FFFD (an incomplete UTF-8 sequence) is held back until later tokens complete it. The
    concatenation of all pushes and a final ``flush()`` equals ``decode(all ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        # Tokens before read_offset end on a clean character boundary and have been returned;
        # the window starts one clean boundary earlier so that decoders which treat the first
        # token specially (SentencePiece's leading space) see context.
        self._prefix_offset = 0
        self._read_offset = 0
        self._held_emitted = 0  # chars returned past read_offset while the window ends unclean

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly completed text (possibly "")."""
        self._ids.extend(token_ids)
        stuck = len(self._ids) - self._read_offset > _MAX_UNCLEAN_TOKENS
        return self._advance(force=stuck)

    def flush(self) -> str:
        """Return whatever is still held back (call once the sequence has finished)."""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip)
        text = decode(self._ids[self._prefix_offset :], skip)
        stable = text if force else text.rstrip("\ufffd")
        delta = stable[len(prefix_text) + self._held_emitted :]
        if stable == text:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._held_emitted = 0
        else:
            self._held_emitted += len(delta)
        return delta


# Think markers of reasoning models (DeepSeek-R1, Qwen3, QwQ, GLM 4.5, MiniMax-M2, ...), as
# (start, end).
REASONING_MARKERS = (("<think>", "</think>"),)
# gpt-oss: reasoning is harmony's analysis channel. Its replies are split by the channels of
# their messages, not by a marker pair (``api.generation.reasoning``); this pair names the format.
HARMONY_MARKERS = ("<|channel|>analysis<|message|>", "<|end|>")
# Gemma 4: ``<|channel>thought`` ... ``<channel|>``, the channel tokens special ones; its replies
# are split by ``api.generation.reasoning.Gemma4ReasoningParser``.
GEMMA4_MARKERS = ("<|channel>thought", "<channel|>")
# Markers that are special tokens, which a decode that skips special tokens would drop: the chat
# route keeps special tokens in the text of these models' replies.
SPECIAL_TOKEN_MARKERS = (HARMONY_MARKERS, GEMMA4_MARKERS)


def detect_reasoning_markers(
    vocab: dict[str, int], chat_template: str | None
) -> tuple[str, str] | None:
    """The model's think markers: ``HARMONY_MARKERS`` for a harmony model (``<|channel|>`` and
    ``<|message|>`` are tokens of its vocabulary, or its template writes channels),
    ``GEMMA4_MARKERS`` for Gemma 4 (``<|channel>`` and ``<channel|>`` are tokens of its
    vocabulary, or its template writes ``<channel|>``), else a known pair whose both halves are
    tokens of its vocabulary, or appear in its chat template; None for a model without them."""
    if ("<|channel|>" in vocab and "<|message|>" in vocab) or (
        chat_template and "<|channel|>" in chat_template
    ):
        return HARMONY_MARKERS
    if ("<|channel>" in vocab and "<channel|>" in vocab) or (
        chat_template and "<channel|>" in chat_template
    ):
        return GEMMA4_MARKERS
    for start, end in REASONING_MARKERS:
        if (start in vocab and end in vocab) or (chat_template and end in chat_template):
            return start, end
    return None


def _split_digits(hf: Any) -> None:
    from tokenizers import pre_tokenizers

    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _default_template(hf: Any) -> str | None:
    template = getattr(hf, "chat_template", None)
    # Some tokenizers carry several named templates; "default" is the one for plain chats.
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


# Gemma 4 ends a turn that calls a tool with the call: the next token it writes opens the tool's
# response, which the caller supplies, so that token ends generation (as llama.cpp and vLLM treat
# it), whether or not the model's config lists it.
_CALL_ENDS_TURN = {"<|tool_call>": "<|tool_response>"}


def _with_hf_eos(eos: set[int], hf: Any) -> frozenset[int]:
    if hf.eos_token_id is not None:
        eos.add(hf.eos_token_id)
    vocab = hf.get_vocab()
    for call, response in _CALL_ENDS_TURN.items():
        if call in vocab and response in vocab:
            eos.add(vocab[response])
    return frozenset(eos)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return value
