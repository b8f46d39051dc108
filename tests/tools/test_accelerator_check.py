"""tools/accelerator_check.py end to end on the CPU with tiny shapes: every part it runs writes its
figures to the JSON and the markdown table (on a GPU the same code measures the device)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve_process import REPO_ROOT


@pytest.mark.slow
def test_tiny_run_writes_step_and_roofline_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "tools" / "accelerator_check.py"),
            "--tiny",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--parts",
            "env,attention,roofline,step",
            "--context",
            "32",
            "--num-seqs",
            "1,2",
            "--step-formats",
            "float",
            "--step-xla-flags=--xla_gpu_enable_dynamic_slice_fusion=true",  # parsed on CPU too
            "--layer-loop",
            "both",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((out / "accelerator_check.json").read_text())
    assert figures["env"]["backend"] == "cpu"
    assert set(figures["roofline"]) >= {"1", "2"}
    # The runtime's choice, the Pallas kernels, and each again under the extra XLA flags; each
    # with the layers scanned and unrolled (over one array per layer), with its compile time.
    labels = {"float", "float+pallas", "float+xla-flags", "float+pallas+xla-flags"}
    for label in labels:
        rows = figures["step"][label]
        assert set(rows) == {"1", "2", "1+unrolled", "2+unrolled"}, rows
        assert all(row["best_ms"] > 0 and row["bandwidth_GBps"] > 0 for row in rows.values())
        assert all(row["first_call_s"] > 0 for row in rows.values())
    # Each step's device time, traced (on CPU the host's thunks), and the attention alone.
    assert {t["run"] for t in figures["step"]["traces"]} == labels
    assert all(t["total_us"] > 0 and t["kernels"] for t in figures["step"]["traces"])
    assert all(figures["attention"][n]["pallas_ms"] > 0 for n in ("1", "2"))
    table = (out / "accelerator_check.md").read_text()
    assert "| float+pallas | 2 |" in table
    assert "| float+pallas+xla-flags | 2 |" in table
    assert "| float+pallas | 2+unrolled |" in table
    assert "Paged attention alone" in table
