"""``tools/trace_summary.py``: a perfetto trace's kernels summed by name, the device's where the
trace has a device process (a GPU's CUDA kernels), else the host's XLA thunks (XLA:CPU)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from trace_summary import summarize


def _write(folder: Path, events: list[dict]) -> Path:
    path = folder / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def _process(pid: int, name: str) -> dict:
    return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}


def test_device_kernels_are_summed_per_call_and_the_host_is_left_out(tmp_path):
    events = [
        _process(1, "/host:CPU"),
        _process(7, "/device:GPU:0"),
        {"ph": "X", "pid": 1, "name": "PjitFunction(step)", "dur": 900.0},
        *[{"ph": "X", "pid": 7, "name": "memcpy128", "dur": 50.0} for _ in range(4)],
        {"ph": "X", "pid": 7, "name": "gemm_fusion_dot", "dur": 100.0},
        {"ph": "X", "pid": 7, "name": "gemm_fusion_dot", "dur": 100.0},
        {"ph": "i", "pid": 7, "name": "marker"},
    ]
    summary = summarize(_write(tmp_path, events).parents[3], calls=2)
    assert summary["device"] == ["/device:GPU:0"]
    assert summary["total_us"] == 200.0
    assert summary["kernels"] == [
        ["memcpy128", 100.0, 2.0, 0.5],
        ["gemm_fusion_dot", 100.0, 1.0, 0.5],
    ]


def test_without_a_device_the_hosts_thunks_count_but_not_python_or_runtime_frames(tmp_path):
    events = [
        _process(1, "/host:CPU"),
        {"ph": "X", "pid": 1, "name": "ynn_fusion", "dur": 30.0},
        {"ph": "X", "pid": 1, "name": "$profiler.py:307 trace", "dur": 500.0},
        {"ph": "X", "pid": 1, "name": "CommonPjRtLoadedExecutable::Execute", "dur": 40.0},
    ]
    summary = summarize(_write(tmp_path, events))
    assert summary["kernels"] == [["ynn_fusion", 30.0, 1.0, 1.0]]
