"""``--models-config``: the YAML file of named models, its errors, and ``runtime-serve`` with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from jax_llm_runtime.api.cli.models_config import load_models_config
from jax_llm_runtime.runtime.config import EngineConfig
from tests.serve_process import REPO_ROOT, running_server

TWO_MODELS = """
models:
  small:
    model_id: ./small
    max_num_seqs: 4
  large:
    model_id: org/large
    weight_file: large.Q4_K_M.gguf
    kvcache_mem_mb: 512
    devices: [0]
    prefix_cache: false
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


def load_error(tmp_path: Path, text: str) -> str:
    """The one-line message of the ValueError the file raises."""
    with pytest.raises(ValueError) as caught:
        load_models_config(write(tmp_path, text), EngineConfig())
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "models.yaml")), message
    return message


def test_the_example_file_loads() -> None:
    configs = load_models_config(REPO_ROOT / "example.models.yaml", EngineConfig())
    assert [c.served_model_name for c in configs] == ["smollm2", "gemma3"]
    assert [c.model_id for c in configs] == ["smollm2-135m-instruct", "gemma3-270m"]


def test_models_keep_file_order_and_take_the_flags_as_defaults(tmp_path: Path) -> None:
    flags = EngineConfig(kvcache_mem_mb=64, max_num_seqs=2, dtype="float32")
    small, large = load_models_config(write(tmp_path, TWO_MODELS), flags)
    assert (small.served_model_name, small.model_id) == ("small", "./small")
    assert (small.max_num_seqs, small.kvcache_mem_mb, small.dtype) == (4, 64, "float32")
    assert (large.weight_file, large.kvcache_mem_mb, large.max_num_seqs) == (
        "large.Q4_K_M.gguf",
        512,
        2,
    )
    assert large.devices == (0,) and large.prefix_cache is False


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (
            "models:\n  a:\n    model_id: x\n    max_num_seq: 4\n",
            ["'a'", "'max_num_seq'", "max_num_seqs"],
        ),
        (
            "models:\n  a:\n    model_id: x\n    kvcache-mem-mb: 4\n",
            ["'kvcache-mem-mb'", "kvcache_mem_mb"],
        ),
        (
            "models:\n  a:\n    model_id: x\n    colour: red\n",
            ["'colour'", "the keys are: model_id"],
        ),
        (
            "models:\n  a:\n    model_id: x\n    max_num_seqs: '8'\n",
            ["'a'", "max_num_seqs", "`int`"],
        ),
        ("models:\n  a:\n    model_id: x\n    prefix_cache: 1\n", ["prefix_cache", "`bool`"]),
        (
            "models:\n  a:\n    model_id: x\n    max_num_seqs: 0\n",
            ["'a'", "max_num_seqs must be >= 1"],
        ),
        ("models:\n  a:\n    model_id: x\n    dtype: int3\n", ["'a'", "dtype must be one of"]),
        ("models:\n  a:\n    model_id: x\n    isq: q9\n", ["'a'", "isq must be one of"]),
        ("models:\n  a:\n    max_num_seqs: 2\n", ["'a'", "model_id is required"]),
        (
            "models:\n  a:\n    model_id: x\n    served_model_name: b\n",
            ["served_model_name", "its key"],
        ),
        ("models:\n  a: smollm2\n", ["'a'", "must be a mapping"]),
        ("models:\n  a b:\n    model_id: x\n", ["'a b'", "without spaces"]),
        (
            "models:\n  a:\n    model_id: x\n  a:\n    model_id: y\n",
            ["line 4", "'a' is given twice"],
        ),
        ("models:\n  a:\n    model_id: x\n    model_id: y\n", ["'model_id' is given twice"]),
        ("models: {}\n", ["`models:`"]),
        ("- a\n- b\n", ["`models:`"]),
        ("", ["`models:`"]),
        ("models:\n  a:\n    model_id: x\nmodel: a\n", ["unknown top-level keys model"]),
        ("models:\n  a: [model_id: x\n", ["invalid YAML at line"]),
        ("models:\n  a:\n    model_id: !!python/name:os.system x\n", ["invalid YAML"]),
    ],
)
def test_errors_are_one_line_naming_the_file_the_model_and_the_key(
    tmp_path: Path, text: str, needles: list[str]
) -> None:
    message = load_error(tmp_path, text)
    for needle in needles:
        assert needle in message, message


def test_an_unreadable_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read the models config .*missing\.yaml"):
        load_models_config(tmp_path / "missing.yaml", EngineConfig())


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jax_llm_runtime.api.cli.serve", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


def one_error_line(result: subprocess.CompletedProcess[str], status: int) -> str:
    assert result.returncode == status, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("runtime-serve: error: "), line
    return line


@pytest.mark.parametrize("flag", [["--model-id", "x"], ["--served-model-name", "x"]])
def test_a_flag_that_names_the_model_conflicts_with_the_file(
    tmp_path: Path, flag: list[str]
) -> None:
    path = str(write(tmp_path, TWO_MODELS))
    line = one_error_line(run_cli("--models-config", path, *flag), 2)
    assert f"{flag[0]} cannot be combined with --models-config" in line
    # The environment variable is the flag's default, so it conflicts the same way.
    from_env = run_cli(*flag, env={"RUNTIME_MODELS_CONFIG": path})
    assert f"{flag[0]} cannot be combined" in one_error_line(from_env, 2)


def test_a_bad_file_stops_the_cli_with_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "models:\n  a:\n    model_id: x\n    max_num_seqs: -1\n")
    line = one_error_line(run_cli("--models-config", str(path)), 2)
    assert str(path) in line and "'a'" in line and "max_num_seqs" in line


def test_a_model_that_fails_to_load_is_one_line_naming_it(tmp_path: Path) -> None:
    text = "models:\n  gone:\n    model_id: /no/dir\n  ok:\n    model_id: smollm2-135m-instruct\n"
    path = write(tmp_path, text)
    line = one_error_line(run_cli("--models-config", str(path), "--log", os.devnull), 1)
    assert "model 'gone'" in line and "/no/dir" in line


@pytest.mark.slow
def test_the_cli_serves_every_model_of_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "models:\n  first:\n    model_id: x\n  second:\n    model_id: y\n")
    args = ["--mock-engine", "--models-config", str(path)]
    with running_server(args, tmp_path / "server.log") as server:
        assert server.model == "first,second"  # the ready line names them all
        models = httpx.get(f"{server.url}/models").json()["data"]
        assert [m["id"] for m in models] == ["first", "second"]
        for name in ("second", "first"):
            body = {"model": name, "messages": [{"role": "user", "content": "abc"}]}
            reply = httpx.post(f"{server.url}/chat/completions", json=body).json()
            assert reply["model"] == name and reply["choices"][0]["message"]["content"] == "cba"
        unknown = httpx.post(f"{server.url}/completions", json={"model": "third", "prompt": "a"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert server.returncode == 130
