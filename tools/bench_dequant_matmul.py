"""One native dequant-matmul call per weight shape, against XLA's formulation of the same product.

Each case is a GGUF block type and a weight of ``out`` x ``in`` (random floats quantized by gguf's
own quantizer), multiplied by ``--rows`` rows of x. Ours is ``pallas_kernels.dequant_matmul.native``
(the kernel the CPU runtime calls, built for this CPU or for ``RUNTIME_NATIVE_ISA``); the peer is
``reference.dequant_matmul``, which XLA compiles (the path the runtime falls back to). Both are
jitted in this process and timed interleaved round by round; each row prints the best round of
each in ms, ours in multiply-adds per second, and the ratio (above 1x: ours is faster).

    .venv/bin/python tools/bench_dequant_matmul.py --rows 16 --cases "Q8_0:49152x576,Q4_1:1536x576"

The weights are as large as the model's (the LM head's 30 MB comes from memory every call, as in
a decode step); small ones stay in the caches between calls, which a step does not give them.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import numpy as np
from gguf import GGMLQuantizationType, quants

from jax_llm_runtime.pallas_kernels.dequant_matmul import native, reference
from jax_llm_runtime.pallas_kernels.dequant_matmul.gguf_blocks import from_gguf

# SmolLM2-135M's matrices: the Q8_0 LM head and the Q4_1 projections (out x in).
DEFAULT_CASES = "Q8_0:49152x576,Q4_1:1536x576,Q4_1:576x1536,Q4_1:576x576"
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def parse_cases(text: str) -> list[tuple[str, int, int]]:
    """``TYPE:OUTxIN,...`` as (type, out, in); a ValueError names a bad entry."""
    cases = []
    for entry in text.split(","):
        name, _, shape = entry.strip().partition(":")
        out, _, k = shape.partition("x")
        if name not in QUANTIZABLE or not out.isdigit() or not k.isdigit():
            raise ValueError(
                f"{entry!r}: want TYPE:OUTxIN with TYPE one of {', '.join(QUANTIZABLE)}"
            )
        if int(k) % 32:
            raise ValueError(f"{entry!r}: IN must be a multiple of 32")
        cases.append((name, int(out), int(k)))
    return cases


def best_ms(fn, args, rounds: int, calls: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        out.block_until_ready()
        times.append((time.perf_counter() - start) / calls)
    return 1e3 * min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16", help="comma-separated rows of x")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="TYPE:OUTxIN,... (GGUF types)")
    parser.add_argument(
        "--int8",
        choices=("on", "off"),
        default="on",
        help="int8 activations (the CPU default) or float32",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="calls per round")
    args = parser.parse_args()
    try:
        cases = parse_cases(args.cases)
        rows = [int(r) for r in args.rows.split(",")]
        if min(rows) < 1:
            raise ValueError(f"--rows {args.rows!r}: each must be 1 or more")
    except ValueError as exc:
        print(f"bench_dequant_matmul: {exc}", file=sys.stderr)
        return 2
    if not native.available():
        print("bench_dequant_matmul: the native kernel could not be built here", file=sys.stderr)
        return 1
    int8 = args.int8 == "on"
    ours = jax.jit(functools.partial(native.dequant_matmul, int8_activations=int8))
    peer = jax.jit(functools.partial(reference.dequant_matmul, int8_activations=int8))
    rng = np.random.default_rng(0)
    print(
        f"rows  {'case':22s} {'ours ms':>9s} {'XLA ms':>9s} {'ours GMAC/s':>12s} {'ours/XLA':>9s}"
    )
    for name, out, k in cases:
        qtype = GGMLQuantizationType[name]
        blocks = quants.quantize(rng.standard_normal((out, k)).astype(np.float32), qtype)
        w = from_gguf(blocks, qtype, k).to_device()
        for r in rows:
            x = jax.numpy.asarray(rng.standard_normal((r, k)), jax.numpy.float32)
            a, b = [], []
            for _ in range(2):  # interleaved: ours, XLA, ours, XLA
                a.append(best_ms(ours, (x, w), args.rounds, args.calls))
                b.append(best_ms(peer, (x, w), args.rounds, args.calls))
            mine, theirs = min(a), min(b)
            rate = r * out * k / mine / 1e6
            print(
                f"{r:4d}  {name + ' ' + str(out) + 'x' + str(k):22s} {mine:9.3f} {theirs:9.3f} "
                f"{rate:12.1f} {theirs / mine:8.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
