"""``runtime-serve --model-id gemma3-270m``: the packaged Gemma 3 base model serves completions
(it has no chat template, so chat requests are a clear 400)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.serve_process import running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_gemma3_serves_completions(tmp_path: Path) -> None:
    args = ["--model-id", "gemma3-270m", "--max-model-len", "256", "--max-num-seqs", "2"]
    with running_server(args, tmp_path / "server.log") as proc:
        assert proc.model == "gemma3-270m"
        client = openai.OpenAI(base_url=proc.url, api_key="unused", max_retries=0, timeout=120)
        kw = {"model": "gemma3-270m", "prompt": "The capital of France is", "temperature": 0}
        reply = client.completions.create(**kw, max_tokens=24)
        text = reply.choices[0].text
        assert text and reply.choices[0].finish_reason in ("stop", "length")
        assert 0 < reply.usage.completion_tokens <= 24
        chunks = list(client.completions.create(**kw, max_tokens=24, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(
                model="gemma3-270m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
    assert "Traceback" not in (tmp_path / "server.log").read_text()
