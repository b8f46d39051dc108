"""GPTQ and AWQ checkpoints in HF folders: ``quantization_config`` and the tensors of each
quantized linear.

A quantized linear ``<prefix>`` stores ``<prefix>.qweight``, ``.qzeros``, ``.scales`` (and GPTQ's
``.g_idx``) instead of ``<prefix>.weight``; ``runtime.loading.hf_loader`` yields them as one item,
``(<prefix>.weight, HostPacked)``, in the ``[in, out]`` orientation (the layout of
``pallas_kernels.dequant_matmul.gptq``). Supported: 4 bits (GPTQ also 8), any group size that divides the
input features (or -1); GPTQ in checkpoint formats "gptq" (v1) and "gptq_v2", symmetric or not,
with ``g_idx`` in input order (``desc_act=False``, or act-order with static groups); AWQ with
GEMM packing and zero points. ``desc_act`` itself is not checked: ``g_idx`` is what tells.

Marlin-layout folders (``pallas_kernels.dequant_matmul.marlin``) load to the same ``HostPacked``
as their GPTQ originals: ``quant_method`` "gptq" with ``checkpoint_format`` "marlin" (or AutoGPTQ's
older ``is_marlin_format``), as candle-vllm, AutoGPTQ and the hub's ``*-GPTQ-Marlin`` folders
write it, or vLLM's ``quant_method`` "marlin"; each linear stores ``B`` and ``s`` (and sometimes a
``workspace``, which is scratch memory and ignored). Marlin holds symmetric 4-bit weights only.

MXFP4 folders (``quant_method`` "mxfp4", gpt-oss) store each quantized expert stack ``<prefix>`` as
``<prefix>_blocks`` and ``<prefix>_scales`` (``pallas_kernels.dequant_matmul.mxfp4``); it comes out
as ``(<prefix>, HostPacked)``, under the name its float tensor has.

candle-vllm's ``convert_awq_marlin.py`` keeps an AWQ folder's config and rewrites only its
``qzeros``, in Marlin's column order, so nothing but the zero points tells the two apart: an AWQ
linear whose zeros differ between the two readings takes the one under which the groups' zeros
sit nearer the mean of their codes (weights centre on zero, so the codes centre on the zero
point), and a reading that does not win clearly is an error rather than a guess.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import HostPacked
from jax_llm_runtime.pallas_kernels.dequant_matmul.gptq import (
    BITS,
    GPTQ_BITS,
    GPTQ_FORMATS,
    from_awq,
    from_gptq,
)
from jax_llm_runtime.pallas_kernels.dequant_matmul.marlin import awq_zeros_from_marlin, from_marlin
from jax_llm_runtime.pallas_kernels.dequant_matmul.mxfp4 import from_mxfp4

METHODS = ("gptq", "awq", "marlin", "mxfp4")
PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "marlin": ("B", "s", "workspace"),
    "mxfp4": ("blocks", "scales"),
}
REQUIRED = {"gptq": ("qweight", "qzeros", "scales"), "marlin": ("B", "s")}
REQUIRED["awq"] = REQUIRED["gptq"]
REQUIRED["mxfp4"] = PARTS["mxfp4"]
# How clearly one reading of an AWQ linear's zeros must win (standard deviations of a sign test;
# a real layer scores in the tens or hundreds, a tiny test layer about 5).
MARLIN_ZEROS_SCORE = 4.0


@dataclass(frozen=True)
class QuantConfig:
    """What the loader needs of a checkpoint's ``quantization_config``."""

    method: str  # "gptq" | "awq" | "marlin" (GPTQ in Marlin's layout)
    bits: int
    group_size: int  # -1: one group over all input features
    sym: bool = True  # GPTQ: every zero is 2 ** (bits - 1)
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" (v1, zeros stored minus one) or "gptq_v2"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"quant_method {self.method!r} is not supported ({', '.join(METHODS)} are)"
            )
        widths = GPTQ_BITS if self.method == "gptq" else (BITS,)  # MXFP4: 4 too
        if self.method == "marlin" and not self.sym:
            raise ValueError("Marlin with sym=False is not supported (Marlin is symmetric)")
        if self.bits not in widths:
            raise ValueError(
                f"{self.method} with bits={self.bits} is not supported "
                f"(only {' and '.join(map(str, widths))} {'are' if len(widths) > 1 else 'is'})"
            )
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be positive or -1, got {self.group_size}")
        if self.method == "gptq" and self.checkpoint_format not in GPTQ_FORMATS:
            raise ValueError(
                f"GPTQ checkpoint_format {self.checkpoint_format!r} is not supported "
                f"({', '.join(GPTQ_FORMATS)} are)"
            )

    @property
    def parts(self) -> tuple[str, ...]:
        """Tensor-name suffixes of one quantized linear."""
        return PARTS[self.method]

    @property
    def required(self) -> tuple[str, ...]:
        """The parts every quantized linear has; the first names the linear."""
        return REQUIRED[self.method]

    @property
    def separator(self) -> str:
        """What joins a linear's prefix and its parts' names (``<prefix>_blocks`` in MXFP4)."""
        return "_" if self.method == "mxfp4" else "."

    def item_name(self, prefix: str) -> str:
        """The name a quantized linear is loaded under: its float tensor's name."""
        return prefix if self.method == "mxfp4" else f"{prefix}.weight"

    @property
    def float_transposed(self) -> bool:
        """Whether the float tensor a linear stands for is ``[..., out, in]`` (a torch linear's
        weight) rather than ``[..., in, out]`` (gpt-oss's expert stacks)."""
        return self.method != "mxfp4"

    def host_packed(self, tensors: Mapping[str, np.ndarray]) -> HostPacked:
        """One linear's tensors (keyed by part) as ``HostPacked`` ``[in, out]``."""
        if self.method == "mxfp4":
            return from_mxfp4(tensors["blocks"], tensors["scales"])
        if self.method == "marlin":
            return from_marlin(tensors["B"], tensors["s"], group_size=self.group_size)
        if self.method == "awq":
            return _awq(tensors, self.bits, self.group_size)
        return from_gptq(
            tensors["qweight"],
            tensors["qzeros"],
            tensors["scales"],
            tensors.get("g_idx"),
            bits=self.bits,
            group_size=self.group_size,
            sym=self.sym,
            checkpoint_format=self.checkpoint_format,
        )


