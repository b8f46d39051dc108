"""The persistent XLA cache survives a killed writer: entries are written through a rename, a
truncated entry (left by an older writer) is compiled again and replaced whole, and temporary
files a killed writer left behind are cleared once stale. Each case runs in a fresh process,
since the cache folder is set once per process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = r"""
import sys
from pathlib import Path
import jax, numpy as np
from jax_llm_runtime.runtime.loading.xla_cache import enable_compilation_cache
folder = Path(sys.argv[1])
enable_compilation_cache(folder)
f = jax.jit(lambda x: (x * 2.0 + 1.0).sum())
print(float(f(np.arange(7.0, dtype=np.float32))))
"""


def _python(script: str, folder: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh process (the cache folder is set once per process); it must exit 0."""
    result = subprocess.run(
        [sys.executable, "-c", script, str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _run(folder: Path) -> str:
    return _python(SCRIPT, folder).stdout.strip()


def _entries(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.name.endswith("-cache")}


def test_a_truncated_entry_is_compiled_again_and_replaced_whole(tmp_path: Path) -> None:
    assert _run(tmp_path) == "49.0"
    whole = _entries(tmp_path)
    assert whole, "the first run wrote no cache entry"
    for name, size in whole.items():
        os.truncate(tmp_path / name, size // 2)  # what a writer killed mid-write left
    assert _run(tmp_path) == "49.0"
    assert _entries(tmp_path) == whole
    assert not list(tmp_path.glob(".partial-*"))


def test_stale_temporary_files_are_cleared(tmp_path: Path) -> None:
    stale, fresh = tmp_path / ".partial-old", tmp_path / ".partial-new"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"being written")
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    _run(tmp_path)
    assert not stale.exists() and fresh.exists()


def test_runtime_xla_cache_0_writes_and_reads_nothing(tmp_path: Path) -> None:
    result = _python(SCRIPT, tmp_path, RUNTIME_XLA_CACHE="0")
    assert result.stdout.strip() == "49.0"
    assert not _entries(tmp_path)


DISK_FULL = r"""
import errno, os, sys
from pathlib import Path
import jax, numpy as np
from jax_llm_runtime.runtime.loading import xla_cache

real_fdopen = os.fdopen

class Full:  # a file on a full disk: opening works, writing fails
    def __init__(self, f): self.f = f
    def __enter__(self): return self
    def __exit__(self, *exc): self.f.close()
    def write(self, data): raise OSError(errno.ENOSPC, "No space left on device")

xla_cache.os.fdopen = lambda fd, mode="r", *a, **k: Full(real_fdopen(fd, mode, *a, **k))
xla_cache.enable_compilation_cache(Path(sys.argv[1]))
f = jax.jit(lambda x: (x * 2.0 + 1.0).sum())
print(float(f(np.arange(7.0, dtype=np.float32))))
"""


def test_a_full_disk_costs_the_cache_entry_not_the_compile(tmp_path: Path) -> None:
    result = _python(DISK_FULL, tmp_path)
    assert result.stdout.strip() == "49.0"
    assert "No space left on device" in result.stderr  # JAX's warning names the cause
    assert not _entries(tmp_path)
    assert not list(tmp_path.glob(".partial-*")), "a failed write left its temporary file"
