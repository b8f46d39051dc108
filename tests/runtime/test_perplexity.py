"""runtime/library/perplexity.py and tools/perplexity.py on a tiny random Llama: the chunked perplexity
equals an independent HF transformers (PyTorch) computation over the same chunks, and bad
settings are one-line errors."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.library.perplexity import (
    REFERENCE_TEXT_SHA256,
    ChunkScorer,
    LoadedModel,
    PerplexityError,
    adds_bos,
    evaluate,
    load_model,
    make_chunks,
    read_text_file,
    reference_text,
    summarize,
    text_sha256,
    text_tokens,
)
from jax_llm_runtime.runtime.text.tokenizer import Tokenizer
from tests.models.harness import TINY, save_random_model
from tests.models.tiny_tokenizer import BOS, VOCAB_SIZE, save_byte_tokenizer
from tests.tools import load_tool

N_CTX = 32
BOS_ID = 256
TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. " * 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, LoadedModel]:
    import transformers

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": VOCAB_SIZE, "bos_token_id": BOS_ID})
    hf_model = save_random_model(config, folder)
    save_byte_tokenizer(folder)
    return folder, hf_model, load_model(EngineConfig(model_id=str(folder), dtype="float32"))


def _bos_adding(model: LoadedModel) -> LoadedModel:
    """The same model with a tokenizer that puts BOS in front, like Llama's."""
    from tokenizers import processors

    hf = model.tokenizer._hf
    hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)]
    )
    tokenizer = Tokenizer(hf, model.tokenizer.eos_token_ids, None)
    return LoadedModel(model.files, model.spec, model.config, model.weights, tokenizer, model.dtype)


def _hf_nll(hf_model, tokens: list[int], bos: int | None) -> np.ndarray:  # [chunks, scored]
    """Per-token NLLs of llama-perplexity's method, written out independently with torch."""
    import torch

    rows = []
    first = N_CTX // 2
    for start in range(0, len(tokens) - N_CTX + 1, N_CTX):
        chunk = list(tokens[start : start + N_CTX])
        if bos is not None:
            chunk[0] = bos
        with torch.no_grad():
            logits = hf_model(torch.tensor([chunk])).logits[0].double()
        log_probs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(chunk[first + 1 :])
        rows.append(-log_probs[first : N_CTX - 1].gather(1, targets[:, None])[:, 0].numpy())
    return np.stack(rows)


