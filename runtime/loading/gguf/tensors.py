"""GGUF tensors to HF tensors: a plan made from the header, run one rule at a time.

``plan_tensors`` maps every GGUF tensor name (and rejects unknown ones) before any weight is read.
Each ``TensorRule`` reads one or two GGUF tensors and yields one or more HF tensors, undoing what
llama.cpp's converter did to them:

- renames (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``);
- the q/k row interleave of ``llama`` files, and Gemma's ``norm + 1``;
- stacked tensors split back into one tensor per expert (or per head, StableLM's q/k norms);
- a fused ``attn_qkv`` (``--fuse-qkv``) split back into q/k/v where HF keeps them apart;
- DeepSeek's ``attn_k_b`` (transposed per head) and ``attn_v_b`` joined into ``kv_b_proj``;
- gpt-oss's and Llama 4's expert gate and up stacks joined into ``gate_up_proj`` (gpt-oss's
  interleaved), and their expert stacks yielded in HF's ``[experts, in, out]`` orientation;
- the Gated DeltaNet tensors of Qwen3-Next and Qwen3.5 (``gated_delta_net``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from jax_llm_runtime.runtime.loading.gguf.config import CONFIG_TENSORS, GGUFModel
from jax_llm_runtime.runtime.loading.gguf.gated_delta_net import gated_delta_net_ops, join_qkvz
from jax_llm_runtime.runtime.loading.gguf.reader import GGUFError
from jax_llm_runtime.runtime.loading.gguf.spec import ArchSpec, Join

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
# Older converters squeezed HF's [1, hidden] shared-expert gate to [hidden].
_ROW_VECTORS = ("ffn_gate_inp_shexp",)
_Op = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class TensorRule:
    """Read ``sources`` (GGUF names, in this order), convert, yield ``outputs`` (HF names)."""

    sources: tuple[str, ...]
    outputs: tuple[str, ...]
    convert: Callable[[list[np.ndarray]], list[np.ndarray]]
    # The conversion only reorders, splits or unstacks rows, so it works on block bytes too.
    rows_only: bool = True
    # The HF tensors are ``[..., in, out]``: float outputs are transposed after ``convert``
    # (packed ones are ``[..., in, out]`` already).
    in_out: bool = False


def plan_tensors(
    spec: ArchSpec, config: dict[str, Any], model: GGUFModel, names: Sequence[str]
) -> tuple[TensorRule, ...]:
    """The rules for every tensor in ``names`` (file order), config tensors left out.

    Raises GGUFError for a tensor with no mapping, a layer past ``num_hidden_layers``, or a shape
    that does not fit the config. The ``num_nextn_predict_layers`` layers a converter writes after
    the last one (GLM-4.5's next-token prediction, for speculative decoding) are skipped.
    """
    rules: list[TensorRule] = []
    done = set(CONFIG_TENSORS)
    for name in names:
        if name in done or _is_nextn(config, name):
            continue
        rule = _rule(spec, config, model, name)
        done.update(rule.sources)
        rules.append(rule)
    return tuple(rules)


def _is_nextn(config: dict[str, Any], name: str) -> bool:
    match = _LAYER_NAME.fullmatch(name)
    layers = config["num_hidden_layers"]
    nextn = config.get("num_nextn_predict_layers") or 0
    return match is not None and layers <= int(match[1]) < layers + nextn


def _split_suffix(name: str) -> tuple[str, str]:
    stem, dot, suffix = name.rpartition(".")
    return (stem, dot + suffix) if suffix in ("weight", "bias") else (name, "")


def _lookup(table: Mapping[str, str], name: str) -> str | None:
    if name in table:
        return table[name]
    stem, suffix = _split_suffix(name)
    return table[stem] + suffix if suffix and stem in table else None


def _rule(spec: ArchSpec, config: dict[str, Any], model: GGUFModel, name: str) -> TensorRule:
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        if (hf := _lookup(spec.global_tensors, name)) is not None:
            return _single(spec, name, hf, ())
        raise _unmapped(name, model.arch)
    layer, rest = int(match[1]), match[2]
    if layer >= config["num_hidden_layers"]:
        raise GGUFError(
            f"GGUF tensor {name!r} belongs to layer {layer}, but the model has "
            f"{config['num_hidden_layers']} layers"
        )
    prefix = f"model.layers.{layer}."
    stem, suffix = _split_suffix(rest)
    if (join := _join_of(spec, rest)) is not None:
        return _joined(spec, model, f"blk.{layer}.", prefix, *join)
    if spec.joined_qkvz and stem in ("attn_qkv", "attn_gate"):
        return _merge_qkvz(config, model, f"blk.{layer}.", prefix)
    if (hf := _lookup(spec.layer_tensors, rest)) is not None:
        return _table_rule(spec, config, model, name, stem, prefix, hf)
    if stem in spec.stacked_tensors:
        template, count_key = spec.stacked_tensors[stem]
        return _stacked(name, prefix + template + suffix, config.get(count_key), count_key, model)
    if stem == "attn_qkv":
        return _split_qkv(spec, config, model, name, prefix, suffix)
    if spec.merge_kv_b and stem in ("attn_k_b", "attn_v_b"):
        return _merge_kv_b(config, model, f"blk.{layer}.", prefix)
    raise _unmapped(name, model.arch)


def _table_rule(
    spec: ArchSpec,
    config: dict[str, Any],
    model: GGUFModel,
    name: str,
    stem: str,
    prefix: str,
    hf: str,  # the HF name after ``prefix``
) -> TensorRule:
    """A layer tensor the table names: renamed, with what its architecture's converter did to
    it undone."""
    ops = _qk_ops(spec, config, name, stem, model.shapes[name][0])
    if stem in _ROW_VECTORS and len(model.shapes[name]) == 1:
        ops = (*ops, _as_row)
    if spec.gated_delta_net:
        gdn, rows_only = gated_delta_net_ops(spec, config, name, stem, model.shapes[name])
        if gdn:
            return TensorRule((name,), (prefix + hf,), partial(_apply, (*ops, *gdn)), rows_only)
    return _single(spec, name, prefix + hf, ops, in_out=hf in spec.in_out)


def _unmapped(name: str, arch: str) -> GGUFError:
    return GGUFError(f"GGUF tensor {name!r} has no mapping for architecture {arch!r}")


def _single(
    spec: ArchSpec, name: str, hf: str, ops: tuple[_Op, ...], in_out: bool = False
) -> TensorRule:
    if spec.norm_shift and hf.endswith("norm.weight") and not hf.endswith(spec.unshifted_norms):
        ops = (*ops, partial(_shift, by=-spec.norm_shift))
        return TensorRule((name,), (hf,), partial(_apply, ops), rows_only=False)
    return TensorRule((name,), (hf,), partial(_apply, ops), in_out=in_out)


def _join_of(spec: ArchSpec, rest: str) -> tuple[str, Join] | None:
    """(first GGUF name, its ``Join``) when ``rest`` is either half of a joined tensor."""
    for first, join in spec.joined_tensors.items():
        if rest in (first, join.second):
            return first, join
    return None


def _joined(
    spec: ArchSpec, model: GGUFModel, blk: str, prefix: str, first: str, join: Join
) -> TensorRule:
    if join.second is None:
        names: tuple[str, ...] = (blk + first,)
        shape = model.shapes[names[0]]
        if len(shape) < -join.axis or shape[join.axis] % 2:
            raise GGUFError(f"GGUF tensor {names[0]!r} of shape {shape} has no two halves")
        convert = partial(_join_halves, axis=join.axis, interleave=join.interleave)
    else:
        names = (blk + first, blk + join.second)
        shapes = [model.shapes.get(n) for n in names]
        if shapes[0] is None or shapes[0] != shapes[1]:
            raise GGUFError(
                f"GGUF tensors {names[0]!r} and {names[1]!r} must come together with one "
                f"shape, have {shapes[0]} and {shapes[1]}"
            )
        convert = partial(_join, axis=join.axis, interleave=join.interleave)
    return TensorRule(
        names,
        (prefix + join.hf,),
        convert,
        rows_only=join.axis == -2,  # whole rows of blocks move; a bias's values do not
        in_out=join.hf in spec.in_out,
    )


def _qk_ops(
    spec: ArchSpec, config: dict[str, Any], name: str, stem: str, rows: int
) -> tuple[_Op, ...]:
    if not spec.permute_qk or stem not in ("attn_q", "attn_k"):
        return ()
    heads = config["num_attention_heads" if stem == "attn_q" else "num_key_value_heads"]
    if rows % (2 * heads):
        raise GGUFError(f"tensor {name!r} with {rows} rows does not split into {heads} heads")
    return (partial(_unpermute_rope_rows, num_heads=heads),)


def _stacked(
    name: str, template: str, count: int | None, count_key: str, model: GGUFModel
) -> TensorRule:
    """``template`` is the full HF name with ``{i}`` for the row index."""
    rows = model.shapes[name][0]
    if rows != count:
        raise GGUFError(
            f"GGUF tensor {name!r} stacks {rows} tensors, but the config has {count_key}={count}"
        )
    return TensorRule((name,), tuple(template.format(i=i) for i in range(rows)), _unstack)


def _split_qkv(
    spec: ArchSpec,
    config: dict[str, Any],
    model: GGUFModel,
    name: str,
    prefix: str,
    suffix: str,
) -> TensorRule:
    head_dim = config["head_dim"]
    sizes = (
        config["num_attention_heads"] * head_dim,
        config["num_key_value_heads"] * head_dim,
        config["num_key_value_heads"] * head_dim,
    )
    if model.shapes[name][0] != sum(sizes):
        raise GGUFError(
            f"GGUF tensor {name!r} has {model.shapes[name][0]} rows, expected q/k/v {sizes}"
        )
    names = ("attn_q", "attn_k", "attn_v")
    hf = [_lookup(spec.layer_tensors, n + suffix) for n in names]
    if None in hf:
        raise _unmapped(name, model.arch)
    ops = [_qk_ops(spec, config, name, n, size) for n, size in zip(names, sizes, strict=True)]
    convert = partial(_split_rows, sizes, ops)
    return TensorRule((name,), tuple(prefix + h for h in hf if h), convert)


def _merge_kv_b(config: dict[str, Any], model: GGUFModel, blk: str, prefix: str) -> TensorRule:
    k_b, v_b = f"{blk}attn_k_b.weight", f"{blk}attn_v_b.weight"
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    expected = {
        k_b: (heads, rank, config["qk_nope_head_dim"]),
        v_b: (heads, config["v_head_dim"], rank),
    }
    for name, shape in expected.items():
        if model.shapes.get(name) != shape:
            raise GGUFError(
                f"GGUF tensor {name!r} has shape {model.shapes.get(name)}, expected {shape} "
                "(attn_k_b and attn_v_b must come together)"
            )
    return TensorRule(
        (k_b, v_b), (prefix + "self_attn.kv_b_proj.weight",), _join_kv_b, rows_only=False
    )


def _merge_qkvz(config: dict[str, Any], model: GGUFModel, blk: str, prefix: str) -> TensorRule:
    qkv, z = f"{blk}attn_qkv.weight", f"{blk}attn_gate.weight"
    k_heads, k_dim = config["linear_num_key_heads"], config["linear_key_head_dim"]
    v_width = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    hidden = config["hidden_size"]
    expected = {qkv: (2 * k_heads * k_dim + v_width, hidden), z: (v_width, hidden)}
    for name, shape in expected.items():
        if model.shapes.get(name) != shape:
            raise GGUFError(
                f"GGUF tensor {name!r} has shape {model.shapes.get(name)}, expected {shape} "
                "(attn_qkv and attn_gate must come together)"
            )
    convert = partial(join_qkvz, k_heads=k_heads, k_dim=k_dim)
    return TensorRule((qkv, z), (prefix + "linear_attn.in_proj_qkvz.weight",), convert)


def _apply(ops: tuple[_Op, ...], arrays: list[np.ndarray]) -> list[np.ndarray]:
    (array,) = arrays
    for op in ops:
        array = op(array)
    return [array]


def _as_row(array: np.ndarray) -> np.ndarray:
    return array.reshape(1, -1)


def _shift(array: np.ndarray, by: float) -> np.ndarray:
    # Exact for bf16-born weights: w + 1 kept every bit of w in float32, so subtracting 1 undoes it.
    return array + np.float32(by)


def _unstack(
    arrays: list[np.ndarray],  # [[count, *shape]]
) -> list[np.ndarray]:  # count x [*shape]
    return [np.ascontiguousarray(part) for part in arrays[0]]


def _split_rows(
    sizes: tuple[int, ...], ops: list[tuple[_Op, ...]], arrays: list[np.ndarray]
) -> list[np.ndarray]:
    parts = np.split(arrays[0], np.cumsum(sizes)[:-1], axis=0)
    return [
        _apply(part_ops, [np.ascontiguousarray(p)])[0]
        for p, part_ops in zip(parts, ops, strict=True)
    ]


def _join(
    arrays: list[np.ndarray],  # two [..., n, ...] arrays of one shape
    axis: int,
    interleave: bool,
) -> list[np.ndarray]:  # [[..., 2 * n, ...]]
    """The second array after the first along ``axis``, or with ``interleave`` their slices
    alternating (first[0], second[0], first[1], ...)."""
    if not interleave:
        return [np.concatenate(arrays, axis=axis)]
    shape = list(arrays[0].shape)
    shape[axis] *= 2
    return [np.ascontiguousarray(np.stack(arrays, axis=axis).reshape(shape))]


def _join_halves(arrays: list[np.ndarray], axis: int, interleave: bool) -> list[np.ndarray]:
    """``_join`` of the two halves of one array along ``axis``."""
    return _join(np.split(arrays[0], 2, axis=axis), axis, interleave)


def _join_kv_b(
    arrays: list[np.ndarray],  # [[heads, kv_lora_rank, nope], [heads, v_head_dim, kv_lora_rank]]
) -> list[np.ndarray]:  # [[heads * (nope + v_head_dim), kv_lora_rank]]
    k_b, v_b = arrays
    joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return [np.ascontiguousarray(joined.reshape(-1, joined.shape[-1]))]


def _unpermute_rope_rows(
    weight: np.ndarray,  # [num_heads * head_dim, ...]
    num_heads: int,
) -> np.ndarray:  # same shape
    """Invert llama.cpp's ``permute``: within each head, GGUF row ``2*i + j`` is HF row
    ``j*half + i`` (HF keeps the two rotary halves apart, llama.cpp interleaves them)."""
    half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)
