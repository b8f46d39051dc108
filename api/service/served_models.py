"""The served models by name: which engine answers a request's ``model``.

A server serves one engine (``--model-id``, maybe under several ``--served-model-name`` aliases)
or several (``--models-config``, one engine per named model). Both are a ``ModelRegistry``:

1. ``create_app`` builds it from ``ServedModel``s (an engine and its own sampling defaults, e.g.
   from its ``generation_config.json``) and the ``ServerConfig``. Each model becomes a
   ``ModelEntry``: the engine plus the server settings as they apply to its requests (its
   accepted names, its sampling defaults). Every accepted name maps to exactly one entry.
2. Per request, a route handler receives the registry by dependency injection
   (``api.service.dependencies``), decodes its body and calls ``resolve(body.model)``: an omitted or
   empty name means the first model; a name no model answers to is a 404 ``model_not_found``,
   except that a server of one model answers any name with it unless
   ``ServerConfig.strict_model_names`` (``--strict-model-names``, or ``--models-config``).
   The handler then runs on that entry's engine with that entry's settings.
3. The app's lifespan starts the engines in order and ``shutdown`` stops them all at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from jax_llm_runtime.api.protocol.errors import APIError
from jax_llm_runtime.api.service.settings import SamplingDefaults, ServerConfig
from jax_llm_runtime.runtime.engine.interface import EngineClient


@dataclass(frozen=True)
class ServedModel:
    """An engine to serve. ``sampling_defaults`` fill what its requests omit (None: the server
    config's); they differ per model when each has its own ``generation_config.json``."""

    engine: EngineClient
    sampling_defaults: SamplingDefaults | None = None


@dataclass(frozen=True)
class ModelEntry:
    """One served engine and the settings its requests run with: ``config.served_model_names``
    are the names it answers to (the first, ``engine.model_name``, is reported in responses) and
    ``config.sampling_defaults`` its defaults; everything else is the server's."""

    engine: EngineClient
    config: ServerConfig

    @property
    def name(self) -> str:
        """The reported name."""
        return self.engine.model_name

    @property
    def names(self) -> tuple[str, ...]:
        """Every name requests may use for this model, the reported one first."""
        return self.config.model_names(self.engine.model_name)


class ModelRegistry:
    """Served name -> ``ModelEntry``; the first model answers requests that name none."""

    def __init__(self, models: Sequence[ServedModel], config: ServerConfig) -> None:
        """Raises ValueError when there is no model, when ``config.served_model_names`` is set
        for several models (aliases rename one model; several are served under their own
        names), when the first alias is not the engine's ``model_name`` (responses report it),
        or when two models answer to one name."""
        if not models:
            raise ValueError("there is no model to serve")
        if config.served_model_names and len(models) > 1:
            raise ValueError(
                "served model names rename a single model; several models are served under "
                "their own names"
            )
        self.config = config
        self.entries = tuple(_entry(model, config) for model in models)
        self._by_name: dict[str, ModelEntry] = {}
        for entry in self.entries:
            for name in entry.names:
                if name in self._by_name:
                    raise ValueError(f"two models are served as {name!r}")
                self._by_name[name] = entry

    @property
    def default(self) -> ModelEntry:
        """The model of requests that name none: the first."""
        return self.entries[0]

    def resolve(self, requested: str | None) -> ModelEntry:
        """The entry serving ``requested``; None or "" is the default model, and so is any name
        when one model is served and names are not strict. Raises ``APIError`` 404
        ``model_not_found`` (param ``model``) for a name no model answers to."""
        if not requested:
            return self.default
        entry = self._by_name.get(requested)
        if entry is None and len(self.entries) == 1 and not self.config.strict_model_names:
            return self.default  # candle-vllm's and llama.cpp's clients send any name
        if entry is None:
            served = ", ".join(f"`{e.name}`" for e in self.entries)
            raise APIError(
                404,
                f"The model `{requested}` does not exist. This server serves {served}.",
                param="model",
                code="model_not_found",
            )
        return entry

    def unhealthy(self) -> list[str]:
        """The reported names of the models whose engine is not serving."""
        return [entry.name for entry in self.entries if not entry.engine.healthy()]

    def shutdown(self) -> None:
        """Shut every engine down at once (each stops its own threads, which can take a while);
        re-raises the first error after all have been asked to stop."""
        engines = [entry.engine for entry in self.entries]
        with ThreadPoolExecutor(len(engines), thread_name_prefix="engine-shutdown") as pool:
            futures = [pool.submit(engine.shutdown) for engine in engines]
        for future in futures:
            future.result()


def _entry(model: ServedModel, config: ServerConfig) -> ModelEntry:
    names = config.model_names(model.engine.model_name)
    if names[0] != model.engine.model_name:
        raise ValueError(
            f"the first served model name ({names[0]!r}) must be the engine's model_name "
            f"({model.engine.model_name!r}): responses report it"
        )
    if model.sampling_defaults is None:
        return ModelEntry(model.engine, config)
    return ModelEntry(model.engine, replace(config, sampling_defaults=model.sampling_defaults))
