"""``--ui-port``: the web UI alone on a port of its own, served from a daemon thread.

The socket is bound in the caller's thread, so a port that is taken is a ``UiPortError`` at
startup (``runtime-serve`` prints it as one line) rather than a log line from a background thread. The thread runs its own uvicorn server and
event loop (uvicorn leaves signal handling to the main thread's server) and ends with the
process.
"""

from __future__ import annotations

import logging
import socket
import threading

import uvicorn
from litestar import Litestar

from jax_llm_runtime.api.protocol.errors import exception_handlers
from jax_llm_runtime.api.routes.ui import ui_router
from jax_llm_runtime.api.ui.settings import UiConfig

logger = logging.getLogger(__name__)


class UiPortError(RuntimeError):
    """The UI's own port could not be bound."""


def create_ui_app(api_port: int) -> Litestar:
    """An app serving only the UI, whose page calls the API on ``api_port``."""
    return Litestar(
        route_handlers=[ui_router(api_port)],
        exception_handlers=exception_handlers(),
        logging_config=None,
        openapi_config=None,
    )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise UiPortError(f"cannot serve the web UI on {host}:{port} (--ui-port): {exc}") from None


def start_ui_port(host: str, ui: UiConfig | None) -> uvicorn.Server | None:
    """Serve the UI on ``ui.port`` of ``host`` when it has a port of its own; None otherwise.

    Returns the running server (set its ``should_exit`` to stop it early). Raises UiPortError
    when the port cannot be bound.
    """
    if ui is None or ui.port is None or ui.api_port is None:
        return None
    sock = _bind(host, ui.port)
    config = uvicorn.Config(
        create_ui_app(ui.api_port), log_config=None, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="ui-server", daemon=True
    )
    thread.start()
    logger.info("web UI on http://%s:%d/ (calling the API on port %d)", host, ui.port, ui.api_port)
    return server
