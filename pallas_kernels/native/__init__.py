"""Native CPU kernels: C++ sources compiled on first use against XLA's FFI headers.

XLA:CPU has no Pallas lowering, and some operations (reading scattered KV pages, unpacking
quantized weights inside a dot) are where it loses most against hand-written loops. The kernels
here are XLA FFI handlers (``jax.ffi``) in C++ files beside their Python wrappers:

1. ``load(name)`` compiles ``<name>.cc`` with the system C++ compiler (``$CXX``, else ``c++``)
   for the instruction set of the CPU it runs on (``cpu_isa()``: x86-64-v4 with AVX-512's VNNI
   and VBMI where present, x86-64-v3 with AVX-VNNI where present, aarch64 with the dot-product
   extension, else a generic build) into the runtime's cache folder, keyed by the source, the
   flags, the compiler and jaxlib, so later starts load the built library at once.
   ``prebuild()`` starts every kernel's build at once in background threads (the compiler is
   a subprocess, so on a first start they build in parallel with each other and with the
   model's loading); ``load`` then waits for its build.
   ``RUNTIME_NATIVE_ISA`` names another build the CPU runs, as the log names them: a lower level
   and which of its extensions to use (an AVX-512 machine then runs and measures the plain
   x86-64-v3 build, or "x86-64-v3+avxvnni"); one the CPU lacks is refused with a warning.
2. The wrapper registers the library's handlers with ``jax.ffi.register_ffi_target`` for the
   ``cpu`` platform and calls them with ``jax.ffi.ffi_call``.
3. No compiler, a failed build, or ``RUNTIME_NATIVE_KERNELS=0`` gives None (logged once): the
   callers then use the pure-XLA formulation, so the kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import platformdirs

logger = logging.getLogger(__name__)

ENV_SWITCH = "RUNTIME_NATIVE_KERNELS"  # "0" turns the native kernels off
ENV_ISA = "RUNTIME_NATIVE_ISA"  # another build than the CPU's best (see cpu_isa)
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-Wno-psabi")
_SOURCES = Path(__file__).resolve().parent
KERNELS = ("dequant_matmul", "paged_attention")  # the sources beside this file
# Sources built as several translation units in parallel (their NATIVE_PART values), linked into
# one library; the others compile whole. dequant_matmul: the handler, then one part per bit
# layout of its passes (b0 * 16 + b1): 33 s of one g++ process became seven of 5-6 s.
PARTS = {"dequant_matmul": (0, 8 * 16, 4 * 16 + 2, 4 * 16 + 1, 4 * 16, 2 * 16 + 1, 2 * 16)}
_loaded: dict[str, ctypes.CDLL | None] = {}
_paths: dict[str, Path] = {}
_pending: dict[str, Future[Path]] = {}  # builds prebuild() started
_lock = threading.Lock()


@dataclass(frozen=True)
class Isa:
    """An instruction-set level the kernels are built for: its name in the log and its flags."""

    name: str  # e.g. "x86-64-v3+avxvnni"
    flags: tuple[str, ...]


# Levels from the best down: (name, -march, CPU features it needs, optional extensions as
# (feature, flag, suffix)). Features are the names Linux prints in /proc/cpuinfo.
_LEVELS = (
    (
        "x86-64-v4",
        "x86-64-v4",
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
        (("avx512_vnni", "-mavx512vnni", "vnni"), ("avx512vbmi", "-mavx512vbmi", "vbmi")),
    ),
    (
        "x86-64-v3",
        "x86-64-v3",
        ("avx2", "fma", "f16c", "bmi2", "movbe"),
        (("avx_vnni", "-mavxvnni", "avxvnni"),),
    ),
    ("aarch64", "armv8.2-a", ("asimd", "fphp"), (("asimddp", "+dotprod", "dotprod"),)),
    ("generic", "", (), ()),
)


def cpuinfo(*keys: str) -> str:
    """The value of the first line of /proc/cpuinfo whose key is one of ``keys`` ("" where
    there is no such line or no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value.strip()
    return ""


# Bits of the aarch64 Linux auxiliary vector's AT_HWCAP, by their /proc/cpuinfo names.
_AT_HWCAP = 16
_ARM_HWCAPS = (("fp", 0), ("asimd", 1), ("fphp", 9), ("asimdhp", 10), ("asimddp", 20))


def _arm_hwcaps() -> frozenset[str]:
    """The features of ``_ARM_HWCAPS`` that the kernel's AT_HWCAP gives this process (empty
    where getauxval cannot be called)."""
    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return frozenset()
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, (ctypes.c_ulong,)
    bits = getauxval(_AT_HWCAP)
    return frozenset(name for name, bit in _ARM_HWCAPS if bits >> bit & 1)


def _cpu_features() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none); on
    aarch64 with those AT_HWCAP gives besides, which is what a process emulated by qemu-user
    has: its /proc/cpuinfo is the host's."""
    features = frozenset(cpuinfo("flags", "Features").split())
    if platform.machine().lower() in ("aarch64", "arm64"):
        features |= _arm_hwcaps()
    return features


def _level(name: str, march: str, extensions: tuple, features: frozenset[str]) -> Isa:
    """Level ``name`` with those of its ``extensions`` whose feature is in ``features``."""
    flags, suffix = [], ""
    arm = name == "aarch64"
    for feature, flag, label in extensions:
        if feature in features:
            suffix += f"+{label}"
            march += flag if arm else ""
            flags += [] if arm else [flag]
    return Isa(name + suffix, (f"-march={march}", *flags) if march else ())


