"""The inference runtime, usable as a library without any web server: the engine core
(``engine``), model loading (``loading``), tokenizers, chat templates and stop strings (``text``),
multi-device and multi-host serving (``parallel``) and the library facade (``library``), all
configured by one ``EngineConfig`` (``config``) on the JAX platform ``platform`` picks.

``from jax_llm_runtime.runtime import InferenceEngine`` is the library entry point. It is imported
on first use, so ``import jax_llm_runtime.runtime.config`` and friends stay light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Completion", "DeviceUnavailableError", "GenerationError", "InferenceEngine"]


def __getattr__(name: str) -> Any:
    if name in ("Completion", "GenerationError", "InferenceEngine"):
        from jax_llm_runtime.runtime.library import inference_engine as library

        return getattr(library, name)
    if name == "DeviceUnavailableError":
        from jax_llm_runtime.runtime.platform import DeviceUnavailableError

        return DeviceUnavailableError
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
