"""Where a traced step's device time goes: the kernels of a ``jax.profiler`` perfetto trace,
summed by name.

    .venv/bin/python tools/trace_summary.py TRACE_DIR_OR_FILE [--top 25] [--calls N]

``TRACE_DIR_OR_FILE`` is a ``perfetto_trace.json.gz`` written by
``jax.profiler.trace(dir, create_perfetto_trace=True)`` or a folder holding one (searched
recursively). Complete events (``"ph": "X"``) of the processes named ``/device:...`` are the
device's kernels (on a GPU, one per CUDA kernel XLA or Pallas launched); where the trace has no
device process (XLA:CPU), the host's XLA thunks are summed instead. ``--calls`` divides the
totals by the number of traced calls, giving microseconds per step.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path


def find_trace(path: Path) -> Path:
    """``path`` itself, or the newest perfetto trace under it."""
    if path.is_file():
        return path
    found = sorted(path.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {path}")
    return found[-1]


def summarize(path: Path, top: int = 25, calls: int = 1) -> dict:
    """``{"device": process names summed, "total_us": per call, "kernels": [[name, us per call,
    launches per call, share], ...]}`` of the trace at (or under) ``path``."""
    with gzip.open(find_trace(path), "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = {pid for pid, name in names.items() if name.startswith("/device:")}
    pids = device or set(names)  # no device process: the host's thunks (XLA:CPU)
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in pids:
            continue
        name = e.get("name", "?")
        if not device and (name.startswith("$") or "::" in name):
            continue  # Python frames and runtime internals, not kernels
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += float(e.get("dur", 0.0))
        entry[1] += 1
    total = sum(us for us, _ in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "device": sorted(names[p] for p in pids),
        "total_us": round(total / calls, 1),
        "kernels": [
            [name, round(us / calls, 1), round(n / calls, 2), round(us / total, 3) if total else 0]
            for name, (us, n) in ranked
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--calls", type=int, default=1)
    args = parser.parse_args()
    try:
        summary = summarize(args.trace, args.top, args.calls)
    except (OSError, ValueError, KeyError) as exc:
        print(f"trace_summary: {exc}", file=sys.stderr)
        return 2
    print(f"{', '.join(summary['device'])}: {summary['total_us']} us per call")
    for name, us, launches, share in summary["kernels"]:
        print(f"  {us:10.1f} us  {launches:6.2f}x  {share:6.1%}  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
