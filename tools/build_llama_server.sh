#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench, llama-perplexity and llama-quantize (CPU, Release)
# as the benchmark and accuracy peer.
#
# llama.cpp itself is not on any package registry we can reach, but the llama-cpp-python
# source distribution on PyPI vendors it under vendor/llama.cpp. This script downloads that
# sdist (pinned version and SHA-256), unpacks it under third_party/ (git-ignored) and builds
# only these tools, statically linked, with the web UI, TLS and every network fetch off.
#
# Result: third_party/llama.cpp/bin/{llama-server,llama-bench,llama-perplexity,llama-quantize}.
# A second run that finds all binaries built from the pinned version does nothing.
#
# Usage: tools/build_llama_server.sh            (run from anywhere; 3.5 min on 2 AVX-512 cores with ninja)
#   JOBS=4 tools/build_llama_server.sh          (parallel compile jobs, default 2)
#   PYTHON=python3 tools/build_llama_server.sh  (interpreter whose pip downloads the sdist)
#   ISA=x86-64-v3 tools/build_llama_server.sh   (into bin-x86-64-v3/: see below)
#   ISA=x86-64-v4 tools/build_llama_server.sh   (into bin-x86-64-v4/: see below)
#
# ISA: the instruction set the peer is built for, to compare it with our kernels built for the
# same one (RUNTIME_NATIVE_ISA). "native" (default: llama.cpp's own default, GGML_NATIVE=ON, all
# the build machine has) into bin/; "x86-64-v3" (AVX2, FMA, F16C and BMI2 with AVX-512 off:
# GGML_NATIVE=OFF and ggml's per-feature switches, as llama.cpp's docs build for a target) into
# bin-x86-64-v3/, which an AVX-512 machine also runs; "x86-64-v4" (AVX-512 F/BW/VL/DQ/CD with
# VNNI, VBMI and BF16, AVX-VNNI, and AMX off: what our kernels' AVX-512 build uses) into
# bin-x86-64-v4/. A GGML_NATIVE=ON build on a virtual machine whose CPUID lists AMX but whose
# kernel does not grant the tile state dies with SIGILL in ggml's AMX kernels (seen on a
# 2-vCPU Xeon, 2026-11-27); build x86-64-v4 there. The flags used are printed and kept in
# the bin folder's build-flags.txt.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
LLAMA_CPP_PYTHON_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
THIRD_PARTY="$ROOT/third_party"
SRC_DIR="$THIRD_PARTY/src"
SDIST="$SRC_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
UNPACKED="$SRC_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
LLAMA_SRC="$UNPACKED/vendor/llama.cpp"
OUT_DIR="$THIRD_PARTY/llama.cpp"
ISA="${ISA:-native}"
case "$ISA" in
    native) ISA_FLAGS=(-DGGML_NATIVE=ON); SUFFIX="" ;;
    x86-64-v3) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
                          -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF
                          -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF)
               SUFFIX="-x86-64-v3" ;;
    x86-64-v4) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
                          -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
                          -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
                          -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
               SUFFIX="-x86-64-v4" ;;
    *) echo "error: ISA must be native, x86-64-v3 or x86-64-v4, got '$ISA'" >&2; exit 1 ;;
esac
BUILD_DIR="$OUT_DIR/build-$LLAMA_CPP_PYTHON_VERSION$SUFFIX"
BIN_DIR="$OUT_DIR/bin$SUFFIX"
STAMP="$BIN_DIR/.llama-cpp-python-version"
JOBS="${JOBS:-2}"
TARGETS=(llama-server llama-bench llama-perplexity llama-quantize)

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

built_already() {
    [[ -f "$STAMP" && "$(cat "$STAMP")" == "$LLAMA_CPP_PYTHON_VERSION" ]] || return 1
    local t
    for t in "${TARGETS[@]}"; do [[ -x "$BIN_DIR/$t" ]] || return 1; done
}

if built_already; then
    echo "llama.cpp tools from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION already built:"
    printf '%s\n' "${TARGETS[@]/#/$BIN_DIR/}"
    exit 0
fi

if ! grep -qx '/third_party/' "$ROOT/.gitignore" 2>/dev/null; then
    echo "error: $ROOT/.gitignore must list /third_party/ so the downloaded sources stay untracked" >&2
    exit 1
fi
for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "error: '$tool' not found; install cmake and a C++17 compiler (apt-get install cmake g++)" >&2; exit 1; }
done

mkdir -p "$SRC_DIR" "$BIN_DIR"

if [[ ! -f "$SDIST" ]]; then
    echo "downloading llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION (sdist) from PyPI"
    "$PYTHON" -m pip download --no-deps --no-binary :all: --dest "$SRC_DIR" \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
fi
echo "$LLAMA_CPP_PYTHON_SHA256  $SDIST" | sha256sum --check --quiet - || {
    echo "error: $SDIST does not match the pinned SHA-256; delete it and rerun" >&2
    exit 1
}
if [[ ! -f "$LLAMA_SRC/CMakeLists.txt" ]]; then
    rm -rf "$UNPACKED"
    tar -xzf "$SDIST" -C "$SRC_DIR"
fi

GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi

# The sdist ships the submodule's git metadata, so llama.cpp's build-info step reports the
# vendored commit. Should it ever lack it, git must not walk up into this repository instead.
export GIT_CEILING_DIRECTORIES="$SRC_DIR"

start=$(date +%s)
cmake -S "$LLAMA_SRC" -B "$BUILD_DIR" "${GENERATOR[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    "${ISA_FLAGS[@]}" \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_LLGUIDANCE=OFF
cmake --build "$BUILD_DIR" --config Release --target "${TARGETS[@]}" -j "$JOBS"

for t in "${TARGETS[@]}"; do
    install -m 0755 "$BUILD_DIR/bin/$t" "$BIN_DIR/$t"
done
echo "$LLAMA_CPP_PYTHON_VERSION" >"$STAMP"
echo "CMAKE_BUILD_TYPE=Release ${ISA_FLAGS[*]} BUILD_SHARED_LIBS=OFF" >"$BIN_DIR/build-flags.txt"
echo "built in $(($(date +%s) - start)) s from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION:"
printf '%s\n' "${TARGETS[@]/#/$BIN_DIR/}"
