"""GET /version, GET /metrics (Prometheus text) and GET /openapi.json."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from litestar import Request, Response, get

from jax_llm_runtime.api.protocol.openapi import documented
from jax_llm_runtime.api.service.metrics import CONTENT_TYPE, Metrics

DISTRIBUTION = "jax-llm-runtime"


def package_version() -> str:
    """The installed distribution's version; ``0+unknown`` when run from an uninstalled tree."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"


@get("/version", sync_to_thread=False, operation_class=documented())
def get_version() -> dict[str, str]:
    """``{"version": "<package version>"}``."""
    return {"version": package_version()}


@get("/metrics", sync_to_thread=False, media_type=CONTENT_TYPE, operation_class=documented())
def get_metrics(metrics: Metrics) -> Response[bytes]:
    """Every metric of this app in the Prometheus text exposition format."""
    return Response(metrics.render(), media_type=CONTENT_TYPE)


@get("/openapi.json", sync_to_thread=False, include_in_schema=False)
def get_openapi_json(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """The OpenAPI schema Litestar generates (also served under ``/schema``)."""
    return request.app.openapi_schema.to_schema()
