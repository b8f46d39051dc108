"""``runtime-serve --models-config`` with two real models: the embedded SmolLM2 and a tiny
random-weight Llama. Each request is answered by the model it names: SmolLM2 knows Paris, and the
tiny model's greedy reply is the one it gives when it is served alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.models.harness import TINY, save_random_model
from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer
from tests.serve_process import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "Name the capital city of France."}]
TINY_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--kvcache-mem", "4"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        **{**TINY, "vocab_size": VOCAB_SIZE, "bos_token_id": 256, "eos_token_id": 257}
    )
    save_random_model(config, folder, seed=3)
    save_byte_tokenizer(folder)
    return folder


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)


def ask(url: str, model: str, **kw: object) -> openai.types.chat.ChatCompletion:
    kw = {"temperature": 0, "max_tokens": 16, **kw}
    return client(url).chat.completions.create(model=model, messages=QUESTION, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def both(
    smollm2_gguf: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("two-models")
    (folder / "models.yaml").write_text(
        "models:\n"
        "  smollm2:\n"
        f"    model_id: {smollm2_gguf}\n"
        "    max_model_len: 256\n"
        "    max_num_seqs: 2\n"
        "    kvcache_mem_mb: 32\n"
        "  tiny:\n"
        f"    model_id: {tiny_llama}\n"
        "    dtype: float32\n"
        "    max_model_len: 128\n"
        "    kvcache_mem_mb: 4\n"
    )
    args = ["--models-config", str(folder / "models.yaml"), "--max-num-seqs", "4"]
    with running_server(args, folder / "server.log") as server:
        assert server.model == "smollm2,tiny"
        yield server.url
    assert "Traceback" not in (folder / "server.log").read_text()


def test_each_model_answers_the_requests_that_name_it(
    both: str, tiny_llama: Path, tmp_path: Path
) -> None:
    assert [m.id for m in client(both).models.list().data] == ["smollm2", "tiny"]
    smollm2 = ask(both, "smollm2", max_tokens=32)
    assert smollm2.model == "smollm2" and "Paris" in (smollm2.choices[0].message.content or "")
    tiny = ask(both, "tiny")
    assert tiny.model == "tiny"
    assert tiny.choices[0].message.content != smollm2.choices[0].message.content
    assert ask(both, "smollm2", max_tokens=32).choices[0].message.content == (
        smollm2.choices[0].message.content
    )
    with running_server(
        ["--model-id", str(tiny_llama), *TINY_ARGS], tmp_path / "alone.log"
    ) as alone:
        expected = ask(alone.url, alone.model).choices[0].message.content
    assert tiny.choices[0].message.content == expected
    with pytest.raises(openai.NotFoundError) as missing:
        ask(both, "gpt-4")
    assert missing.value.code == "model_not_found"
