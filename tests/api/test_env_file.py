"""``.env`` files: the parser, no overriding of set variables, and both command-line tools."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import pytest

from jax_llm_runtime.api.cli import chat_client
from jax_llm_runtime.api.cli import serve as cli
from jax_llm_runtime.api.cli.env_file import load_env_file, parse_env_file


def unset(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Unset ``name`` for this test and unset it again afterwards, whatever sets it meanwhile
    (``load_env_file`` writes ``os.environ`` itself)."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


def test_parse_the_common_forms() -> None:
    text = """
# a comment
PLAIN=value
SPACED = padded value   # trailing comment
export EXPORTED=1
SINGLE='kept # as $written\\n'
DOUBLE="line\\nnext \\"quoted\\" # not a comment"
EMPTY=
HASH=a#b
PLAIN=later wins
"""
    assert parse_env_file(text) == {
        "PLAIN": "later wins",
        "SPACED": "padded value",
        "EXPORTED": "1",
        "SINGLE": "kept # as $written\\n",
        "DOUBLE": 'line\nnext "quoted" # not a comment',
        "EMPTY": "",
        "HASH": "a#b",
    }


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("NO_EQUALS_SIGN", "expected NAME=value"),
        ("1BAD=x", "expected NAME=value"),
        ('OPEN="never closed', "no closing"),
        ("'X'=1", "expected NAME=value"),
        ('AFTER="x" junk', "after the closing quote"),
    ],
)
def test_malformed_lines_name_the_file_and_line(line: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        parse_env_file(f"OK=1\n{line}\n", "conf/.env")
    assert str(info.value).startswith("conf/.env:2: ")


def test_load_fills_in_only_what_is_missing(tmp_path: Path) -> None:
    path = tmp_path / ".env"
    path.write_text("SET_ALREADY=from-file\nNEW_ONE=from-file\n")
    environ = {"SET_ALREADY": "from-env"}
    assert load_env_file(path, environ) == ["NEW_ONE"]
    assert environ == {"SET_ALREADY": "from-env", "NEW_ONE": "from-file"}
    assert load_env_file(tmp_path / "missing.env", environ) == []


def test_jax_platforms_from_the_file_reaches_jax_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unset(monkeypatch, "JAX_PLATFORMS")
    before = jax.config.jax_platforms
    (tmp_path / ".env").write_text(f"JAX_PLATFORMS={jax.default_backend()}\n")
    try:
        assert load_env_file(tmp_path / ".env") == ["JAX_PLATFORMS"]
        assert jax.config.jax_platforms == jax.default_backend()
    finally:
        jax.config.update("jax_platforms", before)


def test_runtime_serve_reads_dotenv_before_its_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    unset(monkeypatch, "RUNTIME_API_KEY")
    (tmp_path / ".env").write_text("RUNTIME_API_KEY=key-from-dotenv\n")
    served: dict[str, Any] = {}

    def fake_serve(engine: Any, host: str, port: int, server: Any, *_: Any) -> bool:
        served["server"] = server
        return True

    monkeypatch.setattr(cli, "_serve", fake_serve)
    monkeypatch.setattr(cli, "_configure_logging", lambda path: None)  # keep pytest's logging
    assert cli.main(["--mock-engine"]) == 0
    assert served["server"].api_key == "key-from-dotenv"


def test_a_malformed_dotenv_stops_both_tools_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("this is not an assignment\n")
    for main, prog in ((cli.main, "runtime-serve"), (chat_client.main, "runtime-chat")):
        assert main(["--help"]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith(f"{prog}: error: .env:1: expected NAME=value") and err.count("\n") == 1
        )


def test_unset_restores_the_unset_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "RUNTIME_TEST_ONLY_VARIABLE"
    (tmp_path / ".env").write_text(f"{name}=set by a .env\n")
    with monkeypatch.context() as inner:
        unset(inner, name)
        assert load_env_file(tmp_path / ".env") == [name]
        assert os.environ[name] == "set by a .env"
    assert name not in os.environ
