"""Two ``runtime-serve`` processes on localhost serve one model together (``jax.distributed`` with
CPU collectives, one device each, tensor parallel 2): rank 0 answers every kind of request
(greedy, logprobs, seeded, ``n = 2``, ``json_schema``, streamed) with the same greedy answers and
prompt scores as one process alone, and rank 1 exits cleanly when rank 0 stops."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import openai
import pytest

from tests.e2e.sharded_requests import exercise
from tests.models.harness import TINY, save_random_model
from tests.models.tiny_tokenizer import VOCAB_SIZE, save_byte_tokenizer
from tests.serve_process import REPO_ROOT, running_server, serve_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENGINE = ["--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "128", "--mem", "4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str, model: str) -> dict:
    """Every kind of request (``sharded_requests.exercise``) and a prompt's echoed logprobs."""
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    scored = client.completions.create(
        model=model, prompt="Count: one two", max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    prompt_logprobs = [
        None if v is None else round(v, 3) for v in scored.choices[0].logprobs.token_logprobs
    ]
    return {**exercise(url, model), "prompt_logprobs": prompt_logprobs}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("tiny-llama")
    fields = {**TINY, "vocab_size": VOCAB_SIZE, "pad_token_id": 0, "bos_token_id": 256}
    fields.update(eos_token_id=None, num_attention_heads=8, num_key_value_heads=4)
    config = transformers.LlamaConfig(**fields)
    save_random_model(config, folder)
    save_byte_tokenizer(folder)
    return folder


def test_two_processes_serve_like_one(tiny_model: Path, tmp_path: Path) -> None:
    args = ["--model-id", str(tiny_model), *ENGINE]
    with running_server(args, tmp_path / "single.log") as server:
        alone = _answers(server.url, server.model)

    cluster = ["--num-nodes", "2", "--coordinator-address", f"127.0.0.1:{_free_port()}"]
    both = [*args, "--tensor-parallel-size", "2", *cluster]
    with (tmp_path / "rank1.log").open("w") as rank1_log:
        follower = subprocess.Popen(
            [*serve_command(), *both, "--node-rank", "1"],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=rank1_log,
        )
    try:
        with running_server([*both, "--node-rank", "0"], tmp_path / "rank0.log") as server:
            together = _answers(server.url, server.model)
        assert server.returncode == 130  # stopped with Ctrl-C
        assert follower.wait(timeout=60) == 0, (tmp_path / "rank1.log").read_text()[-3000:]
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert together == alone
    rank0 = (tmp_path / "rank0.log").read_text()
    assert "process 0 of 2" in rank0 and "1 followers connected" in rank0
    assert "the leader said stop" in (tmp_path / "rank1.log").read_text()


def test_bad_cluster_flags_are_one_line_errors() -> None:
    for flags, message in (
        (["--num-nodes", "2"], "needs --coordinator-address"),
        (["--num-nodes", "2", "--coordinator-address", "nohost"], "must be host:port"),
        (["--num-nodes", "2", "--node-rank", "2", "--coordinator-address", "h:1"], "node-rank"),
    ):
        out = subprocess.run(
            [*serve_command(), *flags], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 2
        assert message in out.stderr and len(out.stderr.strip().splitlines()) <= 2, out.stderr
