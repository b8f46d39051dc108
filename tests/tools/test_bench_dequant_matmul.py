"""tools/bench_dequant_matmul.py: its cases parse (and bad ones are named), and it runs end to end,
one row per case and row count, on a small weight."""

from __future__ import annotations

import sys

import pytest

from jax_llm_runtime.pallas_kernels.dequant_matmul import native
from tests.tools import load_tool


def test_cases_parse_and_bad_ones_are_named():
    tool = load_tool("bench_dequant_matmul.py")
    assert tool.parse_cases("Q8_0:49152x576, Q4_1:1536x576") == [
        ("Q8_0", 49152, 576),
        ("Q4_1", 1536, 576),
    ]
    for bad in ("Q4_K:64x256", "Q8_0:64", "Q8_0:64x100"):
        with pytest.raises(ValueError, match=bad.split(":")[0]):
            tool.parse_cases(bad)


@pytest.mark.skipif(
    not native.available(), reason="the native kernel could not be built here (no C++ compiler?)"
)
def test_the_tool_prints_a_row_per_case_and_row_count(capsys, monkeypatch):
    tool = load_tool("bench_dequant_matmul.py")
    argv = ["bench_dequant_matmul.py", "--rows", "1,3", "--cases", "Q8_0:40x64,Q4_1:16x32"]
    monkeypatch.setattr(sys, "argv", [*argv, "--rounds", "1", "--calls", "1"])
    assert tool.main() == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("1", "Q8_0", "40x64"),
        ("3", "Q8_0", "40x64"),
        ("1", "Q4_1", "16x32"),
        ("3", "Q4_1", "16x32"),
    ]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 and r[6].endswith("x") for r in rows)


def test_a_bad_case_or_row_count_is_a_one_line_error(capsys, monkeypatch):
    tool = load_tool("bench_dequant_matmul.py")
    monkeypatch.setattr(sys, "argv", ["bench_dequant_matmul.py", "--cases", "Q9:1x32"])
    assert tool.main() == 2
    assert capsys.readouterr().err.startswith("bench_dequant_matmul: 'Q9:1x32'")
    monkeypatch.setattr(sys, "argv", ["bench_dequant_matmul.py", "--rows", "16,0"])
    assert tool.main() == 2
    assert capsys.readouterr().err.startswith("bench_dequant_matmul: --rows '16,0'")
