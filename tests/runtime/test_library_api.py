"""LIBRARY_API.md stays true: every ``python`` block runs, in order, on the real default model.

The blocks form one session (later ones use the ``engine`` the first builds), so they run in one
fresh interpreter, where ``.device("cpu")`` can still pick JAX's platform. Each block is compiled
at its own line numbers of LIBRARY_API.md, so a failure's traceback points into the file.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from jax_llm_runtime.runtime.library.inference_engine import InferenceEngine
from tests.serve_process import REPO_ROOT

DOC = REPO_ROOT / "LIBRARY_API.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)

RUNNER = """
import re, sys, time
text = open(sys.argv[1], encoding="utf-8").read()
namespace = {"__name__": "__main__"}
for match in re.finditer(sys.argv[2], text, re.MULTILINE | re.DOTALL):
    line = text.count("\\n", 0, match.start(1)) + 1
    start = time.perf_counter()
    # Padding puts the block at its own line numbers in tracebacks.
    code = compile("\\n" * (line - 1) + match.group(1), sys.argv[1], "exec")
    exec(code, namespace)
    print(f"--- block at line {line}: ok in {time.perf_counter() - start:.1f}s", flush=True)
"""


def python_blocks() -> list[str]:
    return _BLOCK.findall(DOC.read_text(encoding="utf-8"))


def test_every_public_method_appears_in_the_examples() -> None:
    code = "\n".join(python_blocks())
    public = [name for name in vars(InferenceEngine) if not name.startswith("_")]
    documented_in_prose = {
        "config",
        "engine",
        "tokenizer",
        "chat_prompt_ids",
        "aembed",
        "from_config",
    }
    missing = [
        name for name in public if f".{name}" not in code and name not in documented_in_prose
    ]
    assert not missing, f"LIBRARY_API.md has no example of {missing}"
    prose = DOC.read_text(encoding="utf-8")
    assert all(f"`{name}" in prose or f".{name}" in prose for name in documented_in_prose)


def test_examples_keep_generations_short() -> None:
    for block in python_blocks():
        for value in re.findall(r"max_tokens=(\d+)", block):
            assert int(value) <= 16, block


@pytest.mark.slow
def test_library_api_examples_run(smollm2_gguf: Path) -> None:
    assert len(python_blocks()) >= 8
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, str(DOC), _BLOCK.pattern],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=850,
        check=False,
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert result.stdout.count(": ok in ") == len(python_blocks()), result.stdout
