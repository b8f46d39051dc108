"""``.example.env`` names every environment variable the code reads, so it cannot go stale.

The reads are found in the syntax trees of the packages and tools: ``os.environ.get(X)``,
``os.environ[X]``, ``os.getenv(X)`` and ``X in os.environ``, where ``X`` is a string literal or a
module-level constant holding one. A read whose name cannot be resolved that way fails the test
too, so a new way of spelling a read cannot slip past it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.serve_process import REPO_ROOT

SCANNED = ("api", "runtime", "models", "pallas_kernels", "tools")
EXAMPLE = REPO_ROOT / ".example.env"
_ENTRY = re.compile(r"^#?\s*(?:export\s+)?([A-Z][A-Z0-9_]*)=", re.MULTILINE)


def _sources() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (REPO_ROOT / folder).rglob("*.py"))


def _constants(trees: dict[Path, ast.Module]) -> dict[str, set[str]]:
    """Module-level ``NAME = "string"`` assignments of every scanned file, by name."""
    found: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                found.setdefault(node.targets[0].id, set()).add(node.value.value)
    return found


def _is_os_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _read_keys(tree: ast.Module) -> list[ast.expr]:
    """The key expressions of every environment read in ``tree``."""
    keys: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            environ_get = (
                isinstance(func, ast.Attribute)
                and func.attr == "get"
                and _is_os_environ(func.value)
            )
            getenv = (
                isinstance(func, ast.Attribute)
                and func.attr == "getenv"
                and isinstance(func.value, ast.Name)
                and func.value.id == "os"
            )
            if environ_get or getenv:
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_os_environ(node.value):
            keys.append(node.slice)
        elif (
            isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
            and _is_os_environ(node.comparators[0])
        ):
            keys.append(node.left)
    return keys


def variables_read() -> dict[str, str]:
    """Every environment variable name the scanned code reads -> where (``file:line``)."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in _sources()}
    constants = _constants(trees)
    found: dict[str, str] = {}
    unresolved: list[str] = []
    for path, tree in trees.items():
        for key in _read_keys(tree):
            where = f"{path.relative_to(REPO_ROOT)}:{key.lineno}"
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                found.setdefault(key.value, where)
            elif isinstance(key, ast.Name) and len(constants.get(key.id, ())) == 1:
                found.setdefault(next(iter(constants[key.id])), where)
            else:
                unresolved.append(f"{where}: {ast.unparse(key)}")
    assert not unresolved, (
        "environment reads whose variable name is not a literal or a module string constant "
        f"(use one, so .example.env can be checked): {unresolved}"
    )
    return found


def test_the_scan_finds_the_known_reads() -> None:
    found = variables_read()
    for name in ("RUNTIME_API_KEY", "RUNTIME_MCP_CONFIG", "RUNTIME_CACHE_DIR"):
        assert name in found, f"the scan missed {name}; it found {sorted(found)}"


def test_example_env_lists_every_variable_the_code_reads() -> None:
    listed = set(_ENTRY.findall(EXAMPLE.read_text(encoding="utf-8")))
    missing = {name: where for name, where in variables_read().items() if name not in listed}
    assert not missing, f".example.env lacks these variables (read at): {missing}"


def test_every_example_entry_has_a_comment_above_it() -> None:
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        if _ENTRY.match(line):
            above = lines[index - 1] if index else ""
            assert above.startswith("#") and not _ENTRY.match(above), (
                f".example.env line {index + 1} ({line!r}) needs a comment line above it"
            )