def quant_config_from_hf(config: Mapping[str, Any]) -> QuantConfig | None:
    """The ``quantization_config`` of an HF ``config.json`` (None if it has none); ValueError for
    one this runtime cannot load, naming the setting."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError("quantization_config must be a JSON object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        pack_dtype = qc.get("pack_dtype", "int32")
        if pack_dtype != "int32":
            raise ValueError(f"GPTQ pack_dtype {pack_dtype!r} is not supported (only int32 is)")
        # transformers writes both names; the legacy one wins, as there.
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt == "marlin" or qc.get("is_marlin_format"):
            return _marlin_config(qc)
        return QuantConfig(
            method="gptq",
            bits=int(qc.get("bits", 0)),
            group_size=int(qc.get("group_size", 128)),
            sym=bool(qc.get("sym", True)),
            checkpoint_format=fmt,
        )
    if method == "awq":
        if str(qc.get("checkpoint_format", "")).lower() == "marlin":
            raise ValueError(
                "AWQ with checkpoint_format 'marlin' is not supported (Marlin-layout AWQ "
                "weights; candle-vllm's convert_awq_marlin.py output, which keeps AWQ's config, is)"
            )
        version = str(qc.get("version") or qc.get("format") or "gemm").lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only GEMM packing is)")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ with zero_point=False is not supported")
        return QuantConfig(
            method="awq",
            bits=int(qc.get("bits", qc.get("w_bit", 0))),
            group_size=int(qc.get("group_size", qc.get("q_group_size", 128))),
        )
    if method == "marlin":
        return _marlin_config(qc)
    if method == "mxfp4":
        return QuantConfig(method="mxfp4", bits=BITS, group_size=32)
    raise ValueError(f"quant_method {method!r} is not supported ({', '.join(METHODS)} are)")


def _marlin_config(qc: Mapping[str, Any]) -> QuantConfig:
    bits = int(qc.get("bits", BITS))
    if bits != BITS:
        raise ValueError(f"Marlin with bits={bits} is not supported (Marlin holds 4-bit weights)")
    if qc.get("desc_act"):
        raise ValueError(
            "Marlin with desc_act=True is not supported; use a checkpoint quantized with "
            "desc_act=False"
        )
    return QuantConfig(
        method="marlin",
        bits=bits,
        group_size=int(qc.get("group_size", 128)),
        sym=bool(qc.get("sym", True)),
    )


def _awq(tensors: Mapping[str, np.ndarray], bits: int, group_size: int) -> HostPacked:
    """An AWQ linear, its ``qzeros`` read in AutoAWQ's order or in Marlin's (see the module)."""
    plain = from_awq(
        tensors["qweight"], tensors["qzeros"], tensors["scales"], bits=bits, group_size=group_size
    )
    if plain.z.shape[1] % 64:  # Marlin needs out in runs of 64: these zeros are AutoAWQ's
        return plain
    marlin = replace(plain, z=awq_zeros_from_marlin(tensors["qzeros"]))
    if np.array_equal(plain.z, marlin.z):
        return plain
    # A sign test over the (group, column) cells whose zero differs between the readings: in
    # how many is this reading's zero the nearer to the mean of the cell's codes?
    groups, n = plain.z.shape
    sums = plain.codes.reshape(groups, -1, n).sum(axis=1, dtype=np.uint32)
    centres = sums / (plain.codes.shape[0] // groups)
    off_plain, off_marlin = np.abs(centres - plain.z), np.abs(centres - marlin.z)
    differ = off_plain != off_marlin
    cells = int(differ.sum())
    plain_nearer = int((off_plain < off_marlin)[differ].sum())
    score = (2 * plain_nearer - cells) / max(np.sqrt(cells), 1.0)  # ~N(0, 1) without a signal
    if score >= MARLIN_ZEROS_SCORE:
        return plain
    if score <= -MARLIN_ZEROS_SCORE:
        return marlin
    raise ValueError(
        "cannot tell whether qzeros are in AutoAWQ's order or in Marlin's (candle-vllm's "
        f"convert_awq_marlin.py): AutoAWQ's order fits {plain_nearer} of the {cells} groups whose "
        "zero differs between the two; load the AWQ folder from before that conversion"
    )


def quantized_linears(keys: Iterable[str], quant: QuantConfig | None) -> dict[str, tuple[str, ...]]:
    """``prefix -> parts present`` for every quantized linear among ``keys``.

    ValueError for a linear that lacks a required part, a part without its ``qweight`` (Marlin:
    ``B``), Marlin tensors under a GPTQ/AWQ config that does not say so, and quantized tensors in
    a checkpoint whose config declares no quantization.
    """
    keys = set(keys)
    if quant is None:
        stray = sorted(k for k in keys if k.endswith(".qweight"))
        if stray:
            raise ValueError(
                f"{stray[0]} is a GPTQ/AWQ tensor, but config.json has no quantization_config"
            )
        return {}
    head = quant.required[0]
    if quant.method != "marlin":
        marlin = sorted(k for k in keys if k.endswith(".B") and f"{k[:-2]}.s" in keys)
        if marlin:
            raise ValueError(
                f"{marlin[0]} is a Marlin-layout tensor, but quantization_config says "
                f"{quant.method} without checkpoint_format 'marlin'"
            )
    linears: dict[str, tuple[str, ...]] = {}
    sep = quant.separator
    for key in sorted(keys):
        prefix, _, part = key.rpartition(sep)
        if part not in quant.parts:
            continue
        if f"{prefix}{sep}{head}" not in keys:
            raise ValueError(f"checkpoint has {key} but no {prefix}{sep}{head}")
        linears[prefix] = (*linears.get(prefix, ()), part)
    for prefix, parts in linears.items():
        missing = [p for p in quant.required if p not in parts]
        if missing:
            raise ValueError(f"checkpoint has {prefix}{sep}{head} but no {prefix}{sep}{missing[0]}")
    return linears
