"""Native CPU kernels: C++ sources compiled on first use against XLA's FFI headers.

XLA:CPU has no Pallas lowering, and some operations (reading scattered KV pages, unpacking
quantized weights inside a dot) are where it loses most against hand-written loops. The kernels
here are XLA FFI handlers (``jax.ffi``) in C++ files beside their Python wrappers:

1. ``load(name)`` compiles ``<name>.cc`` with the system C++ compiler (``$CXX``, else ``c++``)
   into the runtime's cache folder, keyed by the source, the flags, the compiler and jaxlib, so
   later starts load the built library at once; ``-march=native`` is safe because the library is
   built on the machine that runs it.
2. The wrapper registers the library's handlers with ``jax.ffi.register_ffi_target`` for the
   ``cpu`` platform and calls them with ``jax.ffi.ffi_call``.
3. No compiler, a failed build, or ``RUNTIME_NATIVE_KERNELS=0`` gives None (logged once): the
   callers then use the pure-XLA formulation, so the kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import platformdirs

logger = logging.getLogger(__name__)

ENV_SWITCH = "RUNTIME_NATIVE_KERNELS"  # "0" turns the native kernels off
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-march=native", "-fno-math-errno")
_SOURCES = Path(__file__).resolve().parent
_loaded: dict[str, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def enabled() -> bool:
    """False when ``RUNTIME_NATIVE_KERNELS=0``."""
    return os.environ.get(ENV_SWITCH, "1").strip() not in ("0", "false", "no", "off")


def _cache_dir() -> Path:
    root = os.environ.get("RUNTIME_CACHE_DIR") or platformdirs.user_cache_dir("jax-llm-runtime")
    return Path(root) / "native"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _build(name: str, compiler: str) -> Path:
    """The built library of ``<name>.cc`` (compiling it unless the cache has it)."""
    import jax
    import jaxlib

    source = (_SOURCES / f"{name}.cc").read_bytes()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256(
        b"\0".join(
            (source, " ".join(_FLAGS).encode(), version.encode(), jaxlib.__version__.encode())
        )
    ).hexdigest()[:20]
    target = _cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [
            compiler,
            *_FLAGS,
            f"-I{jax.ffi.include_dir()}",
            str(_SOURCES / f"{name}.cc"),
            "-o",
            str(built),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent start sees the whole file or none
    return target


def load(name: str) -> ctypes.CDLL | None:
    """The loaded library of ``<name>.cc``, built on first use; None (logged once) when native
    kernels are off or cannot be built here."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        library = None
        compiler = _compiler()
        if not enabled():
            logger.info("native CPU kernels are off (%s=0)", ENV_SWITCH)
        elif compiler is None:
            logger.warning("no C++ compiler found: the CPU runs the XLA formulation of %s", name)
        else:
            try:
                library = ctypes.CDLL(str(_build(name, compiler)))
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                logger.warning("native kernel %s unavailable, using XLA: %s", name, exc)
        _loaded[name] = library
        return library
