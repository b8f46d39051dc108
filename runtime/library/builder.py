"""The fluent builder of ``InferenceEngine``: one method per ``EngineConfig`` setting users reach for.

``InferenceEngine.builder().model_id("smollm2-135m-instruct").device("cpu").max_num_seqs(4)
.max_model_len(512).kvcache_mem(64).build()`` collects the settings, validates them as an
``EngineConfig`` (``config()``, without loading anything) and builds the engine (``build()``),
or writes the loaded model as a prepared checkpoint instead (``save_prepared(directory)``).
Settings without a method of their own go through ``option(name, value)``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.platform import check_device_name, select_platform

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

E = TypeVar("E")
_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


def engine_config(**fields: Any) -> EngineConfig:
    """An ``EngineConfig`` from keyword fields; an unknown name is a TypeError listing the known."""
    _check_names(fields)
    return EngineConfig(**fields)


def _check_names(fields: dict[str, Any]) -> None:
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise TypeError(
            f"unknown engine setting(s) {', '.join(unknown)}; the settings are device, "
            f"{', '.join(sorted(_FIELDS))}"
        )


class EngineBuilder(Generic[E]):
    """Collects engine settings; ``config()`` validates them, ``build()`` starts the engine."""

    def __init__(self, factory: Callable[..., E]) -> None:
        self._factory = factory
        self._fields: dict[str, Any] = {}
        self._device: str | None = None

    def option(self, name: str, value: Any) -> EngineBuilder[E]:
        """Set any ``EngineConfig`` field by name (TypeError for an unknown one). Values are
        checked together, by ``config()`` and ``build()``, since some depend on each other."""
        _check_names({name: value})
        self._fields[name] = value
        return self

    def model_id(self, model_id: str) -> EngineBuilder[E]:
        """A packaged alias, a local HF folder or .gguf file, or a Hugging Face repo id."""
        return self.option("model_id", model_id)

    def weight_file(self, name: str) -> EngineBuilder[E]:
        """Which weight file to use inside a model folder or repo (one .gguf of several)."""
        return self.option("weight_file", name)

    def device(self, device: str) -> EngineBuilder[E]:
        """The JAX platform: "cpu", "gpu", "tpu" or "metal" (checked for presence at build)."""
        self._device = check_device_name(device)
        return self

    def dtype(self, dtype: str) -> EngineBuilder[E]:
        """The weight and activation dtype: auto (float32 on CPU, else bfloat16), float32,
        bfloat16 or float16."""
        return self.option("dtype", dtype)

    def max_num_seqs(self, count: int) -> EngineBuilder[E]:
        """The most sequences one step batches."""
        return self.option("max_num_seqs", count)

    def max_model_len(self, tokens: int) -> EngineBuilder[E]:
        """The most tokens (prompt and completion) per sequence."""
        return self.option("max_model_len", tokens)

    def kvcache_mem(self, megabytes: int) -> EngineBuilder[E]:
        """Memory for the paged KV cache, all layers, in MB (``EngineConfig.kvcache_mem_mb``)."""
        return self.option("kvcache_mem_mb", megabytes)

    def isq(self, quantization: str | None) -> EngineBuilder[E]:
        """In-situ quantization at load: a GGUF block type ("q4_0", "q8_0", "q4k", ...) or "int8"."""
        return self.option("isq", quantization)

    def kv_cache_dtype(self, dtype: str) -> EngineBuilder[E]:
        """The KV cache storage: auto (the model dtype) or fp8 (float8 e4m3 with scales)."""
        return self.option("kv_cache_dtype", dtype)

    def page_size(self, tokens: int) -> EngineBuilder[E]:
        """Tokens per KV page, a power of two."""
        return self.option("page_size", tokens)

    def seed(self, seed: int) -> EngineBuilder[E]:
        """The seed of the engine's sampling random stream."""
        return self.option("seed", seed)

    def prefix_cache(self, enabled: bool) -> EngineBuilder[E]:
        """Reuse the K/V of full pages that match an earlier request's prefix (default on)."""
        return self.option("prefix_cache", enabled)

    def config(self) -> EngineConfig:
        """The settings as a validated ``EngineConfig`` (ValueError for a bad value)."""
        return engine_config(**self._fields)

    @property
    def selected_device(self) -> str | None:
        """The platform ``device()`` chose, or None for JAX's default."""
        return self._device

    def build(self) -> E:
        """Validate, pick the platform, load the model and start the engine."""
        self.config()
        return self._factory(device=self._device, **self._fields)

    def save_prepared(self, directory: str | Path) -> Path:
        """Validate, pick the platform, load the model as ``build()`` would (converted,
        ``isq``-quantized, split over the tensor-parallel devices) and write it to the new
        folder ``directory`` as a prepared checkpoint instead of starting an engine; a later
        ``model_id(directory)`` restores it without converting or quantizing again
        (``runtime.loading.prepared``; raises its ``PreparedCheckpointError``)."""
        config = self.config()
        if self._device is not None:
            select_platform(self._device)
        from jax_llm_runtime.runtime.loading.prepared import save_prepared

        return save_prepared(config, directory)
