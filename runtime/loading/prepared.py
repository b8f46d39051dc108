"""Prepared checkpoints: the weights as serving holds them, written once with orbax-checkpoint.

Loading a GGUF or HF checkpoint converts it (GGUF names and row orders, bit-plane re-layout),
may quantize it (``--isq``) and places it on the tensor-parallel mesh. ``save_prepared``
(``runtime-serve --save-prepared DIR``) does that once and writes the result; ``--model-id DIR``
(``load_prepared``, through ``builder.load_model``) restores the arrays straight into their
shardings, each process reading only the chunks of its own devices' shards, and skips the
conversion and quantization. DIR holds::

    prepared.json         the manifest, written last: layout version, the options the weights
                          were prepared with, EOS ids, the weight tree's skeleton
                          (``runtime.loading.weight_tree``) and the size of every other file
    config.json           the HF-style config the architecture's model config is translated from
    tokenizer/            the fast tokenizer (``save_pretrained``)
    chat_template.jinja   the chat template, when the model has one
    generation_config.json  the source folder's sampling defaults, when it has them
    weights/              the orbax checkpoint of the weight arrays (a plain nested dict)
    vision/               a vision-language model's image encoder, its arrays likewise, with
                          the source's ``preprocessor_config.json`` and ``processor_config.json``
                          beside the config

The directory is written as ``DIR.partial`` and renamed when complete. What the weights depend
on must match when they are restored: the dtype and ``--isq`` (left unset, they are taken from
the manifest), the tensor-parallel size, expert parallelism and expert offload. The matmul
operands (``--matmul-dtype``) are a runtime choice and follow the flags. A manifest of another
``LAYOUT_VERSION``, a missing or truncated file, or weights orbax cannot read is a
``PreparedCheckpointError`` with a one-line message.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from jax_llm_runtime.models.decoder import Decoder
from jax_llm_runtime.models.vision.encoder import VisionWeights
from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.loading.builder import (
    LoadedModel,
    configure_model,
    load_model,
    place_on_mesh,
    resolve_dtype,
)
from jax_llm_runtime.runtime.loading.sources import PREPARED_MANIFEST, ModelFiles
from jax_llm_runtime.runtime.loading.vision import LoadedVision
from jax_llm_runtime.runtime.loading.weight_tree import (
    Skeleton,
    WeightTreeError,
    abstract_arrays,
    assemble,
    describe,
    partition_spec,
    with_static,
)
from jax_llm_runtime.runtime.parallel.sharding import build_mesh
from jax_llm_runtime.runtime.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# Bumped whenever what a prepared checkpoint holds, or how, changes: an older one is refused.
# 2: the weights are the split NNX model (its state and declaration); 3: routed expert stacks
# are ``ExpertLinear`` modules, so their arrays sit one level down (``e_gate/kernel``); 4: the
# linear attention's convolution (and Qwen3.5's in_proj_qkv) are q, k and v fields.
LAYOUT_VERSION = 4
WEIGHTS, TOKENIZER, CONFIG, VISION = "weights", "tokenizer", "config.json", "vision"
# The image processor's settings, read from the model folder (``runtime.multimodal``).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
CHAT_TEMPLATE, GENERATION_CONFIG = "chat_template.jinja", "generation_config.json"
# The EngineConfig fields the stored arrays depend on (dtype and isq are checked on their own).
_LAYOUT_FIELDS = ("tensor_parallel_size", "expert_parallel", "num_experts_offload_per_rank")
_FLAGS = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "expert_parallel": "--enable-expert-parallel",
    "num_experts_offload_per_rank": "--num-experts-offload-per-rank",
}


class PreparedCheckpointError(ValueError):
    """A prepared checkpoint that cannot be written or restored; the message is one line that
    says what to do."""


def save_prepared(config: EngineConfig, directory: str | Path) -> Path:
    """Load ``config``'s model as ``build_engine`` does (converted, ``isq``-quantized and placed
    on the mesh of its first replica) and write it to ``directory`` as a prepared checkpoint;
    returns the directory. Every process of a multi-node run calls this; each writes its own
    shards. Raises PreparedCheckpointError, and what loading the model raises."""
    target = Path(directory).expanduser().absolute()
    partial = target.with_name(target.name + ".partial")
    for path in (target, partial):
        if path.exists():
            raise PreparedCheckpointError(f"{path} already exists; remove it or choose another")
    source = Path(config.model_id).expanduser()
    if (source / PREPARED_MANIFEST).is_file():
        raise PreparedCheckpointError(
            f"{source} is already a prepared checkpoint; copy the directory instead"
        )
    model = load_model(config)
    mesh = _first_mesh(config)
    weights = model.weights
    if mesh is not None:
        placed_config, placed = place_on_mesh(mesh, model.config, weights, config.expert_parallel)
        # KV heads repeated for a mesh wider than them are made again at load: the folder
        # keeps the checkpoint's heads, which its config declares.
        weights = placed if placed_config == model.config else weights
    try:
        skeleton, arrays = describe(weights)
    except WeightTreeError as e:
        raise PreparedCheckpointError(f"cannot prepare {config.model_id}: {e}") from None
    _write_arrays(partial / WEIGHTS, arrays)
    if model.vision is not None:
        _write_arrays(partial / VISION, nnx.to_pure_dict(model.vision.weights.state))
    if jax.process_index() == 0:
        _write_model_files(partial, model)
        _write_manifest(partial, _manifest(config, model, skeleton))
        partial.rename(target)
        logger.info("prepared checkpoint of %s written to %s", config.model_id, target)
    return target


def load_prepared(config: EngineConfig, files: ModelFiles, packed: bool = True) -> LoadedModel:
    """The model of a prepared checkpoint, its weights restored onto the mesh of ``config``'s
    first replica (``builder.load_model``'s result). Raises PreparedCheckpointError."""
    folder = files.path
    if not packed:
        raise PreparedCheckpointError(
            f"{folder} is a prepared checkpoint: its weights load only as they were prepared"
        )
    manifest = read_manifest(folder)
    config = _prepared_config(folder, manifest, config)
    hf_config = _read_json_object(folder / CONFIG)
    spec, model_config = configure_model(config, hf_config)  # an unsupported architecture: here
    operands = (manifest["operand_dtype"], getattr(model_config, "operand_dtype", None))
    # The tokenizer (mostly JSON parsing) loads while orbax reads the arrays.
    with ThreadPoolExecutor(1) as pool:
        tokenizer = pool.submit(_load_tokenizer, folder, manifest["eos_token_ids"])
        declare = lambda declared: nnx.graphdef(Decoder.declared(model_config, declared))  # noqa: E731
        weights = _restore(folder, manifest["tree"], operands, _first_mesh(config), declare)
        dtype = resolve_dtype(config.dtype)
        vision = _restore_vision(folder, spec, hf_config, dtype) if manifest.get(VISION) else None
        loaded = LoadedModel(
            files, spec, model_config, weights, tokenizer.result(), dtype, hf_config, vision
        )
    logger.info("restored prepared checkpoint %s (%s)", folder, manifest["source"])
    return loaded


def read_manifest(folder: Path) -> dict[str, Any]:
    """``prepared.json`` of ``folder``, checked: its layout version, and every file it lists
    present with its recorded size. Raises PreparedCheckpointError."""
    manifest = _read_json_object(folder / PREPARED_MANIFEST)
    version = manifest.get("layout_version")
    if version != LAYOUT_VERSION:
        raise PreparedCheckpointError(
            f"{folder} is a prepared checkpoint of layout version {version}, and this runtime "
            f"reads version {LAYOUT_VERSION}; prepare it again with --save-prepared"
        )
    needed = ("prepared_with", "operand_dtype", "eos_token_ids", "tree", "files", "source")
    missing = [key for key in needed if key not in manifest]
    if missing:
        raise PreparedCheckpointError(f"{folder / PREPARED_MANIFEST} has no {missing[0]!r}")
    eos = manifest["eos_token_ids"]
    if not isinstance(eos, list) or not all(type(i) is int for i in eos):
        raise PreparedCheckpointError(f"{folder / PREPARED_MANIFEST}: malformed eos_token_ids")
    _check_files(folder, manifest["files"])
    return manifest


def _first_mesh(config: EngineConfig) -> Any:
    """The mesh of the first replica, as ``build_engine`` builds it (None: one device)."""
    size = config.tensor_parallel_size
    return build_mesh(config.devices[:size] if config.devices else None, size)


def _manifest(config: EngineConfig, model: LoadedModel, skeleton: Skeleton) -> dict[str, Any]:
    prepared_with = {"dtype": model.dtype.name, "isq": config.isq}
    prepared_with |= {name: getattr(config, name) for name in _LAYOUT_FIELDS}
    return {
        "layout_version": LAYOUT_VERSION,
        "source": config.model_id,
        "architecture": model.spec.hf_architecture,
        "prepared_with": prepared_with,
        "operand_dtype": getattr(model.config, "operand_dtype", None),
        "eos_token_ids": sorted(model.tokenizer.eos_token_ids),
        "tree": skeleton,
        VISION: model.vision is not None,
    }


def _prepared_config(folder: Path, manifest: dict[str, Any], config: EngineConfig) -> EngineConfig:
    """``config`` with the dtype and isq of the manifest; PreparedCheckpointError where a flag
    asks for weights other than those prepared."""
    prepared = manifest["prepared_with"]
    again = f"serve {folder} with the same or prepare it again"
    if config.dtype != "auto" and resolve_dtype(config.dtype).name != prepared["dtype"]:
        raise PreparedCheckpointError(
            f"{folder} holds {prepared['dtype']} weights, not --dtype {config.dtype}; drop "
            "--dtype or prepare it again"
        )
    if config.isq is not None and config.isq != prepared["isq"]:
        held = f"--isq {prepared['isq']}" if prepared["isq"] else "no --isq"
        raise PreparedCheckpointError(
            f"{folder} was prepared with {held}, not --isq {config.isq}; drop --isq or "
            "prepare it again"
        )
    for name in _LAYOUT_FIELDS:
        if getattr(config, name) != prepared[name]:
            raise PreparedCheckpointError(
                f"{folder} was prepared with {_FLAGS[name]} {prepared[name]}, not "
                f"{getattr(config, name)}; {again}"
            )
    return dataclasses.replace(config, dtype=prepared["dtype"], isq=prepared["isq"])


def _restore(
    folder: Path,
    skeleton: Skeleton,
    operands: tuple[Any, Any],
    mesh: Any,
    graphdef_for: Callable[[dict], Any],
) -> Any:
    """The weight pytree of ``skeleton``, its arrays read by orbax straight into their
    shardings on ``mesh`` (off a mesh: the first device), and the quantized weights' matmul
    operands rebound from ``operands[0]`` (prepared) to ``operands[1]`` (this run's); the split
    model's graph definition declared again by ``graphdef_for`` (``weight_tree.assemble``)."""
    import orbax.checkpoint as ocp

    device = jax.devices()[0]

    def sharding_for(leaf: Skeleton) -> Any:
        memory_kind = leaf.get("memory_kind")
        if mesh is None:
            return SingleDeviceSharding(device, memory_kind=memory_kind)
        return NamedSharding(mesh, partition_spec(leaf), memory_kind=memory_kind)

    try:
        skeleton = with_static(skeleton, "operand_dtype", *operands)
        target = abstract_arrays(skeleton, sharding_for)
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        with _checkpointer() as checkpointer:
            arrays = checkpointer.restore(
                (folder / WEIGHTS).absolute(),
                args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
            )
        # Where orbax placed an array elsewhere (another memory kind), it moves once.
        arrays = jax.tree.map(_placed_as, arrays, target)
        return assemble(skeleton, arrays, graphdef_for)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise PreparedCheckpointError(
            f"{folder}: cannot restore the weights ({_first_line(e)}); prepare it again"
        ) from e


def _restore_vision(folder: Path, spec: Any, hf_config: dict[str, Any], dtype: Any) -> LoadedVision:
    """The image encoder of a prepared vision-language checkpoint: declared from the config,
    its arrays restored onto the first device (where ``builder.load_model`` puts them)."""
    import orbax.checkpoint as ocp

    if spec.vision is None:
        raise PreparedCheckpointError(
            f"{folder} holds an image encoder that {spec.hf_architecture} does not take; "
            "prepare it again"
        )
    vision_config = spec.vision.config_from_hf(hf_config)
    graphdef, state = nnx.split(spec.vision.declare(vision_config, dtype))
    device = SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
        nnx.to_pure_dict(state),
    )
    try:
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        with _checkpointer() as checkpointer:
            arrays = checkpointer.restore(
                (folder / VISION).absolute(),
                args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
            )
        nnx.replace_by_pure_dict(state, arrays)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise PreparedCheckpointError(
            f"{folder}: cannot restore the image encoder ({_first_line(e)}); prepare it again"
        ) from e
    return LoadedVision(vision_config, VisionWeights(graphdef, state), folder)


