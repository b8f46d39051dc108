"""One jitted model step (decode or prefill) for several weight formats, timed interleaved in one
process.

Single-stream decode on a bandwidth-bound device is the step's weight bytes; this isolates the
step from the server (no HTTP, scheduling or sampling) so that formats compare on equal terms.
The formats (each with every `--kv-cache-dtypes` cache) are timed in turn, round after round,
so machine noise hits all of them alike; the best and median round per format are printed,
with the ratio to the first format. The KV cache is donated to each step, as the server does.

    .venv/bin/python tools/bench_decode_step.py --formats packed,packed-bf16 --num-seqs 1,16 \
        --prefill 128,512 --mixed 15+49,15+241

``--mixed D+P`` times a mixed step (the scheduler's, ``runtime.engine.scheduler``): ``D``
sequences decoding one token each at ``--context`` plus one prompt chunk of ``P`` tokens, one
ragged run of exactly ``D + P`` tokens.

``float`` dequantizes a quantized checkpoint to float32 at load; ``packed`` keeps its quantized
tensors packed (what runtime-serve does); any ``--isq`` type re-quantizes the projections. A
``-bf16`` suffix multiplies the quantized projections with bfloat16 operands
(``--matmul-dtype bfloat16``), an ``-i8`` suffix with int8 activations (``--matmul-dtype int8``). ``--native on`` (the default: what runtime-serve does on one CPU
device) lets the native CPU kernels run where calibration measured them faster, ``off`` keeps the XLA formulations
(``RUNTIME_NATIVE_KERNELS=0`` does the same to a server), and ``both`` times every format both
ways, the native one as ``<format>+native``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.models.registry import model_config_from_hf
from jax_llm_runtime.pallas_kernels.dequant_matmul import ops as dequant_ops
from jax_llm_runtime.pallas_kernels.native import calibration
from jax_llm_runtime.pallas_kernels.paged_attention import KVCache
from jax_llm_runtime.pallas_kernels.paged_attention import ops as attention_ops
from jax_llm_runtime.runtime.config import ISQ_CHOICES
from jax_llm_runtime.runtime.loading.builder import load_checkpoint, resolve_dtype
from jax_llm_runtime.runtime.loading.sources import resolve_model_source

PAGE_SIZE = 16
OPERANDS = {"-bf16": "bfloat16", "-i8": "int8"}  # format suffix -> operand_dtype


def _kind(name: str) -> str:
    """A format's weights: its name without the operand suffix."""
    for suffix in OPERANDS:
        name = name.removesuffix(suffix)
    return name


