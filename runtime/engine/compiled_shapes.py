"""Ahead-of-time compiled executables, one per padding bucket, compiled up front, in the
background, or (as a last resort) on first use.

Startup compiles only the buckets short requests need, on all cores at once (XLA compiles
outside the GIL); the engine compiles the rest on one background thread once it serves, smallest
first. A step whose bucket is not compiled yet compiles it on the spot, once (a per-bucket lock
makes the background thread and the step share one compilation), and says so in the log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

logger = logging.getLogger(__name__)


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
                self._compile(key)
                count += 1
        return count

    def _compile(self, key: Hashable) -> Any:
        with self._locks_guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            executable = self._compiled.get(key)
            if executable is None:
                executable = self._lower(key).compile()
                self._compiled[key] = executable
        return executable
