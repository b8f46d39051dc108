# The documented way to do things. `python3 -m pip install rust-just` provides `just`.

venv := ".venv"
py := venv / "bin/python"
stamp := venv / ".installed"

# Create .venv and install the package with its dev extra (skipped when nothing changed).
setup:
    #!/usr/bin/env bash
    set -euo pipefail
    if [ ! -x {{py}} ]; then python3 -m venv {{venv}}; fi
    if [ ! -f {{stamp}} ] || [ pyproject.toml -nt {{stamp}} ]; then
        {{py}} -m pip install -q --upgrade pip
        # The CPU build of torch (HF reference for the numerics tests); a looser pin pulls CUDA.
        {{py}} -m pip install -q "torch==2.13.0"
        {{py}} -m pip install -q -e ".[dev]"
        touch {{stamp}}
    fi

# As root, install Debian's chromium for the web UI's browser tests when it is missing.
browser:
    #!/usr/bin/env bash
    set -euo pipefail
    # Playwright drives Debian's chromium: its own browser download is not reachable here.
    if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "browser: installing chromium (apt-get) for the web UI tests" >&2
        log="$(mktemp)"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >"$log" 2>&1; then
            tail -n 20 "$log" >&2
            echo "browser: chromium could not be installed; the web UI tests will fail" >&2
        fi
        rm -f "$log"
    fi

# Serve a model (default: the embedded SmolLM2-135M-Instruct) on http://127.0.0.1:2000/v1.
serve *ARGS: setup
    {{venv}}/bin/runtime-serve {{ARGS}}

# Run the test suite (all tests, slow and e2e included) in TEST_WORKERS processes (default 2),
# each taking whole test files, so a module's fixtures load once; TEST_WORKERS=0 runs in this one.
test *ARGS: setup browser
    {{venv}}/bin/pytest -n "${TEST_WORKERS:-2}" --dist loadfile {{ARGS}}

# The soak test alone, printing its figures: 300 requests at concurrency 32 with forced preemption
# and client disconnects (it also runs as part of `just test`).
soak: setup
    {{venv}}/bin/pytest -s tests/e2e/test_soak.py

# Retake docs/ui.png, the README's picture of the web UI, with its browser test.
ui-screenshot: setup browser
    UI_SCREENSHOT=docs/ui.png {{venv}}/bin/pytest -q tests/e2e/test_web_ui.py -k screenshot

# Lint and check formatting.
lint: setup
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .

# Benchmark a running server (see tools/bench.py --help), e.g. `just bench --peer-url http://127.0.0.1:2001/v1`.
bench *ARGS: setup
    {{py}} tools/bench.py {{ARGS}}

# Perplexity on a fixed text, like llama.cpp's llama-perplexity (see tools/perplexity.py --help),
# e.g. `just perplexity --dtype float32 --peer`.
perplexity *ARGS: setup
    {{py}} tools/perplexity.py {{ARGS}}

# Build llama.cpp's llama-server, llama-bench, llama-perplexity and llama-quantize (the CPU peer)
# into third_party/.
build-peer:
    bash tools/build_llama_server.sh

# The native kernel tests on aarch64 under qemu-user emulation, once per build (aarch64+dotprod,
# aarch64); installs qemu-user and the cross compiler when missing, caches an arm64 sysroot and
# aarch64 wheels in ~/.cache/runtime-arm64. Args go to pytest, e.g. `just test-arm64 -k matches`.
test-arm64 *ARGS:
    bash tools/arm64_kernel_tests.sh {{ARGS}}

# On a machine with a GPU or TPU: kernel tests on the device, greedy tokens against the CPU, speed
# and memory-bandwidth utilization (tools/accelerator_check.py --help); results land in OUT.
# Uses the Python on PATH (the device's own JAX), not the CPU venv.
accelerator-check OUT *ARGS:
    python3 tools/accelerator_check.py --out {{OUT}} {{ARGS}}
