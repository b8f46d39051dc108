"""``.env`` files: ``NAME=value`` lines loaded into the environment when a command-line tool starts.

``runtime-serve`` and ``runtime-chat`` call ``load_env_file()`` first thing, so a ``.env`` in the
working directory can hold e.g. ``RUNTIME_API_KEY`` for both. Variables already set in the
environment win: the file only fills in what is missing. ``.example.env`` lists every variable
the code reads. ``JAX_PLATFORMS`` from the file is handed to JAX's config, since JAX read its
environment when it was imported.

The format is the common subset of python-dotenv's and docker's: blank lines and ``#`` comments
are skipped; ``export NAME=value`` is accepted; a value may be 'single-quoted' (taken literally),
"double-quoted" (``\\n``, ``\\t``, ``\\"`` and ``\\\\`` escapes) or bare (trailing `` # comment``
and surrounding spaces removed). Anything else is a ``ValueError`` naming the file and line.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import MutableMapping
from pathlib import Path

ENV_FILE = ".env"
JAX_PLATFORMS_ENV = "JAX_PLATFORMS"
_LINE = re.compile(r"^(?:export\s+)?(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*=\s*(?P<value>.*)$")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\"}


def parse_env_file(text: str, source: str = ENV_FILE) -> dict[str, str]:
    """The ``NAME: value`` pairs of an env file's text, in order (a later line wins)."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{source}:{number}: expected NAME=value, got {raw.strip()[:60]!r}")
        try:
            values[match["name"]] = _value(match["value"])
        except ValueError as exc:
            raise ValueError(f"{source}:{number}: {exc}") from None
    return values


def _value(text: str) -> str:
    if text[:1] in ("'", '"'):
        quote = text[0]
        end = _closing_quote(text, quote)
        rest = text[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            raise ValueError(f"unexpected text after the closing quote: {rest[:40]!r}")
        body = text[1:end]
        return body if quote == "'" else re.sub(r"\\(.)", _unescape, body)
    return re.split(r"\s+#", text, maxsplit=1)[0].strip()


def _closing_quote(text: str, quote: str) -> int:
    index = 1
    while index < len(text):
        if text[index] == "\\" and quote == '"':
            index += 2
            continue
        if text[index] == quote:
            return index
        index += 1
    raise ValueError(f"the value has no closing {quote}")


def _unescape(match: re.Match[str]) -> str:
    return _ESCAPES.get(match[1], "\\" + match[1])


def load_env_file(
    path: str | Path = ENV_FILE, environ: MutableMapping[str, str] | None = None
) -> list[str]:
    """Set the variables of the env file at ``path`` that ``environ`` (default ``os.environ``)
    does not have yet; return their names. A missing file sets nothing; an unreadable or
    malformed one is a ``ValueError`` naming it."""
    environ = os.environ if environ is None else environ
    path = Path(path)
    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    added = []
    for name, value in parse_env_file(text, str(path)).items():
        if name not in environ:
            environ[name] = value
            added.append(name)
    if environ is os.environ and JAX_PLATFORMS_ENV in added and "jax" in sys.modules:
        # JAX read its environment when it was imported (before this file was loaded); its
        # backends start later, so the setting still takes effect through its config.
        sys.modules["jax"].config.update("jax_platforms", environ[JAX_PLATFORMS_ENV] or None)
    return added
