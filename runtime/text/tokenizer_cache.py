"""The fast tokenizer transformers rebuilds from a GGUF file, kept in the runtime's cache.

Rebuilding it means parsing every metadata field of the file with ``gguf.GGUFReader`` (a
49,152-token vocabulary is 250,000 small reads) and importing transformers' auto classes, which
import torch: about 8 s of a warm start on a 2-core CPU, every start. The first start saves the
built tokenizer (``save_pretrained``: ``tokenizer.json`` and its config) under
``<cache root>/tokenizers/<key>/``; later starts load that folder with the same tokenizer class
(no torch, no GGUF parse). The key covers the file (resolved path, size, modification time),
transformers' and tokenizers' versions, and ``FORMAT``, so a changed file or library rebuilds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jax_llm_runtime.runtime.loading.sources import cache_root

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when what is stored (or how it is post-processed) changes
_CLASS_FILE = "tokenizer_class.json"


def cache_folder(path: Path) -> Path:
    """Where the tokenizer built from the GGUF file ``path`` is kept."""
    import tokenizers
    import transformers

    stat = path.stat()
    key = json.dumps(
        [
            str(path.resolve()),
            stat.st_size,
            stat.st_mtime_ns,
            transformers.__version__,
            tokenizers.__version__,
            FORMAT,
        ]
    )
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def load_or_build(path: Path, build: Callable[[], Any]) -> Any:
    """The HF fast tokenizer of the GGUF file ``path``: loaded from the cache when a start has
    saved it, else ``build()`` (then saved; a cache that cannot be written only logs)."""
    folder = cache_folder(path)
    cached = _load(folder)
    if cached is not None:
        return cached
    hf = build()
    _save(hf, folder)
    return hf


def _load(folder: Path) -> Any | None:
    """The saved tokenizer, or None when there is none or it cannot be read back."""
    import transformers

    try:
        name = json.loads((folder / _CLASS_FILE).read_text())["class"]
        cls = getattr(transformers, name, None)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerFast)):
            return None
        return cls.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if folder.exists():
            logger.warning("cached tokenizer %s unreadable, rebuilding it: %s", folder, exc)
        return None


def _save(hf: Any, folder: Path) -> None:
    """``hf`` saved into ``folder`` whole or not at all (written beside it, then renamed)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
            staged = Path(tmp) / "tokenizer"
            hf.save_pretrained(str(staged))
            (staged / _CLASS_FILE).write_text(json.dumps({"class": type(hf).__name__}))
            os.replace(staged, folder)
    except OSError as exc:  # a read-only cache, a concurrent start that renamed first
        if not (folder / _CLASS_FILE).exists():
            logger.warning("could not cache the tokenizer in %s: %s", folder, exc)
