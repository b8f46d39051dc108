"""Pallas dequant-matmul: ``x @ dequantize(w)`` with the weight dequantized tile by tile on-chip.

1. The grid is ``(token tile, out tile)``; each program owns a ``[block_m, block_n]`` tile of the
   float32 output and keeps its accumulator in registers.
2. It walks ``in`` in ``block_k`` steps. ``block_k`` is a power of two of whole 32-code runs, so
   each step's bytes of every bit plane unpack on their own (``formats.unpack_planes``); every
   group array is a multiple or a divisor of ``block_k`` long, so a step loads either one row of
   it or ``block_k // group`` whole rows.
3. The step's tile goes through ``reference.dequantize`` itself, so the kernel and the reference
   evaluate the same float32 formula, and is multiplied into the accumulator: float32 ``x`` at
   IEEE float32 precision, bfloat16/float16 ``x`` with the tile cast to its dtype (tensor cores)
   and float32 accumulation.
4. Shapes are never padded on the weight side (that would copy the weight on every call): only
   ``x`` is padded to whole token tiles, ``block_n`` is the largest power of two that divides
   ``out``, and when ``out`` has no such divisor of at least 16 (an odd vocabulary) the last
   ``out % 16`` columns go through the reference on a slice of that width (at the tiles'
   precision).

The float weight only ever exists as one ``[block_k, block_n]`` tile per program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_llm_runtime.pallas_kernels.dequant_matmul import reference, tuning
from jax_llm_runtime.pallas_kernels.dequant_matmul.formats import PLANES, RUN, PackedWeight

_GROUP_FIELDS = ("d", "sc", "z", "mn", "m")
_X_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_MIN_BLOCK = 16  # Triton's smallest matmul dimension


@dataclasses.dataclass(frozen=True)
class _Group:
    """How one group array is read per ``block_k`` step."""

    name: str  # a field of PackedWeight
    group: int  # input features per row; 0 for a [1, 1] array (one value for the whole matrix)
    rows: int  # rows loaded per step: 1 when group >= block_k, else block_k // group


@dataclasses.dataclass(frozen=True)
class _Plan:
    config: tuning.BlockConfig  # as given; the fitted block sizes below override its own
    block_m: int
    block_n: int
    block_k: int
    padded_tokens: int  # num_tokens rounded up to whole token tiles
    kernel_out: int  # output features the kernel computes, a multiple of block_n
    groups: tuple[_Group, ...]


def _group_arrays(w: PackedWeight) -> list[tuple[str, jax.Array]]:
    return [(f, getattr(w, f)) for f in _GROUP_FIELDS if getattr(w, f) is not None]


def _is_whole(name: str, a: jax.Array) -> bool:
    """A ``[1, 1]`` zero code: one value for the whole matrix, not a group array."""
    return name == "z" and a.shape == (1, 1)


def _validate(x: jax.Array, w: PackedWeight) -> None:
    if w.codebook is not None:
        raise ValueError(f"the Pallas kernel does not read {w.codebook} codes; use the reference")
    if w.bits not in PLANES:
        raise ValueError(f"bits must be one of {sorted(PLANES)}, got {w.bits}")
    if len(w.planes) != len(PLANES[w.bits]):
        raise ValueError(
            f"a {w.bits}-bit weight has {len(PLANES[w.bits])} bit planes, got {len(w.planes)}"
        )
    if x.ndim != 2:
        raise ValueError(f"x must be [num_tokens, in], got shape {x.shape}")
    if w.planes[0].ndim != 2:
        raise ValueError(
            f"the weight must be one [in, out] matrix, got shape {w.shape}; index its stacked "
            "(layer or expert) axes before the matmul"
        )
    reference._validate(x, w)
    if x.dtype not in _X_DTYPES:
        raise ValueError(
            f"x must be one of {[jnp.dtype(d).name for d in _X_DTYPES]}, got {x.dtype}"
        )
    k, n = w.shape
    if k % RUN:
        raise ValueError(f"the in dimension ({k}) must be a multiple of {RUN}")
    for plane, b in zip(w.planes, PLANES[w.bits], strict=True):
        if plane.shape != (k * b // 8, n):
            raise ValueError(f"a {b}-bit plane must be {[k * b // 8, n]}, got {list(plane.shape)}")
    _validate_groups(w)


def _validate_groups(w: PackedWeight) -> None:
    k, n = w.shape
    for name, a in _group_arrays(w):
        if _is_whole(name, a):
            continue
        if a.ndim != 2 or a.shape[1] != n or k % a.shape[0]:
            raise ValueError(f"{name} must be [in // group, {n}], got shape {a.shape}")
        group = k // a.shape[0]
        if group % RUN and RUN % group:
            raise ValueError(
                f"{name} has groups of {group} input features; the kernel needs a multiple or "
                f"a divisor of {RUN} (use impl='reference' for this weight)"
            )


def _fit_block_n(out: int, block_n: int) -> int:
    """The largest power of two <= ``block_n`` that divides ``out``; 16 if none is >= 16."""
    while block_n > _MIN_BLOCK and out % block_n:
        block_n //= 2
    return block_n


def _plan(x: jax.Array, w: PackedWeight, config: tuning.BlockConfig | None) -> _Plan:
    num_tokens = x.shape[0]
    k, n = w.shape
    config = config or tuning.lookup(num_tokens, w.bits)
    block_m = min(config.block_m, max(_MIN_BLOCK, pl.next_power_of_2(num_tokens)))
    block_n = _fit_block_n(n, config.block_n)
    sizes = [k // a.shape[0] for f, a in _group_arrays(w) if not _is_whole(f, a)]
    block_k = config.block_k
    # Validation guarantees that RUN itself fits: it divides k and every group divides or tiles it.
    while block_k > RUN and (k % block_k or any(g % block_k and block_k % g for g in sizes)):
        block_k //= 2
    groups = []
    for f, a in _group_arrays(w):
        if _is_whole(f, a):
            groups.append(_Group(f, 0, 1))
        else:
            g = k // a.shape[0]
            groups.append(_Group(f, g, max(block_k // g, 1)))
    return _Plan(
        config=config,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        padded_tokens=pl.cdiv(num_tokens, block_m) * block_m,
        kernel_out=n - n % block_n,
        groups=tuple(groups),
    )


def _dequant_matmul_kernel(
    x_ref,  # [block_m, in]
    *refs,  # planes: uint8 [in * b // 8, block_n] each; group arrays: [in // group, block_n]
    # (or [1, 1]) in _GROUP_FIELDS order; then o [block_m, block_n] float32
    bits: int,
    zero: int,
    groups: tuple[_Group, ...],
    block_k: int,
    num_steps: int,
):
    num_planes = len(PLANES[bits])
    plane_refs, group_refs, o_ref = refs[:num_planes], refs[num_planes:-1], refs[-1]
    compute_dtype = x_ref.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    def load_group(spec: _Group, ref, step):  # [rows, block_n] or [1, 1]
        if spec.group == 0:
            return ref[...]
        if spec.group >= block_k:
            return ref[pl.ds(lax.div(step, spec.group // block_k), 1), :]
        return ref[pl.ds(pl.multiple_of(step * spec.rows, spec.rows), spec.rows), :]

    def body(step, acc):  # acc: float32 [block_m, block_n]
        x = x_ref[:, pl.ds(pl.multiple_of(step * block_k, block_k), block_k)]
        planes = []
        for ref, b in zip(plane_refs, PLANES[bits], strict=True):
            rows = block_k * b // 8
            planes.append(ref[pl.ds(pl.multiple_of(step * rows, rows), rows), :])
        loaded = {s.name: load_group(s, r, step) for s, r in zip(groups, group_refs, strict=True)}
        tile = PackedWeight(planes=tuple(planes), bits=bits, zero=zero, **loaded)
        w = reference.dequantize(tile)  # float32 [block_k, block_n]
        return acc + jnp.dot(
            x,
            w.astype(compute_dtype),
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    o_ref[...] = lax.fori_loop(0, num_steps, body, acc)


def _compiler_params(config: tuning.BlockConfig, interpret: bool) -> object | None:
    """Triton on GPU: the default Mosaic GPU lowering of ``pallas_call`` has no matmul rule.

    A Mosaic GPU port would be a ``plgpu.kernel`` that copies plane and group tiles into shared
    memory with TMA (``plgpu.copy_gmem_to_smem`` in a software pipeline), unpacks them with
    warpgroup-wide shifts into a bfloat16 shared-memory tile, and multiplies it with
    ``plgpu.wgmma`` (Hopper) or ``tcgen05_mma`` (Blackwell), the design of JAX's
    ``hopper_mixed_type_matmul_mgpu``.
    """
    if interpret or jax.default_backend() != "gpu":
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def _launch(
    x: jax.Array,  # [padded_tokens, in]
    w: PackedWeight,  # [in, out]
    plan: _Plan,
    interpret: bool,
) -> jax.Array:  # [padded_tokens, kernel_out] float32
    """The ``pallas_call``: grid ``(token tile, out tile)`` and its BlockSpecs."""
    k = w.shape[0]
    block_m, block_n, block_k = plan.block_m, plan.block_n, plan.block_k
    columns = lambda rows: pl.BlockSpec((rows, block_n), lambda i, j: (0, j))  # noqa: E731
    group_specs = [
        pl.BlockSpec((1, 1), lambda i, j: (0, 0)) if g.group == 0 else columns(k // g.group)
        for g in plan.groups
    ]
    kernel_body = functools.partial(
        _dequant_matmul_kernel,
        bits=w.bits,
        zero=w.zero,
        groups=plan.groups,
        block_k=block_k,
        num_steps=k // block_k,
    )
    return pl.pallas_call(
        kernel_body,
        grid=(plan.padded_tokens // block_m, plan.kernel_out // block_n),
        in_specs=[
            pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
            *(columns(p.shape[0]) for p in w.planes),
            *group_specs,
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((plan.padded_tokens, plan.kernel_out), jnp.float32),
        compiler_params=_compiler_params(plan.config, interpret),
        interpret=interpret,
        name="dequant_matmul",
    )(x, *w.planes, *(getattr(w, g.name) for g in plan.groups))


def _columns_from(w: PackedWeight, start: int) -> PackedWeight:
    """The weight's output columns ``[start, out)``; a [1, 1] ``z`` stays whole."""

    def cut(a: jax.Array | None) -> jax.Array | None:
        return a if a is None or a.shape == (1, 1) else a[:, start:]

    return w.replace(
        planes=tuple(p[:, start:] for p in w.planes),
        d=cut(w.d),
        sc=cut(w.sc),
        z=cut(w.z),
        mn=cut(w.mn),
        m=cut(w.m),
    )


