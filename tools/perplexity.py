"""Perplexity of a model on a fixed text, comparable with llama.cpp's `llama-perplexity`.

The method is llama-perplexity's default one (see runtime/library/perplexity.py): the whole text is
tokenized, cut into chunks of `--ctx-size` tokens (BOS replacing each chunk's first token when
the tokenizer adds one), every chunk is run from an empty context, and only its second half is
scored. The text is the pinned GNU GPL v3 terms (found in numpy's bundled licences or Debian's
/usr/share/common-licenses/GPL-3, checked by SHA-256) unless `--text-file` names another; it is
written to `--write-text` (default: the runtime cache) so llama-perplexity reads the same bytes.

`--model-id`, `--dtype`, `--isq`, `--matmul-dtype` and `--kv-cache-dtype` (a float dtype: the
cache-free forward rounds K and V to it as the paged cache stores them) mean what they mean for
runtime-serve: a GGUF's quantized
tensors stay packed and run as stored, and `--isq` quantizes every projection to its type (a
packed one from its dequantized values). `--dequantize` loads the quantized tensors as `--dtype`
floats instead. With `--peer`,
llama.cpp's llama-perplexity (built by tools/build_llama_server.sh) runs on the same GGUF, text,
context size and chunk count, with the batch size equal to the context so it too evaluates one
chunk per pass, and the table row shows both estimates and the ratio ours/llama.cpp.

Examples:

    python tools/perplexity.py --dtype float32 --peer
    python tools/perplexity.py --isq q4k --ctx-size 256 --chunks 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from jax_llm_runtime.runtime.config import DEFAULT_MODEL_ID, DTYPES, MATMUL_DTYPES, EngineConfig
from jax_llm_runtime.runtime.library.perplexity import (
    REFERENCE_TEXT_NAME,
    ChunkScorer,
    LoadedModel,
    PerplexityError,
    adds_bos,
    check_ctx,
    evaluate,
    load_model,
    make_chunks,
    read_text_file,
    reference_text,
    text_sha256,
    text_tokens,
)
from jax_llm_runtime.runtime.loading.sources import ModelSourceError, cache_root

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PEER_BIN = ROOT / "third_party" / "llama.cpp" / "bin" / "llama-perplexity"
# llama.cpp's log lines start with "minutes.seconds.milliseconds.microseconds" (--log-timestamps);
# not anchored: a line may follow a partial one ("ETA ", whose end went to stdout).
_STAMP = r"(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) I "
_FINAL = re.compile(_STAMP + r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNKS = re.compile(_STAMP + r"perplexity: calculating perplexity over (\d+) chunks")


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-id", default=DEFAULT_MODEL_ID, help="alias, .gguf file or HF folder")
    p.add_argument("--weight-file", default=None, help="the .gguf file inside a folder or repo")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--isq", default=None, help="in-situ quantization type, as for runtime-serve")
    p.add_argument(
        "--matmul-dtype",
        default="auto",
        choices=MATMUL_DTYPES,
        help="operands of the quantized projections, as for runtime-serve",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="K and V rounded as a KV cache of this dtype stores them, as for runtime-serve",
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="load quantized tensors as --dtype floats instead of packed",
    )
    p.add_argument("--ctx-size", "-c", type=int, default=512, help="tokens per chunk (512)")
    p.add_argument("--chunks", type=int, default=None, help="score only the first N chunks")
    p.add_argument("--text-file", type=Path, default=None, help="UTF-8 text instead of the GPL")
    p.add_argument("--write-text", type=Path, default=None, help="where to write the text read")
    p.add_argument("--peer", action="store_true", help="also run llama.cpp's llama-perplexity")
    p.add_argument("--peer-bin", type=Path, default=DEFAULT_PEER_BIN)
    p.add_argument("--threads", "-t", type=int, default=2, help="llama-perplexity threads (2)")
    p.add_argument("--json", type=Path, default=None, help="write every number to this file")
    p.add_argument("--quiet", action="store_true", help="no per-chunk progress")
    return p


def _text(args: argparse.Namespace) -> tuple[str, str, Path]:
    if args.text_file is not None:
        text, name = read_text_file(args.text_file), str(args.text_file)
    else:
        text, name = reference_text(), REFERENCE_TEXT_NAME
    digest = text_sha256(text)
    path = args.write_text or cache_root() / "perplexity" / f"{digest[:16]}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    # llama.cpp's -f drops one final newline, so it reads back exactly `text`.
    path.write_bytes(text.encode("utf-8") + b"\n")
    print(f"text: {name}, {len(text)} chars, SHA-256 {digest}, written to {path}", file=sys.stderr)
    return text, digest, path


def _peer(args: argparse.Namespace, gguf: Path, text_path: Path, num_chunks: int) -> dict:
    if not args.peer_bin.is_file():
        raise PerplexityError(
            f"{args.peer_bin} not found; build it with tools/build_llama_server.sh"
        )
    command = [str(args.peer_bin), "-m", str(gguf), "-f", str(text_path)]
    command += ["-c", str(args.ctx_size), "-b", str(args.ctx_size), "-t", str(args.threads)]
    command += ["--chunks", str(num_chunks), "--log-timestamps"]
    print("peer: " + " ".join(command), file=sys.stderr)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    log = proc.stderr
    final, chunks = _FINAL.search(log), _CHUNKS.search(log)
    if proc.returncode != 0 or final is None or chunks is None:
        tail = " | ".join(log.strip().splitlines()[-3:])
        problem = f"failed (exit {proc.returncode})" if proc.returncode else "gave no estimate"
        raise PerplexityError(f"llama-perplexity {problem}: {tail}")
    return {
        "ppl": float(final.group(5)),
        "ppl_error": float(final.group(6)),
        "num_chunks": int(chunks.group(5)),
        "eval_seconds": _stamp_seconds(final) - _stamp_seconds(chunks),
        "seconds": seconds,
        "command": command,
    }


def _stamp_seconds(match: re.Match) -> float:
    minutes, seconds, ms, us = (int(match.group(i)) for i in range(1, 5))
    return minutes * 60 + seconds + ms / 1e3 + us / 1e6


def _row(args: argparse.Namespace, ours: dict, peer: dict | None) -> str:
    weights = f"isq {args.isq}" if args.isq else "as stored"
    if args.dequantize:
        weights += ", dequantized"
    cells = [
        args.model_id,
        weights,
        ours["dtype"],
        str(args.ctx_size),
        str(ours["num_chunks"]),
        str(ours["num_scored"]),
        f"{ours['ppl']:.4f} ± {ours['ppl_error']:.4f}",
        f"{ours['eval_seconds']:.1f}",
    ]
    if peer is None:
        cells += ["-", "-", "-"]
    else:
        cells += [
            f"{peer['ppl']:.4f} ± {peer['ppl_error']:.4f}",
            f"{peer['eval_seconds']:.1f}",
            f"{ours['ppl'] / peer['ppl']:.4f}",
        ]
    header = (
        "| model | weights | dtype | ctx | chunks | scored | PPL (ours) | eval s (ours) "
        "| PPL (llama.cpp) | eval s (llama.cpp) | ratio |"
    )
    rule = "|" + "---|" * 11
    return "\n".join([header, rule, "| " + " | ".join(cells) + " |"])


def _progress(index: int, running: float) -> None:
    print(f"[{index + 1}]{running:.4f},", end="", file=sys.stderr, flush=True)


def _ours(args: argparse.Namespace, text: str) -> tuple[dict, LoadedModel]:
    config = EngineConfig(
        model_id=args.model_id,
        weight_file=args.weight_file,
        dtype=args.dtype,
        isq=args.isq,
        matmul_dtype=args.matmul_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    check_ctx(args.ctx_size)
    start = time.perf_counter()
    model = load_model(config, dequantize=args.dequantize)
    if args.peer and model.files.kind != "gguf":
        raise PerplexityError("--peer needs a GGUF model (llama-perplexity reads only GGUF)")
    tokens = text_tokens(model.tokenizer, text)
    bos = model.tokenizer.bos_token_id if adds_bos(model.tokenizer) else None
    chunks = make_chunks(tokens, args.ctx_size, bos, args.chunks)
    scorer = ChunkScorer(model, args.ctx_size)
    load_seconds = time.perf_counter() - start
    compile_seconds = scorer.compile()
    start = time.perf_counter()
    result = evaluate(scorer, chunks, len(tokens), None if args.quiet else _progress)
    eval_seconds = time.perf_counter() - start
    if not args.quiet:
        print(file=sys.stderr)
    print(
        f"ours: {len(tokens)} tokens (BOS {'added' if bos is not None else 'not added'}), "
        f"{result.num_chunks} chunks, load {load_seconds:.1f} s, compile {compile_seconds:.1f} s, "
        f"eval {eval_seconds:.1f} s; Final estimate: PPL = {result.ppl:.4f} "
        f"+/- {result.ppl_error:.5f}",
        file=sys.stderr,
    )
    ours = {
        **dataclasses.asdict(result),
        "dtype": model.dtype.name,
        "load_seconds": load_seconds,
        "compile_seconds": compile_seconds,
        "eval_seconds": eval_seconds,
    }
    return ours, model


def run(args: argparse.Namespace) -> int:
    text, digest, text_path = _text(args)
    ours, model = _ours(args, text)
    peer = None
    if args.peer:
        peer = _peer(args, model.files.path, text_path, ours["num_chunks"])
        if peer["num_chunks"] != ours["num_chunks"]:
            print(
                f"warning: llama-perplexity scored {peer['num_chunks']} chunks, we scored "
                f"{ours['num_chunks']}: the two tokenizations differ",
                file=sys.stderr,
            )
    print(_row(args, ours, peer))
    if args.json is not None:
        record = {"text_sha256": digest, "text_file": str(text_path), "ours": ours, "peer": peer}
        args.json.write_text(json.dumps(record, indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return run(args)
    except (PerplexityError, ModelSourceError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
