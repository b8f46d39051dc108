"""An httpx client that drives a Litestar app in the test's own event loop, lifespan included.

Litestar's ``AsyncTestClient`` hands each request to a portal and waits for it, so requests sent
from concurrent tasks run one after another; tests that need several requests in flight at once
(admission, draining, engine death) use this client instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from litestar import Litestar


@asynccontextmanager
async def app_client(app: Litestar) -> AsyncIterator[httpx.AsyncClient]:
    """Run ``app``'s lifespan (engine start and shutdown) around an ASGI-transport client."""
    transport = httpx.ASGITransport(app=app)
    async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c
