"""``--kv-cache-dtype`` (and its alias ``--fp8-kvcache``) and ``--matmul-dtype``: parsing into
``EngineConfig`` and one-line errors."""

from __future__ import annotations

import pytest

from jax_llm_runtime.api.cli.serve import _config_from_args, build_parser
from tests.api.test_cli import run_cli


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "auto"),
        (["--kv-cache-dtype", "fp8"], "fp8"),
        (["--kv-cache-dtype", "fp8_e4m3"], "fp8_e4m3"),
        (["--kv-cache-dtype", "float16"], "float16"),
        (["--kv-cache-dtype", "bfloat16"], "bfloat16"),
        (["--fp8-kvcache"], "fp8"),
    ],
)
def test_kv_cache_dtype_flags_reach_the_engine_config(argv: list[str], expected: str) -> None:
    args = build_parser().parse_args(argv)
    assert _config_from_args(args).kv_cache_dtype == expected


def test_bad_kv_cache_dtype_is_one_line_exit_2() -> None:
    result = run_cli("--kv-cache-dtype", "int4")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("runtime-serve: error: ")
    assert "--kv-cache-dtype" in lines[0] and "'int4'" in lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "auto"),
        (["--matmul-dtype", "bfloat16"], "bfloat16"),
        (["--matmul-dtype", "int8"], "int8"),
    ],
)
def test_matmul_dtype_flag_reaches_the_engine_config(argv: list[str], expected: str) -> None:
    args = build_parser().parse_args(argv)
    assert _config_from_args(args).matmul_dtype == expected


def test_bad_matmul_dtype_is_one_line_exit_2() -> None:
    result = run_cli("--matmul-dtype", "int4")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "--matmul-dtype" in lines[0] and "'int4'" in lines[0]
