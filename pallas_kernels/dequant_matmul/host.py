"""Host-side operations on ``HostPacked`` weights while a checkpoint loads.

- ``dequantize_host``: float32 values (numpy) for a packed tensor that lands in a float field;
- ``split_out``: a fused projection (``qkv_proj``) cut along its output axis;
- ``stack``: per-layer (per-expert) weights stacked into one, even when their types differ.

GGUF files mix types inside one field (a ``Q4_K_M`` file keeps some layers' ``ffn_down`` in Q6_K).
``stack`` gives such layers one common form: the widest code width, every group array the finest
group, and neutral factors where a type lacks one (``sc = 1``, ``mn = 0``, ``m = 1`` or ``0``), so
every layer still dequantizes bit-exactly. The price is memory for the mixed fields only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import HostPacked, evaluate


def dequantize_host(hp: HostPacked) -> np.ndarray:  # float32 [..., in, out]
    """The same float32 arithmetic as ``reference.dequantize``, in numpy."""
    constant = isinstance(hp.z, int)
    z, zero = (None, hp.z) if constant else (hp.z, 0)
    return evaluate(np, hp.codes.astype(np.int32), hp.d, hp.sc, z, zero, hp.mn, hp.m, hp.codebook)


def split_out(hp: HostPacked, sizes: Sequence[int]) -> list[HostPacked]:
    """Cut ``[..., in, out]`` into pieces of ``sizes`` output channels."""
    if sum(sizes) != hp.codes.shape[-1]:
        raise ValueError(f"cannot split {hp.codes.shape[-1]} output channels into {list(sizes)}")
    cuts = np.cumsum(sizes)[:-1]
    pieces = []
    for i in range(len(sizes)):

        def piece(a: np.ndarray, i: int = i) -> np.ndarray:
            if a.shape[-1] == 1:  # a [..., 1, 1] zero code broadcasts over out
                return a
            return np.ascontiguousarray(np.split(a, cuts, axis=-1)[i])

        pieces.append(hp.map(piece))
    return pieces


def _common(items: Sequence[HostPacked], name: str, neutral: int) -> np.ndarray | None:
    """The items' group arrays ``name`` at the finest group count, stacked (``neutral`` where an
    item lacks it), or None if none has it."""
    arrays = [getattr(hp, name) for hp in items]
    if all(a is None for a in arrays):
        return None
    groups = max(a.shape[-2] for a in arrays if a is not None)
    dtype = next(a.dtype for a in arrays if a is not None)
    out = []
    for hp, a in zip(items, arrays, strict=True):
        if a is None:
            a = np.full((*hp.codes.shape[:-2], groups, hp.codes.shape[-1]), neutral, dtype)
        out.append(np.repeat(a, groups // a.shape[-2], axis=-2).astype(dtype))
    return np.stack(out)


def _zeros(items: Sequence[HostPacked]) -> np.ndarray | int:
    """One constant zero code if all items share it, else a stacked array (``[..., 1, 1]`` per
    item when every item has a constant, its finest groups otherwise)."""
    if all(isinstance(hp.z, int) for hp in items) and len({hp.z for hp in items}) == 1:
        return items[0].z
    arrays = [
        np.full((*hp.codes.shape[:-2], 1, 1), hp.z, np.uint8) if isinstance(hp.z, int) else hp.z
        for hp in items
    ]
    if all(a.shape[-2:] == (1, 1) for a in arrays):
        return np.stack(arrays)
    n = items[0].codes.shape[-1]
    groups = max(a.shape[-2] for a in arrays)
    return np.stack(
        [
            np.repeat(np.broadcast_to(a, (*a.shape[:-1], n)), groups // a.shape[-2], axis=-2)
            for a in arrays
        ]
    )


def stack(items: Sequence[HostPacked]) -> HostPacked:
    """Stack weights of one shape on a new leading axis, giving mixed types one common form."""
    shapes = {hp.codes.shape for hp in items}
    if len(shapes) != 1:
        raise ValueError(f"cannot stack packed weights of shapes {sorted(shapes)}")
    codebooks = {hp.codebook for hp in items}
    if len(codebooks) != 1:
        raise ValueError(f"cannot stack packed weights of different codebooks {codebooks}")
    if None not in codebooks:  # one format throughout: nothing to reconcile
        return HostPacked(
            codes=np.stack([hp.codes for hp in items]), bits=items[0].bits,
            d=np.stack([hp.d for hp in items]), codebook=items[0].codebook,
        )  # fmt: skip
    # Where another item has a sub-block minimum, an item whose minimum is the block value alone
    # (Q4_1) multiplies it by m = 1; an item with no minimum at all gets mn = 0 and m = 0.
    if any(hp.m is not None for hp in items):
        items = [
            replace(hp, m=np.ones(hp.mn.shape, np.uint8))
            if hp.m is None and hp.mn is not None
            else hp
            for hp in items
        ]
    return HostPacked(
        codes=np.stack([hp.codes for hp in items]),
        bits=max(hp.bits for hp in items),
        d=_common(items, "d", 0),
        sc=_common(items, "sc", 1),
        z=_zeros(items),
        mn=_common(items, "mn", 0),
        m=_common(items, "m", 0),
    )
