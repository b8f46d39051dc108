"""Tests of the command-line scripts in tools/ (which are files, not an importable package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"


def load_tool(filename: str) -> ModuleType:
    """``tools/<filename>`` imported as a module named ``<stem>_under_test``."""
    spec = importlib.util.spec_from_file_location(
        f"{Path(filename).stem}_under_test", TOOLS_DIR / filename
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module
