"""Tokenizer: streaming detokenization (fast, byte-level stand-in) and SmolLM2 against transformers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from jax_llm_runtime.runtime.text.chat_template import ChatTemplateError
from jax_llm_runtime.runtime.text.tokenizer import Tokenizer, TokenizerError

TEXT = "Hi 🤗 naïve 日本語のテキスト 👨‍👩‍👧 ok 한국어!"
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 猫 🐱."},
    ],
]


class ByteTokenizer:
    """HF-tokenizer stand-in: ids 0..255 are bytes, 256 is a special end token."""

    bos_token_id = None
    eos_token_id = 256
    chat_template = None
    special_tokens_map = {"eos_token": "</s>"}  # noqa: RUF012

    def __len__(self) -> int:
        return 257

    def get_vocab(self) -> dict[str, int]:
        return {"</s>": 256}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i < 256)
        tail = "" if skip_special_tokens or 256 not in ids else "</s>"
        return data.decode("utf-8", errors="replace") + tail


@pytest.fixture
def byte_tokenizer() -> Tokenizer:
    return Tokenizer(ByteTokenizer(), frozenset({256}), None)


def test_incremental_decoder_holds_back_partial_utf8(byte_tokenizer: Tokenizer) -> None:
    ids = byte_tokenizer.encode(TEXT)
    decoder = byte_tokenizer.incremental_decoder()
    deltas = [decoder.push([i]) for i in ids]
    assert "".join(deltas) + decoder.flush() == TEXT
    assert all("\ufffd" not in d for d in deltas)
    emoji = "🤗".encode()
    decoder = byte_tokenizer.incremental_decoder()
    assert [decoder.push([b]) for b in emoji] == ["", "", "", "🤗"]


def test_incremental_decoder_chunks_and_specials(byte_tokenizer: Tokenizer) -> None:
    ids = [*byte_tokenizer.encode(TEXT), 256]
    for chunk in (2, 3, 7):
        decoder = byte_tokenizer.incremental_decoder()
        text = "".join(decoder.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk))
        assert text + decoder.flush() == TEXT
    decoder = byte_tokenizer.incremental_decoder(skip_special_tokens=False)
    assert "".join(decoder.push([i]) for i in ids) + decoder.flush() == TEXT + "</s>"


def test_invalid_utf8_is_released(byte_tokenizer: Tokenizer) -> None:
    decoder = byte_tokenizer.incremental_decoder()
    bad = [0xFF] * 8 + [ord("a")]
    text = "".join(decoder.push([b]) for b in bad) + decoder.flush()
    assert text == byte_tokenizer.decode(bad)
    decoder = byte_tokenizer.incremental_decoder()
    assert decoder.push([0xE4]) == ""
    assert decoder.flush() == "\ufffd"
    # A stream that never becomes valid UTF-8 is released rather than re-decoded forever.
    decoder = byte_tokenizer.incremental_decoder()
    released = "".join(decoder.push([0xFF]) for _ in range(200))
    assert 0 < len(released) <= 200 and set(released) == {"\ufffd"}
    assert released + decoder.flush() == "\ufffd" * 200


def test_decode_rejects_ids_outside_vocab(byte_tokenizer: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        byte_tokenizer.decode([1, 257])
    with pytest.raises(TokenizerError):
        byte_tokenizer.decode([-1])


def test_no_template(byte_tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        byte_tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> tuple[Tokenizer, object]:
    import transformers

    ours = Tokenizer.from_gguf(smollm2_gguf)
    reference = transformers.AutoTokenizer.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name
    )
    return ours, reference


@pytest.mark.slow
def test_smollm2_metadata(smollm2: tuple[Tokenizer, object]) -> None:
    tok, _ = smollm2
    assert tok.eos_token_ids == frozenset({2})
    assert tok.bos_token_id == 1
    assert tok.vocab_size == 49152
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.decode([2], skip_special_tokens=False) == "<|im_end|>"


@pytest.mark.slow
@pytest.mark.parametrize("text", [TEXT, "Hello world", " leading  spaces\n\ttabs", ""])
def test_smollm2_encode_decode_like_transformers(
    smollm2: tuple[Tokenizer, object], text: str
) -> None:
    tok, ref = smollm2
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == ref.encode(text, add_special_tokens=special)  # type: ignore[attr-defined]
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text  # type: ignore[attr-defined]


@pytest.mark.slow
def test_smollm2_splits_digits_like_llama_cpp(smollm2: tuple[Tokenizer, object]) -> None:
    # The GGUF's pre-tokenizer is "smollm": digits are split off before the GPT-2 regex, so
    # spaces before a digit stay one token. Expected ids are llama.cpp's (llama-server /tokenize).
    tok, _ = smollm2
    assert tok.encode("TERMS\n\n  0. Definitions") == [8978, 5247, 39892, 32, 30, 39331]
    assert tok.encode("in 2007,  12 times") == [254, 216, 34, 32, 32, 39, 28, 256, 33, 34, 1711]


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_like_transformers(
    smollm2: tuple[Tokenizer, object], messages: list[dict], add_generation_prompt: bool
) -> None:
    tok, ref = smollm2
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = ref.apply_chat_template(  # type: ignore[attr-defined]
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == expected
    # The template writes the special tokens itself; encoding adds none.
    ids = tok.encode(ours, add_special_tokens=False)
    assert ids[0] == tok.encode("<|im_start|>", add_special_tokens=False)[0]


@pytest.mark.slow
def test_smollm2_incremental_decode_token_by_token(smollm2: tuple[Tokenizer, object]) -> None:
    tok, _ = smollm2
    text = TEXT + " " + CONVERSATIONS[2][2]["content"]
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 20
    decoder = tok.incremental_decoder()
    deltas = [decoder.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + decoder.flush() == tok.decode(ids) == text


@pytest.mark.slow
def test_from_pretrained_dir_eos_union_and_no_remote_code(
    smollm2: tuple[Tokenizer, object], tmp_path: Path
) -> None:
    _, ref = smollm2
    ref.save_pretrained(str(tmp_path))  # type: ignore[attr-defined]
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    config["tokenizer_class"] = "EvilTokenizer"
    config_path.write_text(json.dumps(config))
    (tmp_path / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.eos_token_ids == frozenset({0, 2, 7})
    assert tok.encode(TEXT) == ref.encode(TEXT)  # type: ignore[attr-defined]
    assert tok.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_a_tool_response_token_after_gemma4_calls_ends_generation(
    smollm2: tuple[Tokenizer, object], tmp_path: Path
) -> None:
    """A vocabulary with Gemma 4's call and response tokens: the response token ends the turn
    (the caller writes the tool's response), though no config lists it."""
    _, ref = smollm2
    ref.save_pretrained(str(tmp_path))  # type: ignore[attr-defined]
    plain = Tokenizer.from_pretrained_dir(tmp_path)
    hf = Tokenizer.from_pretrained_dir(tmp_path).hf
    hf.add_special_tokens({"additional_special_tokens": ["<|tool_call>", "<|tool_response>"]})
    hf.save_pretrained(str(tmp_path))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    response = hf.convert_tokens_to_ids("<|tool_response>")
    assert tok.eos_token_ids == plain.eos_token_ids | {response}


def test_from_gguf_rejects_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + bytes(30))
    with pytest.raises(ValueError, match="GGUF"):
        Tokenizer.from_gguf(path)