@pytest.mark.parametrize("with_bos", [False, True], ids=["no-bos", "bos"])
def test_chunked_perplexity_matches_hf(tiny, with_bos: bool) -> None:
    _, hf_model, model = tiny
    if with_bos:
        model = _bos_adding(model)
    assert adds_bos(model.tokenizer) is with_bos
    tokens = text_tokens(model.tokenizer, TEXT)
    plain = model.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(plain) == len(TEXT)
    assert tokens == ([BOS_ID, *plain] if with_bos else plain)

    bos = BOS_ID if with_bos else None
    chunks = make_chunks(tokens, N_CTX, bos)
    assert chunks.shape == (len(tokens) // N_CTX, N_CTX)
    seen = []
    result = evaluate(ChunkScorer(model, N_CTX), chunks, len(tokens), lambda i, p: seen.append(p))

    expected = summarize(_hf_nll(hf_model, tokens, bos), len(tokens))
    assert result.num_chunks == expected.num_chunks == len(tokens) // N_CTX
    assert result.num_scored == result.num_chunks * (N_CTX - N_CTX // 2 - 1)
    assert result.ppl == pytest.approx(expected.ppl, rel=1e-4)
    assert result.ppl_error == pytest.approx(expected.ppl_error, rel=1e-4)
    assert seen == pytest.approx(list(expected.running_ppl), rel=1e-4)
    assert result.running_ppl[-1] == pytest.approx(result.ppl, rel=1e-12)


def test_summarize_is_llama_cpp_estimate() -> None:
    nll = np.array([[1.0, 2.0, 3.0], [2.0, 2.0, 5.0]])
    result = summarize(nll, 100)
    mean = nll.mean()
    assert result.ppl == pytest.approx(math.exp(mean))
    std_error = math.sqrt(((nll**2).mean() - mean**2) / (nll.size - 1))
    assert result.ppl_error == pytest.approx(std_error * math.exp(mean))
    assert result.running_ppl == pytest.approx((math.exp(2.0), math.exp(mean)))


def test_chunk_argument_errors(tiny) -> None:
    _, _, model = tiny
    with pytest.raises(PerplexityError, match=r"needs at least 64 \(two chunks\)"):
        make_chunks(list(range(63)), N_CTX, None)
    with pytest.raises(PerplexityError, match="--ctx-size must be >= 4, got 2"):
        make_chunks(list(range(100)), 2, None)
    with pytest.raises(PerplexityError, match="--chunks must be >= 1"):
        make_chunks(list(range(100)), N_CTX, None, max_chunks=0)
    assert make_chunks(list(range(100)), N_CTX, None, max_chunks=2).shape == (2, N_CTX)
    with pytest.raises(PerplexityError, match="exceeds the model's context length 256"):
        ChunkScorer(model, 512)


def test_text_files_read_like_llama_cpp(tmp_path: Path) -> None:
    text = reference_text()
    assert text_sha256(text) == REFERENCE_TEXT_SHA256
    assert text.startswith("GNU GENERAL PUBLIC LICENSE") and text.endswith("CONDITIONS")
    path = tmp_path / "t.txt"
    path.write_bytes(b"two lines\n\n")
    assert read_text_file(path) == "two lines\n"  # llama.cpp's -f drops one final newline
    path.write_bytes(b"\xff")
    with pytest.raises(PerplexityError, match="UTF-8"):
        read_text_file(path)


def test_tool_errors_are_one_line(tiny, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder, _, _ = tiny
    tool = load_tool("perplexity.py")
    text = tmp_path / "short.txt"
    text.write_text("too short\n")
    common = ["--model-id", str(folder), "--text-file", str(text)]
    common += ["--write-text", str(tmp_path / "copy.txt")]
    cases = [
        (["--ctx-size", "2"], "error: --ctx-size must be >= 4, got 2"),
        (["--ctx-size", "8"], "error: the text has 9 tokens; --ctx-size 8 needs at least 16"),
        (["--isq", "int3"], "error: isq must be"),
        (["--peer", "--ctx-size", "4"], "error: --peer needs a GGUF model"),
    ]
    for extra, message in cases:
        assert tool.main(common + extra) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
        assert len(lines) == 1 and lines[0].startswith(message), (extra, lines)
    assert (tmp_path / "copy.txt").read_bytes() == b"too short\n"


FAKE_PEER = """#!/bin/sh
echo "0.00.240.326 I perplexity: calculating perplexity over 13 chunks, n_ctx=512" >&2
printf "0.02.183.022 I perplexity: 1.94 seconds per pass - ETA " >&2
echo "0.42 minutes"
echo "[1]16.9922,[2]18.1287,"
echo "0.59.471.586 I Final estimate: PPL = 17.7595 +/- 0.85936" >&2
echo "$@" > "$(dirname "$0")/argv"
"""


def test_peer_output_is_parsed(tmp_path: Path) -> None:
    import argparse

    tool = load_tool("perplexity.py")
    fake = tmp_path / "llama-perplexity"
    fake.write_text(FAKE_PEER)
    fake.chmod(0o755)
    args = argparse.Namespace(peer_bin=fake, ctx_size=512, threads=2)
    peer = tool._peer(args, Path("m.gguf"), Path("t.txt"), 13)
    assert (peer["ppl"], peer["ppl_error"], peer["num_chunks"]) == (17.7595, 0.85936, 13)
    assert peer["eval_seconds"] == pytest.approx(59.471586 - 0.240326)
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:10] == ["-m", "m.gguf", "-f", "t.txt", "-c", "512", "-b", "512", "-t", "2"]
    fake.write_text("#!/bin/sh\necho 'failed to load model' >&2\nexit 1\n")
    with pytest.raises(PerplexityError, match=r"llama-perplexity failed \(exit 1\): failed to"):
        tool._peer(args, Path("m.gguf"), Path("t.txt"), 13)
    fake.write_text("#!/bin/sh\necho 'you need at least 1024 tokens' >&2\n")
    with pytest.raises(PerplexityError, match="llama-perplexity gave no estimate: you need"):
        tool._peer(args, Path("m.gguf"), Path("t.txt"), 13)


def test_a_16_bit_kv_cache_is_scored_with_k_and_v_rounded(tiny) -> None:
    """``--kv-cache-dtype float16|bfloat16``: the cache-free forward rounds K and V as the paged
    cache stores them, which moves each token's NLL a little (bfloat16 more than float16), and
    a cache it cannot model (fp8's scaled rows) is a one-line error."""
    folder, _, model = tiny
    tokens = text_tokens(model.tokenizer, TEXT)
    chunks = make_chunks(tokens, N_CTX, None)
    nll = {}
    for name in ("auto", "float16", "bfloat16"):
        rounded = load_model(
            EngineConfig(model_id=str(folder), dtype="float32", kv_cache_dtype=name)
        )
        assert rounded.config.attention.round_kv_to == (None if name == "auto" else name)
        nll[name] = np.stack([ChunkScorer(rounded, N_CTX)(chunk) for chunk in chunks])
    for name, bound in (("float16", 1e-2), ("bfloat16", 1e-1)):
        moved = np.abs(nll[name] - nll["auto"]).max()
        assert 0 < moved < bound, (name, moved)
    assert np.abs(nll["bfloat16"] - nll["auto"]).max() > np.abs(nll["float16"] - nll["auto"]).max()
    with pytest.raises(PerplexityError, match="--kv-cache-dtype fp8 is not modelled"):
        load_model(EngineConfig(model_id=str(folder), dtype="float32", kv_cache_dtype="fp8"))
