"""The inference runtime: engine, scheduler, model runner, loaders; usable as a library.

``from runtime import InferenceEngine`` is the library entry point (``runtime.library``). It is
imported on first use, so ``import runtime.config`` and friends stay light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Completion", "DeviceUnavailableError", "GenerationError", "InferenceEngine"]


def __getattr__(name: str) -> Any:
    if name in ("Completion", "GenerationError", "InferenceEngine"):
        from runtime import library

        return getattr(library, name)
    if name == "DeviceUnavailableError":
        from runtime.platform import DeviceUnavailableError

        return DeviceUnavailableError
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
