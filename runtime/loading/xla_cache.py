"""The persistent XLA compilation cache, written so that a killed process leaves no half entry.

JAX's file cache writes an entry in place. A process killed during that write (SIGKILL, OOM, a
power cut; the background compile writes entries while the server already serves) leaves a
truncated file; the next start fails to read it, compiles that shape again, and then keeps the
bad file, since an entry that exists is never rewritten: every later start pays the compile.
Here an entry is written to a temporary file beside it and renamed over the name, so readers
see a whole entry or none, and a put always replaces: JAX only puts after a compile, which
happens only when the entry was missing or unreadable, so an unreadable one heals on the next
start that needs it.

``RUNTIME_XLA_CACHE=0`` turns the cache off (every start compiles, nothing is loaded).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)


CACHE_SWITCH = "RUNTIME_XLA_CACHE"  # "0" keeps compiled executables in memory only


def enable_compilation_cache(cache_dir: Path) -> None:
    """Persist compiled executables in ``cache_dir`` so a second start skips XLA compilation
    (unless ``RUNTIME_XLA_CACHE=0``: then every start compiles, and nothing is loaded)."""
    if os.environ.get(CACHE_SWITCH) == "0":
        logger.info("persistent XLA cache off")
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(cache_dir)
    _atomic_puts()
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


# A temporary file older than this was left by a killed writer (writes take well under a second;
# a younger one may belong to another process writing now).
STALE_PARTIAL_S = 600.0
PARTIAL_PREFIX = ".partial-"


def _remove_stale_partials(cache_dir: Path) -> None:
    for partial in cache_dir.glob(f"{PARTIAL_PREFIX}*"):
        try:
            if time.time() - partial.stat().st_mtime > STALE_PARTIAL_S:
                partial.unlink()
        except OSError:  # another process removed or renamed it first
            pass


def write_atomically(path: Path, value: bytes) -> None:
    """``value`` to ``path`` through a temporary file in the same folder and one rename."""
    fd, tmp = tempfile.mkstemp(prefix=PARTIAL_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_puts() -> None:
    """Make JAX's file cache (``jax._src.lru_cache.LRUCache``) write entries atomically. Only
    its unbounded mode (no ``jax_compilation_cache_max_size``, the default) is changed: the
    bounded one keeps JAX's own put, with its eviction bookkeeping. Where that class is not
    found (a JAX that moved it) the cache is left as JAX writes it, and the log says so."""
    try:
        from jax._src import compilation_cache, lru_cache
    except ImportError:  # pragma: no cover - depends on the JAX version
        logger.info("XLA cache entries are written by JAX itself (no lru_cache module)")
        return
    base = getattr(lru_cache, "LRUCache", None)
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", None)
    if base is None or not isinstance(suffix, str) or not hasattr(base, "put"):
        logger.info("XLA cache entries are written by JAX itself (unknown LRUCache layout)")
        return
    if getattr(base, "writes_atomically", False):
        return

    class AtomicLRUCache(base):  # type: ignore[misc, valid-type]
        writes_atomically = True

        def put(self, key: str, value: bytes) -> None:
            if getattr(self, "eviction_enabled", True) or not key:
                return super().put(key, value)
            write_atomically(Path(self.path) / f"{key}{suffix}", value)

    compilation_cache.LRUCache = AtomicLRUCache
    existing: Any = getattr(compilation_cache, "_cache", None)
    if type(existing) is base:  # initialized before (a library user compiled first)
        existing.__class__ = AtomicLRUCache
