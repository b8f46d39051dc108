"""Headless Chromium for the web UI tests: Debian's ``chromium`` driven by Playwright.

Playwright's own browser download is not used (machines here reach no browser host); `just test`
(its `browser` recipe) installs Debian's package when it is missing. A machine without it fails
these tests with a message saying so, unless ``RUNTIME_SKIP_BROWSER_TESTS=1`` opts out explicitly (then they skip).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser

SKIP_ENV = "RUNTIME_SKIP_BROWSER_TESTS"
CHROMIUM_ENV = "RUNTIME_CHROMIUM"  # a chromium binary other than the one on PATH


def chromium_path() -> str:
    """The Chromium binary to drive; fails the test (or skips it, when opted out) without one."""
    path = os.environ.get(CHROMIUM_ENV) or shutil.which("chromium")
    if path:
        return path
    message = (
        "the web UI tests need Debian's chromium: run `just browser` as root (it installs the "
        "package) or `apt-get install chromium`, or name a binary in $RUNTIME_CHROMIUM"
    )
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: {message}")
    pytest.fail(f"{message}; set {SKIP_ENV}=1 to skip them instead", pytrace=False)


@contextmanager
def chromium() -> Iterator[Browser]:
    """A headless Chromium, closed after the block."""
    executable = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: run `just setup` (it is in the dev extra)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            yield browser
        finally:
            browser.close()
