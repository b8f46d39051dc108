"""Gated DeltaNet tensors (Qwen3-Next, Qwen3.5) as llama.cpp's converter stores them, put back
in HF's form: ``A_log`` from ``-exp(A_log)``, the conv kernel's middle axis, Qwen3-Next's
``in_proj_qkvz`` from ``attn_qkv`` and ``attn_gate``, and Qwen3.5's value heads from the tiled
order the converter puts them in (one head of each key head's group, then the next) back to
grouped by key head.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from jax_llm_runtime.runtime.loading.gguf.reader import GGUFError
from jax_llm_runtime.runtime.loading.gguf.spec import ArchSpec

_Op = Callable[[np.ndarray], np.ndarray]


def join_qkvz(
    arrays: list[np.ndarray],  # [[2 * k_heads * k_dim + v_width, ...], [v_width, ...]]
    k_heads: int,
    k_dim: int,
) -> list[np.ndarray]:  # [[k_heads * (2 * k_dim + 2 * v_width / k_heads), ...]]
    """HF's in_proj_qkvz rows: per key head its q, k, v and z rows (the converter wrote all q
    rows, all k rows, all v rows, and z apart)."""
    qkv, z = arrays
    q, k, v = np.split(qkv, [k_heads * k_dim, 2 * k_heads * k_dim])
    per_head = [part.reshape(k_heads, -1, *qkv.shape[1:]) for part in (q, k, v, z)]
    return [np.ascontiguousarray(np.concatenate(per_head, axis=1).reshape(-1, *qkv.shape[1:]))]


def _a_log(
    a: np.ndarray,  # [v_heads]: -exp(A_log), as the converter stores it
) -> np.ndarray:  # [v_heads]: A_log (to within float32 rounding of exp and log)
    return np.log(-a)


def _conv_kernel(
    kernel: np.ndarray,  # [channels, kernel_size]
) -> np.ndarray:  # [channels, 1, kernel_size]: HF's depthwise Conv1d weight
    return np.ascontiguousarray(kernel[:, None, :])


_GDN_OPS: dict[str, _Op] = {"ssm_a": _a_log, "ssm_conv1d": _conv_kernel}
# Where Qwen3.5's value heads sit in each tensor: (after how many q and k widths, the width of
# one value head (else 1), along which axis).
_TILED = {
    "attn_qkv": (2, True, 0),
    "attn_gate": (0, True, 0),
    "ssm_beta": (0, False, 0),
    "ssm_alpha": (0, False, 0),
    "ssm_a": (0, False, 0),
    "ssm_dt": (0, False, 0),
    "ssm_conv1d": (2, True, 0),
    "ssm_out": (0, True, 1),
}
# Stems whose conversion only reorders rows of output channels (block bytes too).
_ROW_STEMS = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")


def gated_delta_net_ops(
    spec: ArchSpec, config: dict[str, Any], name: str, stem: str, shape: tuple[int, ...]
) -> tuple[tuple[_Op, ...], bool]:
    """A Gated DeltaNet tensor's conversions (value heads back to grouped order for Qwen3.5,
    then the stored form undone: ``_GDN_OPS``), and whether they only reorder rows."""
    ops: tuple[_Op, ...] = ()
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    v_dim = config["linear_value_head_dim"]
    if spec.tiled_v_heads and stem in _TILED and k_heads != v_heads:
        qk_widths, per_head, axis = _TILED[stem]
        offset = qk_widths * k_heads * config["linear_key_head_dim"]
        width = v_heads * (v_dim if per_head else 1)
        if len(shape) <= axis or shape[axis] != offset + width:
            raise GGUFError(
                f"GGUF tensor {name!r} of shape {shape} has no {width} value-head rows after "
                f"{offset} on axis {axis}"
            )
        head_dim = v_dim if per_head else 1
        ops = (
            partial(_group_v_heads, offset=offset, k_heads=k_heads, head_dim=head_dim, axis=axis),
        )
    if stem == "ssm_conv1d" and len(shape) != 2:
        raise GGUFError(f"GGUF tensor {name!r} of shape {shape} is not a [channels, kernel] conv")
    if stem in _GDN_OPS:
        ops = (*ops, _GDN_OPS[stem])
    return ops, stem in _ROW_STEMS


def _group_v_heads(
    array: np.ndarray,  # [..., offset + v_heads * head_dim (along axis), ...]
    offset: int,
    k_heads: int,
    head_dim: int,
    axis: int,
) -> np.ndarray:  # same shape
    """Undo the converter's tiling after ``offset``: GGUF value head ``j * k_heads + g`` is HF
    value head ``g * (v_heads / k_heads) + j`` (grouped by key head ``g``)."""
    moved = np.moveaxis(array, axis, 0)
    head, tail = moved[:offset], moved[offset:]
    rest = tail.shape[1:]
    tail = tail.reshape(-1, k_heads, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(np.concatenate([head, tail]), 0, axis))
