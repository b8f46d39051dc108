"""Write an in-situ-quantized model as a GGUF file that llama.cpp loads.

    .venv/bin/python tools/quantize_gguf.py SRC.gguf DST.gguf --type q4k

The layers' projections are re-quantized to ``--type`` exactly as ``runtime-serve --isq`` does
(llama.cpp's quantizer bytes and fallbacks); everything else is copied. For an HF folder, convert
it to an F32/F16 GGUF with llama.cpp's ``convert_hf_to_gguf.py`` first.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from jax_llm_runtime.runtime.loading.gguf.quantize import FILE_TYPES, requantize_gguf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a GGUF file")
    parser.add_argument("target", type=Path, help="the GGUF file to write (must not exist)")
    parser.add_argument("--type", required=True, choices=FILE_TYPES, help="block type")
    args = parser.parse_args()
    if not args.source.is_file():
        print(f"quantize_gguf: {args.source} is not a file", file=sys.stderr)
        return 2
    try:
        report = requantize_gguf(args.source, args.target, args.type)
    except ValueError as e:
        print(f"quantize_gguf: {e}", file=sys.stderr)
        return 2
    counts = Counter(t.qtype.name for t in report if t.requantized)
    kept = sum(not t.requantized for t in report)
    summary = ", ".join(f"{n} {name}" for name, n in counts.most_common())
    print(f"wrote {args.target}: {summary} projections; {kept} other tensors copied")
    return 0


if __name__ == "__main__":
    sys.exit(main())
