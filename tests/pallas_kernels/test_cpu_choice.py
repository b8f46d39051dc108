"""The native kernels' instruction-set levels and the measured choice between each kernel and
XLA: the level follows the CPU (or a lower one asked for), every level this CPU runs builds
kernels that agree with the reference, calibration times every call class, caches its timings
and sets the verdicts, and the ops follow the verdicts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from jax_llm_runtime.pallas_kernels import cpu_choice, native
from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedLayer, ops
from jax_llm_runtime.pallas_kernels.native import calibration
from jax_llm_runtime.pallas_kernels.paged_attention import attention

REPO = Path(__file__).resolve().parents[2]
needs_kernels = pytest.mark.skipif(
    not native.enabled() or native.load("dequant_matmul") is None,
    reason="no C++ compiler built the native kernels here (they build wherever one does, CI "
    "included)",
)


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_choice, "_verdicts", {})


def _isa(monkeypatch: pytest.MonkeyPatch, features: str, machine: str, wanted: str = ""):
    monkeypatch.setattr(native, "_cpu_features", lambda: frozenset(features.split()))
    monkeypatch.setattr(native.platform, "machine", lambda: machine)
    monkeypatch.setenv(native.ENV_ISA, wanted)
    native.cpu_isa.cache_clear()
    try:
        return native.cpu_isa()
    finally:
        native.cpu_isa.cache_clear()


AVX512 = "avx2 fma f16c bmi2 movbe avx512f avx512bw avx512vl avx512dq avx512cd"


def test_the_level_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    full = _isa(monkeypatch, f"{AVX512} avx512_vnni avx512vbmi avx_vnni", "x86_64")
    assert full.name == "x86-64-v4+vnni+vbmi"
    assert full.flags == ("-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi")
    skylake = _isa(monkeypatch, AVX512, "x86_64")
    assert skylake.name == "x86-64-v4" and skylake.flags == ("-march=x86-64-v4",)
    zen3 = _isa(monkeypatch, "avx2 fma f16c bmi2 movbe", "x86_64")
    assert zen3.name == "x86-64-v3" and zen3.flags == ("-march=x86-64-v3",)
    alder = _isa(monkeypatch, "avx2 fma f16c bmi2 movbe avx_vnni", "x86_64")
    assert alder.flags == ("-march=x86-64-v3", "-mavxvnni")
    graviton = _isa(monkeypatch, "fp asimd fphp asimdhp asimddp", "aarch64")
    assert graviton.name == "aarch64+dotprod"
    assert graviton.flags == ("-march=armv8.2-a+dotprod",)
    old = _isa(monkeypatch, "sse2 sse4_2", "x86_64")
    assert old.name == "generic" and old.flags == ()


def test_a_lower_build_on_request_and_one_the_cpu_lacks_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    features = f"{AVX512} avx512_vnni avx_vnni"
    plain = _isa(monkeypatch, features, "x86_64", "x86-64-v3")
    assert plain.name == "x86-64-v3" and plain.flags == ("-march=x86-64-v3",)
    vnni = _isa(monkeypatch, features, "x86_64", "x86-64-v3+avxvnni")
    assert vnni.flags == ("-march=x86-64-v3", "-mavxvnni")
    assert _isa(monkeypatch, features, "x86_64", "x86-64-v4").name == "x86-64-v4"
    assert _isa(monkeypatch, features, "x86_64", "generic").flags == ()
    with caplog.at_level("WARNING"):
        assert _isa(monkeypatch, "avx2 fma f16c bmi2 movbe", "x86_64", "x86-64-v4").name == (
            "x86-64-v3"
        )
    assert "RUNTIME_NATIVE_ISA=x86-64-v4 is not a build this CPU runs" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        best = _isa(monkeypatch, "avx2 fma f16c bmi2 movbe", "x86_64", "x86-64-v3+avxvnni")
    assert best.name == "x86-64-v3" and "x86-64-v3+avxvnni is not a build" in caplog.text


@pytest.mark.skipif(
    sys.platform != "linux" or native.platform.machine() != "aarch64", reason="aarch64 Linux only"
)
def test_aarch64_features_come_from_hwcap_as_well() -> None:
    """AT_HWCAP names the features also where /proc/cpuinfo is another machine's (qemu-user
    shows the host's)."""
    hwcaps = native._arm_hwcaps()
    assert {"fp", "asimd"} <= hwcaps <= native._cpu_features()


