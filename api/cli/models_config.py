"""Several named models for one server: the ``--models-config`` YAML file, read and checked.

::

    models:
      smollm2:                        # the served name: what requests send as `model`
        model_id: smollm2-135m-instruct
        kvcache_mem_mb: 256
      tiny:
        model_id: ./tiny-llama        # a local HF folder, a .gguf file, an alias or a repo id
        dtype: float32
        max_num_seqs: 4

Each model's keys are ``EngineConfig`` fields: the engine flags of ``runtime-serve`` under their
field names (``max_num_seqs``, ``kvcache_mem_mb``, ``isq``, ...), checked by ``EngineConfig``
itself. ``model_id`` is required; a key the file leaves out takes the value of the command-line
flag (or its default), so flags such as ``--kvcache-mem`` set what every model gets unless it
says otherwise. The mapping key is the model's one served name, so ``served_model_name`` is not
a key. The first model answers requests that name none. An unknown key, a value of the wrong
type or out of range, a name given twice: a ``ValueError`` naming the file, the model and the
key, which ``runtime-serve`` prints as one line.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import msgspec
import yaml

from jax_llm_runtime.runtime.config import EngineConfig

_REFUSED = {"served_model_name": "the model's name is its key under `models`"}


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping key given twice is an error (PyYAML keeps the
    last one silently, which would drop a model without a word)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: list[Any] = []
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {key!r} is given twice", key_node.start_mark
            )
        seen.append(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"cannot read the models config {path}: {reason}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data, no objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{path}: invalid YAML{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {' '.join(str(exc).split())}") from None


def _engine_fields() -> dict[str, Any]:
    """EngineConfig's field name -> its type (resolved from the postponed annotations)."""
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig)}


def _unknown_key(key: str, allowed: list[str]) -> str:
    spelled = key.replace("-", "_")
    close = [spelled] if spelled in allowed else difflib.get_close_matches(spelled, allowed, 1)
    hint = f"did you mean {close[0]!r}?" if close else f"the keys are: {', '.join(allowed)}"
    return f"unknown key {key!r}; {hint}"


def model_config(name: Any, entry: Any, base: EngineConfig) -> EngineConfig:
    """One model of the file as an ``EngineConfig`` over ``base`` (ValueError when malformed;
    the message names the model and the key, the caller adds the file)."""
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(f"model name {name!r} must be a non-empty string without spaces")
    if not isinstance(entry, dict):
        raise ValueError(f"model {name!r} must be a mapping of engine options (model_id: ...)")
    types = _engine_fields()
    allowed = [key for key in types if key not in _REFUSED]
    values: dict[str, Any] = {}
    for key, value in entry.items():
        if key in _REFUSED:
            raise ValueError(f"model {name!r}: {key!r} is not a key here: {_REFUSED[key]}")
        if key not in types:
            raise ValueError(f"model {name!r}: {_unknown_key(str(key), allowed)}")
        try:
            values[key] = msgspec.convert(value, types[key])
        except msgspec.ValidationError as exc:
            reason = str(exc)
            reason = reason[:1].lower() + reason[1:]  # "expected `int`, got `str`"
            raise ValueError(f"model {name!r}: {key}: {reason} ({value!r})") from None
    if "model_id" not in values:
        raise ValueError(f"model {name!r}: model_id is required")
    try:
        return dataclasses.replace(base, served_model_name=name, **values)
    except ValueError as exc:
        raise ValueError(f"model {name!r}: {exc}") from None


def load_models_config(path: str | Path, base: EngineConfig) -> tuple[EngineConfig, ...]:
    """The models of a ``--models-config`` file in file order, each an ``EngineConfig`` over
    ``base`` (the command-line flags) with ``served_model_name`` set to its name.

    Raises ValueError naming the file (and the model and key) when the file cannot be read, is
    not ``models: {name: {key: value, ...}, ...}`` with at least one model, or holds a key or a
    value ``EngineConfig`` refuses.
    """
    path = Path(path).expanduser()
    data = _read_yaml(path)
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not models:
        raise ValueError(f"{path} must hold `models:` mapping one or more names to their options")
    extra = sorted(str(key) for key in data if key != "models")
    if extra:
        raise ValueError(f"{path}: unknown top-level keys {', '.join(extra)} (only `models`)")
    try:
        return tuple(model_config(name, entry, base) for name, entry in models.items())
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