def _placed_as(array: jax.Array, target: jax.ShapeDtypeStruct) -> jax.Array:
    if array.sharding.is_equivalent_to(target.sharding, array.ndim):
        return array
    return jax.device_put(array, target.sharding)


def _checkpointer() -> Any:
    """orbax's synchronous checkpointer of pytrees, writing uncompressed: float weights and
    packed codes hardly compress, and zstd made a 660 MB restore take twice as long."""
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def _write_arrays(path: Path, arrays: dict[str, Any]) -> None:
    import orbax.checkpoint as ocp

    path.parent.mkdir(parents=True, exist_ok=True)
    with _checkpointer() as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(arrays))


def _write_model_files(folder: Path, model: LoadedModel) -> None:
    """The config, tokenizer, chat template and sampling defaults beside the weights."""
    try:
        config = json.dumps(model.hf_config, indent=1)
    except TypeError as e:  # a loader put a value JSON cannot hold into the config
        raise PreparedCheckpointError(f"cannot write the model config: {e}") from None
    (folder / CONFIG).write_text(config, encoding="utf-8")
    model.tokenizer.hf.save_pretrained(str(folder / TOKENIZER))
    if model.tokenizer.chat_template:
        (folder / CHAT_TEMPLATE).write_text(model.tokenizer.chat_template, encoding="utf-8")
    copied = (GENERATION_CONFIG, *PROCESSOR_FILES) if model.vision else (GENERATION_CONFIG,)
    for name in copied:
        source = model.files.path / name
        if model.files.kind == "hf" and source.is_file():
            shutil.copyfile(source, folder / name)


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    sizes = {p.relative_to(folder).as_posix(): p.stat().st_size for p in files}
    text = json.dumps({**manifest, "files": sizes}, indent=1)
    (folder / PREPARED_MANIFEST).write_text(text, encoding="utf-8")