@pytest.mark.slow
def test_gguf_tokenizer_cached_for_later_starts(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first start rebuilds the tokenizer from the GGUF file and saves it; a later start loads
    # the saved one (no GGUF parse) and tokenizes, renders and decodes exactly as the rebuilt one.
    import transformers

    from jax_llm_runtime.runtime.text import tokenizer_cache

    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / smollm2_gguf.name
    model.symlink_to(smollm2_gguf)
    built = Tokenizer.from_gguf(model)
    assert (tokenizer_cache.cache_folder(model) / "tokenizer.json").is_file()

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached tokenizer was rebuilt from the GGUF file")

    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained", no_rebuild)
        cached = Tokenizer.from_gguf(model)
    assert type(cached.hf) is type(built.hf)
    for attribute in ("eos_token_ids", "bos_token_id", "vocab_size", "chat_template"):
        assert getattr(cached, attribute) == getattr(built, attribute), attribute
    texts = [TEXT, " leading  spaces\n\ttabs", "TERMS\n\n  0. Definitions 12345", "<|im_end|>x"]
    for text in texts:
        for special in (True, False):
            ids = built.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids
            assert cached.decode(ids, skip_special_tokens=False) == built.decode(ids, False)
    for conversation in CONVERSATIONS:
        assert cached.apply_chat_template(conversation) == built.apply_chat_template(conversation)
    # A different file at the same path (another size and modification time) has its own entry.
    before = tokenizer_cache.cache_folder(model)
    model.unlink()
    model.write_bytes(b"GGUF")
    assert tokenizer_cache.cache_folder(model) != before
