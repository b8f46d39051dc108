"""An httpx client that drives a Litestar app in the test's own event loop, lifespan included.

Litestar's ``AsyncTestClient`` hands each request to a portal and waits for it, so requests sent
from concurrent tasks run one after another; tests that need several requests in flight at once
(admission, draining, engine death) use this client instead.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import uvicorn
from litestar import Litestar


@asynccontextmanager
async def app_client(app: Litestar) -> AsyncIterator[httpx.AsyncClient]:
    """Run ``app``'s lifespan (engine start and shutdown) around an ASGI-transport client."""
    transport = httpx.ASGITransport(app=app)
    async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c


class _ReadyServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()


@contextmanager
def serve_in_thread(app: Litestar) -> Iterator[str]:
    """Serve ``app`` (lifespan included) on a free port of 127.0.0.1; yields the base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", log_config=None)
    with serve_config_in_thread(config) as server:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        yield f"http://{host}:{port}"


@contextmanager
def serve_config_in_thread(config: uvicorn.Config) -> Iterator[uvicorn.Server]:
    """Serve ``config`` (its port 0: a free one) in a thread; yields the started server, whose
    ``server_state.connections`` are the open connections' protocols."""
    server = _ReadyServer(config)
    thread = threading.Thread(target=server.run, name="test-server", daemon=True)
    thread.start()
    try:
        while not server.ready.wait(timeout=0.05):
            assert thread.is_alive(), "the app did not start"
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=60)