def _timed(fn, rounds: int, calls: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn()
        jax.block_until_ready(result)
        out.append((time.perf_counter() - start) / calls * 1e3)
    return out


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default="smollm2-135m-instruct")
    parser.add_argument("--formats", default="float,packed,int8")
    parser.add_argument("--num-seqs", default="1,16", help="comma-separated decode batch sizes")
    parser.add_argument(
        "--prefill", default="", help="comma-separated prompt lengths of one-sequence prefills"
    )
    parser.add_argument(
        "--mixed",
        default="",
        help="comma-separated D+P[@S]: D decoding sequences and one P-token prompt chunk (from "
        "position S, default 0) in one step",
    )
    parser.add_argument(
        "--context", type=int, default=128, help="KV positions per decoding sequence"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--kv-cache-dtypes",
        default="",
        help="KV cache dtypes to time each format with, e.g. float32,float16 (a +kv-<dtype> "
        "suffix on each when more than one); default: --dtype",
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--native", choices=("on", "off", "both"), default="on")
    parser.add_argument(
        "--pallas",
        action="store_true",
        help="run the Pallas attention and dequant-matmul kernels on this backend where the "
        "runtime would not choose them yet (an accelerator before its kernels are enabled)",
    )
    parser.add_argument(
        "--unroll-layers",
        choices=("auto", "on", "off", "both"),
        default="auto",
        help="walk the layers unrolled over one array per layer (on), under lax.scan (off), or "
        "as the runtime does on this backend (auto: the scan); both times each format both ways",
    )
    parser.add_argument(
        "--trace",
        default="",
        help="folder: after timing, trace 3 calls of each step with jax.profiler and print where "
        "the device time goes (tools/trace_summary.py), one TRACE line of JSON per step",
    )
    return parser.parse_args()


def _load_models(args: argparse.Namespace, formats: list[str]) -> tuple[Any, Any, Any, dict]:
    """The spec, config and dtype, and per format (and native setting) a config and weights."""
    checkpoint = load_checkpoint(resolve_model_source(args.model_id, None))
    spec, base = model_config_from_hf(checkpoint.config)
    dtype = resolve_dtype(args.dtype)
    natives = {"on": (True,), "off": (False,), "both": (False, True)}[args.native]
    if jax.default_backend() != "cpu":  # the native kernels are XLA:CPU handlers
        natives = (False,)
    if True in natives:  # as runtime-serve: each call class on the path measured faster here
        calibration.calibrate()
    models = {}
    for name in formats:
        kind = _kind(name)
        config = dataclasses.replace(
            base,
            quantization=None if kind in ("float", "packed") else kind,
            operand_dtype=OPERANDS.get(name[len(kind) :]),
        )
        for native in natives:
            # Loaded per setting: where native kernels run, a quantized LM head stays packed.
            config = dataclasses.replace(config, native_kernels=native)
            tensors = checkpoint.tensors(packed=kind != "float")
            label = f"{name}+native" if native and args.native == "both" else name
            weights = spec.load(config, tensors, dtype, checkpoint.num_tensors)
            unrolls = {"auto": (None,), "on": (True,), "off": (False,), "both": (False, True)}
            for unroll in unrolls[args.unroll_layers]:
                tag = "+unrolled" if unroll and args.unroll_layers == "both" else ""
                unrolled = dataclasses.replace(config, unroll_layers=unroll)
                # As the engine holds them: one array per layer where the loop is unrolled.
                held = weights.per_layer() if unroll else weights
                kv_dtypes = [d for d in args.kv_cache_dtypes.split(",") if d] or [None]
                for kv in kv_dtypes:
                    kv_tag = f"+kv-{kv}" if len(kv_dtypes) > 1 else ""
                    models[label + tag + kv_tag] = (unrolled, held, kv)
    return spec, base, dtype, models


def _compiled_steps(
    spec: Any, models: dict, batch: Any, cache_of: Any, what: str = ""
) -> dict[str, Any]:
    """Per model, a warmed-up call of its jitted step on ``batch`` (each with its own cache,
    ``cache_of(kv_dtype)``); prints how long each first call (the compile) took."""
    steps = {}
    for name, (config, weights, kv_dtype) in models.items():
        cache = cache_of(kv_dtype)
        step = jax.jit(
            lambda w, c, config=config, batch=batch: spec.forward(config, w, c, batch),
            donate_argnums=(1,),
        )
        state = {"cache": cache}

        def run(step=step, weights=weights, state=state):
            logits, state["cache"] = step(weights, state["cache"])
            return logits

        start = time.perf_counter()
        jax.block_until_ready(run())
        print(f"  {what} {name:>15}: first call {time.perf_counter() - start:.1f} s", flush=True)
        steps[name] = run
    return steps


def _batches(args: argparse.Namespace) -> list[tuple[str, StepBatch, int, int]]:
    """(label, batch, pages of its cache, calls per timing) of every requested step."""
    out = []
    shapes = [(int(n), 1, args.context) for n in args.num_seqs.split(",") if n]
    shapes += [(1, int(q), 0) for q in args.prefill.split(",") if q]
    for num_seqs, q_len, context in shapes:
        pages = -(-(context + q_len) // PAGE_SIZE)
        batch = StepBatch.padded(
            tokens=np.ones((num_seqs, q_len), np.int32),
            positions=np.tile(np.arange(context, context + q_len, dtype=np.int32), (num_seqs, 1)),
            q_lens=np.full((num_seqs,), q_len, np.int32),
            kv_lens=np.full((num_seqs,), context + q_len, np.int32),
            page_indices=np.arange(num_seqs * pages, dtype=np.int32).reshape(num_seqs, pages),
        )
        what = f"decode {num_seqs:>3} seqs" if q_len == 1 else f"prefill {q_len:>4} tokens"
        out.append((what, batch, num_seqs * pages, 5 if q_len == 1 else 2))
    for spec in (m for m in args.mixed.split(",") if m):
        counts, _, offset = spec.partition("@")
        decodes, prompt = (int(n) for n in counts.split("+"))
        batch, num_pages = _mixed_batch(decodes, prompt, args.context, int(offset or 0))
        out.append((f"mixed {spec:<9}", batch, num_pages, 2))
    return out


def _mixed_batch(decodes: int, prompt: int, context: int, offset: int = 0) -> tuple[StepBatch, int]:
    """``decodes`` sequences with one token at ``context`` and a ``prompt``-token chunk from
    position ``offset`` (the chunk attends over the ``offset`` positions before it too)."""
    pages = -(-(max(context + 1, offset + prompt)) // PAGE_SIZE)
    lengths = [1] * decodes + [prompt]
    chunk = np.arange(offset, offset + prompt)
    positions = np.concatenate([np.full(decodes, context), chunk]).astype(np.int32)
    q_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    num_seqs, num_tokens = decodes + 1, decodes + prompt
    batch = StepBatch(
        tokens=np.ones(num_tokens, np.int32),
        positions=positions,
        seq_ids=np.repeat(np.arange(num_seqs), lengths).astype(np.int32),
        valid=np.ones(num_tokens, bool),
        q_starts=q_starts,
        kv_lens=np.asarray([context + 1] * decodes + [offset + prompt], np.int32),
        page_indices=np.arange(num_seqs * pages, dtype=np.int32).reshape(num_seqs, pages),
        last_rows=(q_starts[1:] - 1).astype(np.int32),
    )
    return batch, num_seqs * pages


def main() -> int:
    args = _parse_args()
    if args.pallas:
        backend = jax.default_backend()
        for ops in (attention_ops, dequant_ops):
            ops.KERNEL_BACKENDS = (*ops.KERNEL_BACKENDS, backend)
    formats = args.formats.split(",")
    for name in formats:
        if _kind(name) not in ("float", "packed", *ISQ_CHOICES):
            print(f"bench_decode_step: unknown format {name!r}", file=sys.stderr)
            return 2
    spec, base, dtype, models = _load_models(args, formats)
    kernels = " with the Pallas kernels" if args.pallas else ""
    print(f"{args.model_id}: step ms ({jax.default_backend()}{kernels})")
    for what, batch, num_pages, reps in _batches(args):
        k_shape, v_shape = base.cache_shapes(num_pages, PAGE_SIZE)
        steps = _compiled_steps(
            spec,
            models,
            batch,
            lambda kv, k=k_shape, v=v_shape: KVCache.zeros(k, kv or dtype, v),
            what,
        )
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, run in steps.items():
                times[name] += _timed(run, 1, reps)
        first = min(times[next(iter(times))])
        for name, ms in times.items():
            best, median = min(ms), statistics.median(ms)
            print(
                f"  {what} {name:>15}: best {best:8.3f}  median {median:8.3f}  "
                f"({first / best:.2f}x the speed of {next(iter(times))})"
            )
        if args.trace:
            _trace(args.trace, what, steps)
    return 0


def _trace(folder: str, what: str, steps: dict[str, Any], calls: int = 3) -> None:
    """Trace ``calls`` calls of each step and print their summary (``TRACE {json}``)."""
    import json
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trace_summary import summarize

    for name, run in steps.items():
        label = "-".join(f"{what} {name}".split()).replace("+", "_")
        out = Path(folder) / label
        with jax.profiler.trace(str(out), create_perfetto_trace=True):
            for _ in range(calls):
                result = run()
            jax.block_until_ready(result)
        summary = summarize(out, top=12, calls=calls)
        print("TRACE " + json.dumps({"step": f"{what} {name}".strip(), **summary}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