LEVEL_CHECK = """
import hashlib
import jax, jax.numpy as jnp, numpy as np
from jax_llm_runtime.pallas_kernels import native
from jax_llm_runtime.pallas_kernels.native.calibration import _gguf_weight
from jax_llm_runtime.pallas_kernels.dequant_matmul import native as dq, reference
from gguf import GGMLQuantizationType as T
print(native.cpu_isa().name)
rng = np.random.default_rng(0)
int8_outputs = hashlib.sha256()
cases = ((T.Q4_1, 1), (T.Q4_1, 16), (T.Q8_0, 5), (T.Q4_K, 3), (T.Q5_K, 4), (T.Q6_K, 9), (T.Q5_0, 2))
for qtype, rows in cases:
    w = _gguf_weight(qtype, 256, 96, rng)
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
    for int8 in (False, True):
        got = dq.dequant_matmul(x, w, int8_activations=int8)
        xq = reference.quantize_activations(x) if int8 else x
        want = np.asarray(reference.dequant_matmul(xq, w))
        # float32 sums in another order: errors scale with the largest terms of a row
        atol = 2e-5 * np.abs(want).max(axis=1, keepdims=True)
        bad = np.abs(np.asarray(got) - want) > atol + 2e-4 * np.abs(want)
        assert not bad.any(), (qtype.name, int8, np.asarray(got)[bad], want[bad])
        if int8:
            int8_outputs.update(np.asarray(got).tobytes())
from jax_llm_runtime.pallas_kernels.paged_attention import native as pa, reference as pa_ref
for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
    k = jnp.asarray(rng.standard_normal((1, 12, 16, 2, 64)), dtype)
    v = jnp.asarray(rng.standard_normal((1, 12, 16, 2, 64)), dtype)
    q = jnp.asarray(rng.standard_normal((2, 3, 6, 64)), jnp.float32)
    pages = jnp.asarray(rng.permutation(12)[:12].reshape(2, 6), jnp.int32)
    positions = jnp.asarray([[70, 71, 72], [20, 21, 22]], jnp.int32)
    args = (q, k, v, jnp.int32(0), positions, pages, jnp.asarray([73, 23], jnp.int32))
    got = pa.paged_attention(*args, scale=0.125)
    np.testing.assert_allclose(got, pa_ref.paged_attention(*args, scale=0.125), atol=2e-5)
print(int8_outputs.hexdigest()[:16], "ok")
"""


def _other_builds() -> list[str]:
    """The x86 builds this CPU runs besides its best one, by ``RUNTIME_NATIVE_ISA`` name."""
    levels, best = native.levels_here(), native.cpu_isa().name
    builds = []
    if "x86-64-v3" in levels:
        builds += ["x86-64-v3", "x86-64-v3+avxvnni"]
    if "x86-64-v4" in levels:
        builds += ["x86-64-v4"]
    runs = native._cpu_features()
    return [b for b in builds if b != best and ("avxvnni" not in b or "avx_vnni" in runs)]


@needs_kernels
@pytest.mark.slow
def test_the_lower_builds_agree_with_the_reference() -> None:
    """Every x86 build this CPU runs besides its own (plain AVX2 with maddubs dots, AVX2 with
    AVX-VNNI, AVX-512 without VNNI: what most x86 machines run) reads every bit layout as the
    reference does, with float and int8 activations, and attends over float32, float16 and
    bfloat16 caches as the reference does; every other native test runs the build
    for this CPU's own level. With int8 activations every build gives the same bits as this
    CPU's own (the integer sums are exact, and each output is scaled in the same order), so
    a request's tokens do not depend on which x86 CPU serves it. Each build runs in a fresh
    process (``RUNTIME_NATIVE_ISA`` is read once), side by side."""
    builds = _other_builds()
    if not builds:
        pytest.skip(f"this CPU runs only its own build ({native.cpu_isa().name})")
    builds.append(native.cpu_isa().name)
    runs = {
        build: subprocess.Popen(
            [sys.executable, "-c", LEVEL_CHECK],
            env={**os.environ, native.ENV_ISA: build, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for build in builds
    }
    digests = {}
    for build, run in runs.items():
        out, err = run.communicate(timeout=900)
        assert run.returncode == 0, f"{build}: {err[-3000:]}"
        name, digest, verdict = out.split()[-3:]
        assert (name, verdict) == (build, "ok"), out
        digests[build] = digest
    assert len(set(digests.values())) == 1, digests


@needs_kernels
@pytest.mark.slow
def test_calibration_times_every_class_caches_and_sets_verdicts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path))
    timings = calibration.calibrate()
    assert {k: set(v) for k, v in timings.items()} == {
        k: set(v) for k, v in cpu_choice.KERNELS.items()
    }
    for kernel, classes in timings.items():
        for call_class, ms in classes.items():
            assert ms["native"] > 0 and ms["xla"] > 0
            wins = ms["native"] <= ms["xla"]
            assert cpu_choice.native_wins(kernel, call_class) is wins
    assert len(list(tmp_path.glob("native/choice-*.json"))) == 1
    # A second start reads the file: nothing is measured again.
    monkeypatch.setattr(cpu_choice, "_verdicts", {})
    monkeypatch.setattr(calibration, "_MEASURES", {})
    assert calibration.calibrate() == timings
    assert cpu_choice._verdicts