def _check_files(folder: Path, sizes: Any) -> None:
    if not isinstance(sizes, dict):
        raise PreparedCheckpointError(f"{folder / PREPARED_MANIFEST}: 'files' is not an object")
    for name, size in sizes.items():
        relative = Path(name)
        if relative.is_absolute() or ".." in relative.parts:
            raise PreparedCheckpointError(f"{folder / PREPARED_MANIFEST} lists {name!r}")
        path = folder / relative
        if not path.is_file():
            raise PreparedCheckpointError(
                f"prepared checkpoint {folder} is incomplete: {name} is missing; prepare it again"
            )
        if path.stat().st_size != size:
            raise PreparedCheckpointError(
                f"prepared checkpoint {folder} is damaged: {name} has {path.stat().st_size} "
                f"bytes, not {size}; prepare it again"
            )


def _load_tokenizer(folder: Path, eos_token_ids: list[int]) -> Tokenizer:
    # The generic fast class reads tokenizer.json as written, whatever class wrote it.
    from transformers import PreTrainedTokenizerFast

    try:
        hf = PreTrainedTokenizerFast.from_pretrained(str(folder / TOKENIZER), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PreparedCheckpointError(
            f"{folder}: cannot load its tokenizer ({_first_line(e)}); prepare it again"
        ) from e
    template = folder / CHAT_TEMPLATE
    chat_template = template.read_text(encoding="utf-8") if template.is_file() else None
    return Tokenizer(hf, frozenset(eos_token_ids), chat_template)


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PreparedCheckpointError(
            f"cannot read {path} ({_first_line(e)}); prepare the checkpoint again"
        ) from None
    if not isinstance(value, dict):
        raise PreparedCheckpointError(f"{path} does not hold a JSON object")
    return value


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
