"""The built-in web chat UI (``--ui-server``).

``static/`` holds the page, its styles and scripts, and the vendored Markdown, sanitizing and
highlighting libraries (``static/vendor/``, refreshed by ``tools/update_ui_vendor.sh``); they ship
as package data, so the UI works without network access. ``api.routes.ui`` serves them, on the
API's port or, with ``--ui-port``, alone on a port of their own (``api.ui.port_server``).
"""

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