def levels_here() -> list[str]:
    """The names of the levels of ``_LEVELS`` this CPU runs, best first ("generic" last)."""
    features = _cpu_features()
    arm = platform.machine().lower() in ("aarch64", "arm64")
    return [
        name
        for name, _, needs, _ in _LEVELS
        if all(f in features for f in needs) and (name == "generic" or (name == "aarch64") == arm)
    ]


@functools.cache
def cpu_isa() -> Isa:
    """The best level of ``_LEVELS`` this CPU runs, with every extension of it the CPU has; or
    the build ``RUNTIME_NATIVE_ISA`` names as the log names builds, a level and the extensions
    to use ("x86-64-v3" is plain AVX2, "x86-64-v3+avxvnni" adds AVX-VNNI). A level or an
    extension this CPU lacks is refused with a warning."""
    names = levels_here()
    features = _cpu_features()
    level = {entry[0]: entry for entry in _LEVELS}
    best = level[names[0]]
    wanted = os.environ.get(ENV_ISA, "").strip()
    if not wanted:
        return _level(best[0], best[1], best[3], features)
    name, *labels = wanted.split("+")
    if name in names:
        extensions = {label: ext for ext in level[name][3] for label in [ext[2]]}
        chosen = [extensions.get(label) for label in labels]
        if all(ext is not None and ext[0] in features for ext in chosen):
            return _level(name, level[name][1], tuple(chosen), features)
    logger.warning(
        "%s=%s is not a build this CPU runs (levels %s); building for %s",
        ENV_ISA,
        wanted,
        ", ".join(names),
        _level(best[0], best[1], best[3], features).name,
    )
    return _level(best[0], best[1], best[3], features)


def int8_wins() -> bool:
    """Whether the build for this CPU (``cpu_isa``) multiplies int8 activations faster than
    float ones: every x86-64 build from AVX2 up (``vpmaddubsw`` pairs, or ``vpdpbusd`` with
    AVX-512 VNNI or AVX-VNNI) and Arm with the dot-product extension (BENCHMARKS.md, "int8
    activations on AVX2"). Plain aarch64 has no integer dot instruction and the generic build is
    scalar: there the float path stays."""
    level, *labels = cpu_isa().name.split("+")
    return level in ("x86-64-v4", "x86-64-v3") or "dotprod" in labels


def enabled() -> bool:
    """False when ``RUNTIME_NATIVE_KERNELS=0``."""
    return os.environ.get(ENV_SWITCH, "1").strip() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where built libraries (and the measured choices of ``pallas_kernels.cpu_choice``) live."""
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
    flags = (*_FLAGS, *cpu_isa().flags)
    parts = PARTS.get(name, ())
    key = hashlib.sha256(
        b"\0".join(
            (
                source,
                " ".join(flags).encode(),
                repr(parts).encode(),
                version.encode(),
                jaxlib.__version__.encode(),
            )
        )
    ).hexdigest()[:20]
    target = cache_dir() / f"{name}-{cpu_isa().name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        compile_ = [compiler, *flags, f"-I{jax.ffi.include_dir()}", str(_SOURCES / f"{name}.cc")]
        if not parts:
            _run_all([[*compile_, "-o", str(built)]])
        else:
            objects = [str(Path(tmp) / f"{name}-{part}.o") for part in parts]
            units = zip(parts, objects, strict=True)
            _run_all([[*compile_, "-c", f"-DNATIVE_PART={p}", "-o", o] for p, o in units])
            _run_all([[compiler, *flags, *objects, "-o", str(built)]])
        os.replace(built, target)  # atomic: a concurrent start sees the whole file or none
    return target


def _run_all(commands: list[list[str]]) -> None:
    """Run ``commands`` at once (compiler processes); a RuntimeError with the first failure's
    command and the end of its errors."""
    processes = [
        subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]
    errors = [p.communicate()[1] for p in processes]
    for command, process, stderr in zip(commands, processes, errors, strict=True):
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{stderr[-2000:]}")


def prebuild(names: tuple[str, ...] = KERNELS) -> None:
    """Start building ``names`` (those not built or loaded yet) in daemon threads; a later
    ``load`` takes the result, or the build's error. Nothing when native kernels are off or no
    compiler is found (``load`` says so)."""
    compiler = _compiler()
    if not enabled() or compiler is None:
        return
    with _lock:
        for name in names:
            if name in _loaded or name in _pending:
                continue
            future: Future[Path] = Future()
            _pending[name] = future
            threading.Thread(
                target=_build_into, args=(future, name, compiler), name=f"build-{name}", daemon=True
            ).start()


def _build_into(future: Future[Path], name: str, compiler: str) -> None:
    try:
        future.set_result(_build(name, compiler))
    except BaseException as exc:  # handed to load(), which logs it
        future.set_exception(exc)


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
                pending = _pending.pop(name, None)
                path = pending.result() if pending is not None else _build(name, compiler)
                library = ctypes.CDLL(str(path))
                _paths[name] = path
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                logger.warning("native kernel %s unavailable, using XLA: %s", name, exc)
        _loaded[name] = library
        return library


def library_path(name: str) -> Path:
    """The file of the loaded library ``name`` (after ``load(name)`` returned it)."""
    return _paths[name]
