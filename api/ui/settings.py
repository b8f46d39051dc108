"""``--ui-server`` and ``--ui-port``: whether and where ``runtime-serve`` serves the web chat UI.

Without either flag (and without ``$RUNTIME_UI_SERVER``) no UI route exists. ``--ui-server``
serves the page at ``/`` of the API's own port, so it calls the API same-origin. ``--ui-port P``
serves the UI alone on port P instead; its page then calls the API's port, which therefore
accepts cross-origin requests from any host on port P (CORS only lets that page read responses:
the API key still guards ``/v1``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

UI_SERVER_ENV = "RUNTIME_UI_SERVER"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class UiConfig:
    """The web UI is served. ``port``: None serves it on the API's port; else it is served alone
    on ``port``, and its page calls the API on ``api_port`` of the host it was loaded from."""

    port: int | None = None
    api_port: int | None = None

    def __post_init__(self) -> None:
        if self.port is None:
            return
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--ui-port must be a TCP port in 1..65535, got {self.port}")
        if self.api_port is None or self.api_port == 0:
            raise ValueError("--ui-port needs a fixed --port: the UI's page calls the API there")
        if self.api_port == self.port:
            raise ValueError(
                "--ui-port must differ from --port (--ui-server alone serves the UI on --port)"
            )

    def cors_origins(self) -> tuple[str, ...]:
        """Origins the API must accept for the page: any host on the UI's own port, if any."""
        if self.port is None:
            return ()
        return (f"http://*:{self.port}", f"https://*:{self.port}")


def add_ui_flags(parser: argparse.ArgumentParser) -> None:
    """The ``web UI`` flag group."""
    add = parser.add_argument_group("web UI").add_argument
    add(
        "--ui-server",
        action="store_const",
        const="1",
        default=os.environ.get(UI_SERVER_ENV),
        help="serve a web chat UI at / of the API's port (conversations kept in the browser; "
        f"default: ${UI_SERVER_ENV} (1/true/yes/on), else off)",
    )
    add(
        "--ui-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the web chat UI alone on this port instead; its page calls the API on "
        "--port, which then accepts cross-origin requests from that port (implies --ui-server)",
    )


def _switch(value: str | None) -> bool:
    text = (value or "").strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError(
        f"${UI_SERVER_ENV} must be one of {', '.join(_ON + _OFF[1:])} (or empty), got {value!r}"
    )


def ui_config(args: argparse.Namespace) -> UiConfig | None:
    """The UI settings the flags ask for; None when no UI is served (ValueError on bad ones)."""
    if args.ui_port is not None:
        return UiConfig(port=args.ui_port, api_port=args.port)
    return UiConfig() if _switch(args.ui_server) else None
