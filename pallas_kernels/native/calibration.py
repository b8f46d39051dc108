"""Times each native kernel's call classes (``pallas_kernels.cpu_choice``) against XLA's
formulation on this CPU, once per machine and build, and sets the verdicts the ops follow.

The timings are cached as JSON beside the built libraries, keyed by the libraries (their
sources, flags and instruction set), jaxlib, the CPU model, the core count and ``XLA_FLAGS``, so
a warm start reads them at once; the log names each choice with both timings. The shapes are
SmolLM2-135M's (the default model); a call class's verdict holds for its size class.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from jax_llm_runtime.pallas_kernels import cpu_choice, native
from jax_llm_runtime.pallas_kernels.dequant_matmul import native as native_dequant
from jax_llm_runtime.pallas_kernels.dequant_matmul import reference as dequant_reference
from jax_llm_runtime.pallas_kernels.dequant_matmul.gguf_blocks import from_gguf
from jax_llm_runtime.pallas_kernels.paged_attention import native as native_attention
from jax_llm_runtime.pallas_kernels.paged_attention import reference as attention_reference

logger = logging.getLogger(__name__)
_lock = threading.Lock()


def calibrate() -> dict[str, dict[str, dict[str, float]]]:
    """Time each built kernel's call classes against XLA (or read the cached timings), set the
    verdicts ``cpu_choice.native_wins`` answers, log them, and return the timings in milliseconds
    (``{kernel: {call_class: {"native": ms, "xla": ms}}}``). Kernels that are not built (no
    compiler, ``RUNTIME_NATIVE_KERNELS=0``) are left out: XLA runs them anyway."""
    with _lock:
        built = {
            "dequant_matmul": native_dequant.available(),
            "paged_attention": native_attention.available(),
        }
        kernels = [k for k, ok in built.items() if ok]
        if not kernels:
            return {}
        path = _cache_path(kernels)
        timings = _read(path, kernels)
        if timings is None:
            timings = {k: _MEASURES[k]() for k in kernels}
            _write(path, timings)
        cpu_choice.set_verdicts(
            {
                (kernel, call_class): ms["native"] <= ms["xla"]
                for kernel, classes in timings.items()
                for call_class, ms in classes.items()
            }
        )
        logger.info("native CPU kernels built for %s; %s", native.cpu_isa().name, _summary(timings))
        return timings


def _summary(timings: dict[str, dict[str, dict[str, float]]]) -> str:
    parts = []
    for kernel, classes in timings.items():
        for call_class, ms in classes.items():
            pick = "native" if ms["native"] <= ms["xla"] else "XLA"
            parts.append(
                f"{kernel} {call_class}: {pick} (native {ms['native']:.3g} ms, "
                f"XLA {ms['xla']:.3g} ms)"
            )
    return "; ".join(parts)


def _cache_path(kernels: list[str]) -> Path:
    import jaxlib

    libraries = sorted(Path(native.library_path(k)).name for k in kernels)
    facts = [
        *libraries,
        jaxlib.__version__,
        native.cpuinfo("model name") or "unknown",
        str(os.cpu_count()),
        os.environ.get("XLA_FLAGS", ""),
        _VERSION,
    ]
    key = hashlib.sha256("\0".join(facts).encode()).hexdigest()[:20]
    return native.cache_dir() / f"choice-{key}.json"


def _read(path: Path, kernels: list[str]) -> dict[str, Any] | None:
    try:
        timings = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    complete = isinstance(timings, dict) and all(
        isinstance(timings.get(k), dict) and set(timings[k]) == set(cpu_choice.KERNELS[k])
        for k in kernels
    )
    return timings if complete else None


def _write(path: Path, timings: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(timings, indent=1))
    os.replace(partial, path)  # atomic: a concurrent start reads the whole file or none


# Bump when the measured shapes change, so cached verdicts are measured again.
_VERSION = "4"


def _ms(native_fn: Callable[..., Any], xla_fn: Callable[..., Any], *args: Any) -> dict[str, float]:
    """Best average milliseconds per call of jitted ``native_fn`` and ``xla_fn`` on ``args``,
    ``{"native": ms, "xla": ms}``: after a warm call each, 7 rounds of each in turn, so that a
    machine whose speed drifts (a shared core, a neighbour's load) times both alike; a run of
    5 rounds of one and then 5 of the other flipped a close verdict between starts."""
    fns = {"native": jax.jit(native_fn), "xla": jax.jit(xla_fn)}
    calls = {}
    for name, fn in fns.items():
        jax.block_until_ready(fn(*args))
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        # Rounds of at least ~10 ms, so a fast kernel is not timed by the clock's resolution.
        calls[name] = max(1, int(0.01 / max(time.perf_counter() - start, 1e-6)))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(7):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                out = fn(*args)
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - start) / calls[name])
    return {name: ms * 1e3 for name, ms in best.items()}


def _gguf_weight(qtype: T, k: int, n: int, rng: np.random.Generator) -> Any:
    """A ``PackedWeight`` [k, n] of random GGUF blocks with small finite scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    halves = 2 if qtype == T.Q4_1 else 1  # d (and Q4_1's min) lead each block as float16
    scales = rng.uniform(-0.01, 0.01, (n, k // block, halves)).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8)
    return from_gguf(raw.reshape(n, -1), qtype, k).to_device()


def _measure_dequant() -> dict[str, dict[str, float]]:
    """SmolLM2-135M's shapes: a Q4_1 MLP projection [576, 1536] at 1 and 8 rows against the
    reference (the projections stay packed either way, so XLA dequantizes them on every call),
    and its Q8_0 LM head [576, 49152] at 16 rows, with float and with int8 activations, against
    a float32 head's dot (what the loader makes of the head where the kernel loses: see
    ``models.checkpoint``)."""
    rng = np.random.default_rng(0)
    projection = _gguf_weight(T.Q4_1, 576, 1536, rng)
    head = _gguf_weight(T.Q8_0, 576, 49152, rng)
    float_head = dequant_reference.dequantize(head)
    out = {}
    for call_class, w, rows in (
        ("one_row", projection, 1),
        ("rows", projection, 8),
        ("large", head, 16),
        ("large_int8", head, 16),
    ):
        x = jnp.asarray(rng.standard_normal((rows, 576)), jnp.float32)
        if call_class.startswith("large"):  # the float head takes the packed one's place
            int8 = call_class == "large_int8"
            out[call_class] = _ms(
                lambda x, w, int8=int8: native_dequant.dequant_matmul(
                    x, w[0], int8_activations=int8
                ),
                lambda x, w: jnp.matmul(x, w[1]),
                x,
                (w, float_head),
            )
        else:
            out[call_class] = _ms(
                native_dequant.dequant_matmul, dequant_reference.dequant_matmul, x, w
            )
    return out


def _measure_attention() -> dict[str, dict[str, float]]:
    """SmolLM2-135M's heads (9 query, 3 KV, 64 wide) over a float32 cache of pages of 16:
    4 sequences decoding at 512 positions, and a 128-token chunk after 384 positions."""
    rng = np.random.default_rng(0)
    pages, page_size, kv_heads, dim = 160, 16, 3, 64
    k_cache = jnp.asarray(rng.standard_normal((1, pages, page_size, kv_heads, dim)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((1, pages, page_size, kv_heads, dim)), jnp.float32)
    layer = jnp.int32(0)
    out = {}
    for call_class, seqs, q_len in (("decode", 4, 1), ("prefill", 1, 128)):
        page_indices = jnp.asarray(rng.permutation(pages)[: seqs * 32].reshape(seqs, 32), jnp.int32)
        q = jnp.asarray(rng.standard_normal((seqs, q_len, 9, dim)), jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(512 - q_len, 512, dtype=jnp.int32), (seqs, q_len))
        kv_lens = jnp.full((seqs,), 512, jnp.int32)
        args = (q, k_cache, v_cache, layer, positions, page_indices, kv_lens)

        def run(impl: Any) -> Callable[..., Any]:
            return lambda *a: impl(*a, scale=0.125)

        out[call_class] = _ms(
            run(native_attention.paged_attention), run(attention_reference.paged_attention), *args
        )
    return out


_MEASURES = {"dequant_matmul": _measure_dequant, "paged_attention": _measure_attention}
