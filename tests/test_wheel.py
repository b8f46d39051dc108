"""The built wheel carries what an installed (not editable) copy needs at run time: the native
kernels' C++ sources, which it builds on first use, and the web UI's files."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_holds_the_kernel_sources_and_an_installed_copy_loads_them(
    tmp_path: Path,
) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in ("dequant_matmul.cc", "paged_attention.cc"):
        assert f"jax_llm_runtime/pallas_kernels/native/{source}" in names
    assert "jax_llm_runtime/api/ui/static/index.html" in names
    # One import name: every module of the project lives under jax_llm_runtime/.
    modules = {n.split("/")[0] for n in names if n.endswith(".py")}
    assert modules == {"jax_llm_runtime"}, modules
    packages = {n.rpartition("/")[0] for n in names if n.endswith("/__init__.py")}
    on_disk = {
        "jax_llm_runtime/" + str(init.parent.relative_to(REPO))
        for root in ("api", "runtime", "models", "pallas_kernels")
        for init in (REPO / root).rglob("__init__.py")
    }
    assert packages == on_disk, on_disk ^ packages  # pyproject.toml lists every package

    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    check = (
        "import jax_llm_runtime.pallas_kernels.native as n; print(n.__file__); "
        "print(all(n.load(k) is not None for k in ('dequant_matmul', 'paged_attention')))"
    )
    # Outside the checkout, with the installed copy first on the path.
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    location, loaded = run.stdout.split()
    assert location.startswith(str(site)) and loaded == "True", run.stderr[-3000:]
