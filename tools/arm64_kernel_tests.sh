#!/usr/bin/env bash
# Run the native CPU kernels' tests on aarch64, emulated on an x86-64 Linux machine by
# qemu-aarch64 (user mode): the NEON paths of pallas_kernels/native/*.cc (sdot with +dotprod)
# are checked with the same tests and tolerances as the x86 builds.
#
# What it needs and builds (once; later runs reuse the cache, ARM64_CACHE, by default
# ~/.cache/runtime-arm64):
#   - qemu-aarch64 and aarch64-linux-gnu-g++ on the host (Debian's qemu-user and
#     g++-aarch64-linux-gnu, installed with apt-get when missing, as root or through sudo);
#   - an aarch64 sysroot with Python 3.11: the arm64 packages of python3.11-minimal,
#     libpython3.11-stdlib and libstdc++6 and their dependencies, resolved and downloaded by
#     apt-get with a private state folder (the host's own package state is not touched) and
#     unpacked with dpkg -x, not installed;
#   - aarch64 wheels of jax, jaxlib and the tests' other imports (pip install --target with
#     --platform, binary wheels only), at the versions pinned below.
# The runtime builds each kernel at first use with $CXX; here CXX=aarch64-linux-gnu-g++, which
# the emulated Python runs natively (qemu-user emulates only the aarch64 binaries).
#
# Each build of ARM64_BUILDS (default "aarch64+dotprod aarch64": sdot, and the generic
# multiply-adds that a core without the dot-product extension runs) is run in turn with
# RUNTIME_NATIVE_ISA naming it, on qemu's "max" CPU, which has the extension. Before its tests,
# a check under qemu asserts that the build asked for is the one chosen and that both kernels
# build and load: a failed build would otherwise only skip the numerics tests.
#
# Usage: tools/arm64_kernel_tests.sh [pytest args]   (run from anywhere)
#   the test files below, with pytest's args added, e.g. tools/arm64_kernel_tests.sh -k matches
#   ARM64_TESTS="tests/pallas_kernels/test_paged_attention_native.py" tools/arm64_kernel_tests.sh
#   ARM64_BUILDS=aarch64 tools/arm64_kernel_tests.sh
# pytest runs with --noconftest: tests/conftest.py's model fixtures import the serving runtime,
# which the kernel tests do not use and whose dependencies the aarch64 site does not hold.
# Emulation is 10-50x slower than the host; its timings say nothing about aarch64 speed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${ARM64_CACHE:-$HOME/.cache/runtime-arm64}"
BUILDS="${ARM64_BUILDS:-aarch64+dotprod aarch64}"
TESTS="${ARM64_TESTS:-tests/pallas_kernels/test_dequant_matmul_native.py
  tests/pallas_kernels/test_paged_attention_native.py
  tests/pallas_kernels/test_paged_attention_fp8.py
  tests/pallas_kernels/test_cpu_choice.py}"
PYTHON="${PYTHON:-python3}"  # the host interpreter whose pip fetches the aarch64 wheels
# The arm64 packages the sysroot is resolved from (apt-get adds their dependencies).
DEBS="python3.11-minimal libpython3.11-stdlib libstdc++6"
# The aarch64 site: the host venv's versions of what the kernel tests import.
WHEELS="jax==0.10.2 jaxlib==0.10.2 numpy==2.4.6 ml_dtypes==0.6.0 flax==0.12.8 gguf==0.19.0
  pytest==9.2.0 pytest-timeout==2.4.0 platformdirs==4.14.8 tqdm"

say() { echo "arm64: $*" >&2; }
key() { echo "$*" | sha256sum | cut -c1-12; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    say "need root (or sudo) for: $*"
    return 1
  fi
}

# 1. Host tools.
missing=()
command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
command -v aarch64-linux-gnu-g++ >/dev/null || missing+=(g++-aarch64-linux-gnu)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (apt-get)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. The aarch64 sysroot.
SYSROOT="$CACHE/sysroot-$(key "$DEBS")"
if [ ! -x "$SYSROOT/usr/bin/python3.11" ]; then
  say "building the aarch64 sysroot in $SYSROOT"
  APT="$CACHE/apt"
  mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/parts" "$APT/preferences"
  : >"$APT/status"
  cat >"$APT/apt.conf" <<EOF