def dequant_matmul(
    x: jax.Array,  # [num_tokens, in] float32, bfloat16 or float16
    w: PackedWeight,  # [in, out]
    *,
    interpret: bool = False,
    config: tuning.BlockConfig | None = None,
) -> jax.Array:  # [num_tokens, out] float32
    """``x @ dequantize(w)`` as a Pallas kernel; same contract as ``reference.dequant_matmul``.

    float32 ``x`` matches the reference to float32 rounding; bfloat16/float16 ``x`` multiplies
    the dequantized tiles rounded to its dtype, accumulating in float32. Block sizes default to
    ``tuning.lookup`` and shrink to fit the shape; ``interpret=True`` runs the kernel on CPU.
    Raises ``ValueError`` for a stacked weight, mismatched ``in`` dimensions, unsupported bits,
    or group arrays whose groups do not tile 32-code runs.
    """
    _validate(x, w)
    num_tokens = x.shape[0]
    out_features = w.shape[1]
    plan = _plan(x, w, config)
    parts = []
    if plan.kernel_out:
        padded = jnp.pad(x, ((0, plan.padded_tokens - num_tokens), (0, 0)))
        parts.append(_launch(padded, w, plan, interpret)[:num_tokens])
    if plan.kernel_out < out_features:
        # At the tiles' precision: a float32 x multiplies in IEEE float32 here too (XLA's GPU
        # dots would otherwise round float32 operands to TF32, measured on an H200).
        precision = "highest" if x.dtype == jnp.float32 else None
        with jax.default_matmul_precision(precision):
            parts.append(reference.dequant_matmul(x, _columns_from(w, plan.kernel_out)))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
