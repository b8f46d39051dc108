"""Ahead-of-time compiled executables, one per padding bucket, compiled up front, in the
background, or (as a last resort) on first use.

Startup compiles only the buckets short requests need, on all cores at once (XLA compiles
outside the GIL); the engine compiles the rest on one background thread once it serves, smallest
first. A step whose bucket is not compiled yet compiles it on the spot, once (a per-bucket lock
makes the background thread and the step share one compilation), and says so in the log.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

logger = logging.getLogger(__name__)

# XLA:CPU maps each kernel of a compiled executable into memory maps of its own (code, constants,
# data: ~250 maps for one decode step of a small model, 29,000 for the default model's 111
# shapes), freed only with the executable. Linux kills no process at its limit on maps
# (vm.max_map_count, 65,530 by default): the next mmap fails, and jaxlib dies with SIGSEGV in
# its error path. So a compile is refused above REFUSE_MAPS of the limit (the step that needed
# it fails alone; the server goes on), and the log warns once above WARN_MAPS.
WARN_MAPS = 0.5
REFUSE_MAPS = 0.9
_warned = threading.Event()


class MapLimitError(RuntimeError):
    """A compile refused because the process is close to the kernel's limit on memory maps."""


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's ``vm.max_map_count``); None off Linux."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            held = sum(1 for _ in maps)
        with open("/proc/sys/vm/max_map_count") as limit:
            return held, int(limit.read())
    except (OSError, ValueError):
        return None


def check_map_headroom(what: str) -> None:
    """Raise ``MapLimitError`` when compiling ``what`` could reach the limit on memory maps."""
    maps = memory_maps()
    if maps is None:
        return
    held, limit = maps
    advice = (
        "raise the limit (sysctl -w vm.max_map_count=262144) or serve fewer shapes "
        "(lower --max-num-seqs or --max-model-len, or fewer models per process)"
    )
    if held > REFUSE_MAPS * limit:
        raise MapLimitError(
            f"not compiling {what}: the process holds {held} memory maps of the kernel's limit "
            f"of {limit} (vm.max_map_count), and XLA crashes at the limit; {advice}"
        )
    if held > WARN_MAPS * limit and not _warned.is_set():
        _warned.set()
        logger.warning(
            "the process holds %d memory maps of the kernel's limit of %d (vm.max_map_count); "
            "compiled code keeps a few per kernel, and compiles stop at %d%% of the limit: %s",
            held,
            limit,
            round(100 * REFUSE_MAPS),
            advice,
        )


def release_freed_memory() -> None:
    """Give the memory compiles freed back to the OS (glibc's ``malloc_trim``; elsewhere
    nothing). XLA's compiles free most of what they allocate, but glibc keeps it in its
    arenas: the default model's server held 0.26-0.41 GB of it after compiling its 111 shapes
    (about 10 MB when they loaded from the XLA cache)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


class CompiledShapes:
    """``lower(key)`` returns a ``jax.stages.Lowered`` for one bucket; this keeps its executables."""

    def __init__(self, name: str, lower: Callable[[Hashable], Any]) -> None:
        self.name = name
        self._lower = lower
        self._compiled: dict[Hashable, Any] = {}
        self._locks: dict[Hashable, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def get(self, key: Hashable) -> Any:
        """The executable for ``key``, compiling it now if nobody has yet."""
        executable = self._compiled.get(key)
        if executable is None:
            t0 = time.perf_counter()
            executable = self._compile(key)
            logger.warning(
                "%s: compiled bucket %s on first use (%.1fs)",
                self.name,
                key,
                time.perf_counter() - t0,
            )
        return executable

    def compile_now(self, keys: Iterable[Hashable], workers: int | None = None) -> float:
        """Compile ``keys`` before returning, on ``workers`` threads (default: one per core);
        shows a progress bar and returns the seconds taken."""
        keys = [k for k in keys if k not in self._compiled]
        t0 = time.perf_counter()
        workers = max(1, min(workers or os.cpu_count() or 1, len(keys)))
        with (
            ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool,
            tqdm(total=len(keys), desc=f"Compiling {self.name}", unit="shape") as bar,
        ):
            for _ in pool.map(self._compile, keys):
                bar.update()
        return time.perf_counter() - t0

    def compile_each(self, keys: Iterable[Hashable], stop: threading.Event) -> int:
        """Compile ``keys`` one after another on the calling thread until ``stop`` is set;
        returns how many were compiled here (a background thread's loop)."""
        count = 0
        for key in keys:
            if stop.is_set():
                break
            if key not in self._compiled:
                try:
                    self._compile(key)
                except MapLimitError as e:
                    logger.error("%s: %s; later shapes compile on first use", self.name, e)
                    break
                count += 1
        return count

    def _compile(self, key: Hashable) -> Any:
        with self._locks_guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            executable = self._compiled.get(key)
            if executable is None:
                check_map_headroom(f"{self.name} bucket {key}")
                executable = self._lower(key).compile()
                self._compiled[key] = executable
        return executable