@needs_kernels
def test_the_ops_follow_the_verdicts() -> None:
    rng = np.random.default_rng(0)
    stack = calibration._gguf_weight(GGMLQuantizationType.Q4_1, 256, 64, rng)
    stack = jax.tree.map(lambda a: a[None], stack)  # one layer
    x = jnp.ones((1, 256), jnp.float32)

    def dequant_hlo() -> str:
        fn = lambda x: ops.dequant_matmul(x, PackedLayer(stack, jnp.int32(0)))  # noqa: E731
        return jax.jit(fn).lower(x).as_text()

    assert "runtime_dequant_matmul_" in dequant_hlo()
    cpu_choice.set_verdicts({("dequant_matmul", "one_row"): False})
    assert "runtime_dequant_matmul_" not in dequant_hlo()

    q = jnp.ones((2, 1, 4, 16), jnp.float32)
    cache = jnp.ones((1, 8, 16, 2, 16), jnp.float32)
    pages = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    args = (
        q,
        cache,
        cache,
        jnp.int32(0),
        jnp.zeros((2, 1), jnp.int32),
        pages,
        jnp.ones(2, jnp.int32),
    )

    def attention_hlo() -> str:
        return jax.jit(lambda *a: attention(*a, scale=0.25, impl="cpu")).lower(*args).as_text()

    assert "runtime_paged_attention_" in attention_hlo()
    cpu_choice.set_verdicts({("paged_attention", "decode"): False})
    assert "runtime_paged_attention_" not in attention_hlo()
    # impl="native" still forces the kernel (its own tests rely on it).
    forced = jax.jit(lambda *a: attention(*a, scale=0.25, impl="native")).lower(*args).as_text()
    assert "runtime_paged_attention_" in forced


def _fake_compiler(tmp_path: Path, fail: bool) -> Path:
    """A ``$CXX`` that logs each build and links an empty library at ``-o`` (or fails), with the
    compiler the runtime would have used (under qemu, the cross compiler: a host ``c++`` would
    link a library the emulated process cannot load)."""
    real = native._compiler()
    script = tmp_path / "cxx"
    log = tmp_path / "builds.log"
    body = f'echo "$@" >> "{log}"\n'
    if fail:
        body += "echo 'fatal: no space left' >&2; exit 1\n"
    else:
        body += 'out=""; prev=""; for a in "$@"; do [ "$prev" = -o ] && out="$a"; prev="$a"; done\n'
        body += f'exec "{real}" -shared -fPIC -x c++ /dev/null -o "$out"\n'
    script.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo fake 1.0; exit 0; fi\n' + body)
    script.chmod(0o755)
    return log


@pytest.mark.skipif(native._compiler() is None, reason="needs a C++ compiler to link a library")
@pytest.mark.parametrize("fail", [False, True])
def test_prebuild_builds_in_the_background_and_load_takes_the_result(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fail: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # A first start builds every kernel at once while the model loads; load() then waits for
    # that build (no second compile), and a failed build is the usual warning and XLA fallback.
    log = _fake_compiler(tmp_path, fail)
    monkeypatch.setenv("CXX", str(tmp_path / "cxx"))
    monkeypatch.setenv("RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_paths", {})
    monkeypatch.setattr(native, "_pending", {})
    native.prebuild()
    assert set(native._pending) == set(native.KERNELS)
    libraries = {name: native.load(name) for name in native.KERNELS}
    assert not native._pending
    # One compile per translation unit of each source (dequant_matmul's parts in parallel).
    compiled = [line.split(".cc")[0].rsplit("/", 1)[1] for line in _compiles(log)]
    assert sorted(compiled) == sorted(
        name for name in native.KERNELS for _ in native.PARTS.get(name, (None,))
    )
    if fail:
        assert all(library is None for library in libraries.values())
        assert "no space left" in caplog.text and "using XLA" in caplog.text
    else:
        assert all(library is not None for library in libraries.values())
        native.prebuild()  # loaded already: nothing starts
        assert not native._pending and len(_compiles(log)) == len(compiled)


def _compiles(log: Path) -> list[str]:
    """The logged compiler calls that compiled a source (not the parts' link)."""
    return [line for line in log.read_text().splitlines() if ".cc" in line]
