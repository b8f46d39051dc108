"""The web chat UI (``--ui-server``): the page at ``/``, its settings at ``/ui/config.json`` and
its assets under ``/ui/`` (``api.ui.STATIC_DIR``).

The routes need no API key: they serve only the packaged files. The page asks the user for the
key when the API wants one, keeps it in the browser's localStorage and sends it as a Bearer token
itself. The page's Content-Security-Policy lets it run only its own scripts and talk only to the
API, so model output rendered as Markdown (already sanitized by DOMPurify) cannot load or send
anything elsewhere.
"""

from __future__ import annotations

from litestar import MediaType, Response, Router, get
from litestar.static_files import create_static_files_router

from jax_llm_runtime.api.service.limits import limit_request_headers
from jax_llm_runtime.api.ui import STATIC_DIR
from jax_llm_runtime.api.ui.settings import UiConfig


def content_security_policy(api_port: int | None) -> str:
    """The page's policy; ``api_port`` as for ``ui_router``."""
    connect = "'self'"
    if api_port is not None:
        connect += f" http://*:{api_port} https://*:{api_port}"
    return (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        f"connect-src {connect}; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    )


def ui_router(api_port: int | None = None) -> Router:
    """The UI's routes. ``api_port``: None when the page calls the API on its own origin (same
    port), else the port it calls on the host the page was loaded from."""
    page = (STATIC_DIR / "index.html").read_bytes()
    headers = {
        "Content-Security-Policy": content_security_policy(api_port),
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }

    @get("/", include_in_schema=False, sync_to_thread=False)
    def ui_page() -> Response[bytes]:
        """The chat page."""
        return Response(page, media_type=MediaType.HTML, headers=headers)

    @get("/ui/config.json", include_in_schema=False, sync_to_thread=False)
    def ui_settings() -> dict[str, int | None]:
        """Where the page finds the API: ``{"api_port": null}`` means its own origin."""
        return {"api_port": api_port}

    assets = create_static_files_router(
        path="/ui", directories=[STATIC_DIR], name="ui-assets", include_in_schema=False
    )
    return Router(
        path="/", route_handlers=[ui_page, ui_settings, assets], guards=[limit_request_headers]
    )


def ui_route_handlers(ui: UiConfig | None) -> list[Router]:
    """What the API app adds for ``ServerConfig.ui``: the UI's routes when it is served on the
    API's own port, else nothing."""
    return [ui_router()] if ui is not None and ui.port is None else []