APT::Architecture "arm64";
APT::Architectures { "arm64"; };
Dir::State "$APT";
Dir::State::Lists "$APT/lists";
Dir::State::status "$APT/status";
Dir::Cache "$APT/cache";
Dir::Etc::Parts "$APT/parts";
Dir::Etc::Preferences "$APT/preferences";
APT::Sandbox::User "root";
EOF
  export APT_CONFIG="$APT/apt.conf"
  apt-get update -qq
  # With an empty package state, apt-get resolves the whole dependency closure.
  # shellcheck disable=SC2086
  apt-get install -qq -y --download-only --no-install-recommends $DEBS >/dev/null
  unset APT_CONFIG
  tmp="$(mktemp -d "$CACHE/sysroot.XXXXXX")"
  for deb in "$APT"/cache/archives/*_arm64.deb "$APT"/cache/archives/*_all.deb; do
    [ -e "$deb" ] && dpkg -x "$deb" "$tmp"
  done
  rm -rf "$SYSROOT"
  mv "$tmp" "$SYSROOT"
fi

# 3. The aarch64 wheels.
SITE="$CACHE/site-$(key "$WHEELS")"
if [ ! -f "$SITE/.complete" ]; then
  say "installing aarch64 wheels into $SITE"
  rm -rf "$SITE"
  # jaxlib's aarch64 wheels are manylinux_2_27 and later; the sysroot's glibc is 2.36.
  # shellcheck disable=SC2086
  "$PYTHON" -m pip install -q --target "$SITE" --only-binary=:all: --implementation cp \
    --python-version 3.11 --platform manylinux_2_36_aarch64 --platform manylinux_2_28_aarch64 \
    --platform manylinux_2_27_aarch64 --platform manylinux2014_aarch64 $WHEELS
  touch "$SITE/.complete"
fi

# 4. The tests, once per build.
export QEMU_LD_PREFIX="$SYSROOT" QEMU_CPU=max
# The checkout's folders under the package's one import name (the wheel's layout), and the
# checkout itself for the tests' own imports.
PKG="$CACHE/pkg"
mkdir -p "$PKG/jax_llm_runtime"
for part in api runtime models pallas_kernels; do ln -sfn "$ROOT/$part" "$PKG/jax_llm_runtime/$part"; done
export PYTHONPATH="$SITE:$PKG:$ROOT" CXX=aarch64-linux-gnu-g++ RUNTIME_CACHE_DIR="$CACHE/runtime"
export PYTHONDONTWRITEBYTECODE=1
# The interpreter as a script that starts it under qemu, so that sys.executable runs too: tests
# start subprocesses with it, and without binfmt_misc the host cannot exec an aarch64 binary.
py="$SYSROOT/usr/bin/python3.11-qemu"
cat >"$py" <<EOF
#!/bin/sh
exec qemu-aarch64 -L "$SYSROOT" -0 "\$0" "$SYSROOT/usr/bin/python3.11" "\$@"
EOF
chmod +x "$py"
cd "$ROOT"
status=0
for build in $BUILDS; do
  say "== $build =="
  start=$(date +%s)
  RUNTIME_NATIVE_ISA="$build" "$py" -c '
import os, platform, sys
from jax_llm_runtime.pallas_kernels import native
wanted, isa = os.environ["RUNTIME_NATIVE_ISA"], native.cpu_isa()
assert platform.machine() == "aarch64", platform.machine()
assert isa.name == wanted, f"asked for {wanted}, building {isa.name} (levels {native.levels_here()})"
for name in ("dequant_matmul", "paged_attention"):
    assert native.load(name) is not None, f"{name} did not build or load (see the warning above)"
    print(f"arm64: {name}: {native.library_path(name).name} {isa.flags}", file=sys.stderr)
'
  # shellcheck disable=SC2086
  if ! RUNTIME_NATIVE_ISA="$build" "$py" -m pytest -p no:cacheprovider --noconftest \
    -q $TESTS "$@"; then
    status=1
  fi
  say "$build: $(($(date +%s) - start)) s"
done
exit $status
