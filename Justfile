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

# Serve a model (default: the embedded SmolLM2-135M-Instruct) on http://127.0.0.1:2000/v1.
serve *ARGS: setup
    {{venv}}/bin/runtime-serve {{ARGS}}

# Run the test suite (all tests, slow and e2e included).
test *ARGS: setup
    {{venv}}/bin/pytest {{ARGS}}

# The soak test alone, printing its figures: 300 requests at concurrency 32 with forced preemption
# and client disconnects (it also runs as part of `just test`).
soak: setup
    {{venv}}/bin/pytest -s tests/e2e/test_soak.py

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
