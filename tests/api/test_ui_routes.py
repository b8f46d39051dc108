"""The web UI's routes, flags and packaged files (``--ui-server``, ``--ui-port``), in process.

The browser-side behaviour is tested in ``tests/e2e/test_web_ui.py``.
"""

from __future__ import annotations

import re
import socket
import time
from importlib.resources import files
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient

from jax_llm_runtime.api.app import create_app
from jax_llm_runtime.api.cli.serve import build_parser
from jax_llm_runtime.api.cli.service_flags import server_config
from jax_llm_runtime.api.service.settings import ServerConfig
from jax_llm_runtime.api.ui import STATIC_DIR
from jax_llm_runtime.api.ui.port_server import UiPortError, create_ui_app, start_ui_port
from jax_llm_runtime.api.ui.settings import UiConfig
from jax_llm_runtime.runtime.engine.mock import MockEngine

CONTENT_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
    ".html": "text/html",
}
VENDORED = ("marked.min.js", "purify.min.js", "highlight.min.js")


def _client(engine: MockEngine, **config: Any) -> TestClient[Any]:
    return TestClient(create_app(engine, config=ServerConfig(**config)))


def _assets(page: str) -> list[str]:
    return re.findall(r'(?:src|href)="(ui/[^"]+)"', page)


def test_without_the_flag_there_are_no_ui_routes(client: TestClient[Any]) -> None:
    for path in ("/", "/ui/config.json", "/ui/app.css", "/ui/js/main.js", "/ui/index.html"):
        assert client.get(path).status_code == 404, path


def test_the_page_and_every_asset_it_names_are_served(engine: MockEngine) -> None:
    with _client(engine, ui=UiConfig()) as client:
        page = client.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        policy = page.headers["content-security-policy"]
        assert "script-src 'self';" in policy and "connect-src 'self';" in policy
        assets = _assets(page.text)
        assert len(assets) == 8, assets  # icon, 3 styles, 3 libraries, the app's module
        modules = [f"ui/js/{path.name}" for path in (STATIC_DIR / "js").glob("*.js")]
        for asset in assets + modules:
            response = client.get(f"/{asset}")
            assert response.status_code == 200, asset
            suffix = asset[asset.rindex(".") :]
            assert response.headers["content-type"].startswith(CONTENT_TYPES[suffix]), asset
        assert client.get("/ui/config.json").json() == {"api_port": None}
        assert client.get("/ui/missing.js").status_code == 404
        assert client.get("/ui/../app.py").status_code == 404
        assert client.get("/v1/models").status_code == 200  # the API is still there


def test_every_module_the_scripts_import_exists() -> None:
    for script in (STATIC_DIR / "js").glob("*.js"):
        for name in re.findall(r'from "\./([\w.]+)"', script.read_text(encoding="utf-8")):
            assert (STATIC_DIR / "js" / name).is_file(), f"{script.name} imports {name}"


def test_the_page_needs_no_api_key_but_the_api_does(engine: MockEngine) -> None:
    with _client(engine, ui=UiConfig(), api_key="sekrit") as client:
        assert client.get("/").status_code == 200
        assert client.get("/ui/js/main.js").status_code == 200
        assert client.get("/v1/models").status_code == 401


def test_assets_ship_as_package_data_with_their_licences() -> None:
    static = files("jax_llm_runtime.api.ui") / "static"
    assert (static / "index.html").is_file()
    for name in (*VENDORED, "LICENSE.marked", "LICENSE.dompurify", "LICENSE.highlightjs"):
        assert (static / "vendor" / name).is_file(), name
    index = (static / "index.html").read_text(encoding="utf-8")
    assert "http://" not in index.replace("http://www.w3.org", "")  # nothing from the network
    assert "https://" not in index


# ----------------------------------------------------------------------------- flags


def _config(argv: list[str]) -> ServerConfig:
    return server_config(build_parser().parse_args(argv))


def test_ui_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNTIME_UI_SERVER", raising=False)
    assert _config([]).ui is None
    assert _config(["--ui-server"]).ui == UiConfig()
    separate = _config(["--port", "2000", "--ui-port", "2001"])
    assert separate.ui == UiConfig(port=2001, api_port=2000)
    assert separate.allowed_origins == ("http://*:2001", "https://*:2001")


@pytest.mark.parametrize(
    ("value", "expected"), [("1", UiConfig()), ("TRUE", UiConfig()), ("0", None), ("", None)]
)
def test_ui_server_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: UiConfig | None
) -> None:
    monkeypatch.setenv("RUNTIME_UI_SERVER", value)
    assert _config([]).ui == expected


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--port", "0", "--ui-port", "2001"], "", "fixed --port"),
        (["--port", "2001", "--ui-port", "2001"], "", "must differ"),
        (["--ui-port", "70000"], "", "1..65535"),
        ([], "maybe", "RUNTIME_UI_SERVER"),
    ],
)
def test_bad_ui_settings_are_errors(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: str, needle: str
) -> None:
    monkeypatch.setenv("RUNTIME_UI_SERVER", env)
    with pytest.raises(ValueError, match=needle):
        _config(argv)


# ----------------------------------------------------------------------------- --ui-port


def test_the_ui_port_app_serves_only_the_ui() -> None:
    with TestClient(create_ui_app(api_port=2000)) as client:
        page = client.get("/")
        assert page.status_code == 200
        policy = page.headers["content-security-policy"]
        assert "connect-src 'self' http://*:2000 https://*:2000;" in policy
        assert client.get("/ui/config.json").json() == {"api_port": 2000}
        assert client.get("/ui/app.css").status_code == 200
        for path in ("/v1/models", "/health", "/metrics"):
            assert client.get(path).status_code == 404, path


def test_the_api_port_accepts_the_ui_ports_origin_only(engine: MockEngine) -> None:
    ui = UiConfig(port=2001, api_port=2000)
    with _client(engine, ui=ui, allowed_origins=ui.cors_origins()) as client:
        assert client.get("/").status_code == 404  # the page lives on the UI's port
        for origin, allowed in [
            ("http://box.local:2001", True),
            ("https://10.0.0.7:2001", True),
            ("http://box.local:2002", False),
        ]:
            response = client.get("/v1/models", headers={"Origin": origin})
            assert (response.headers.get("access-control-allow-origin") == origin) is allowed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_start_ui_port_serves_the_page_and_reports_a_taken_port() -> None:
    assert start_ui_port("127.0.0.1", UiConfig()) is None  # the UI is on the API's port
    port = _free_port()
    server = start_ui_port("127.0.0.1", UiConfig(port=port, api_port=1))
    assert server is not None
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).status_code == 200
        with pytest.raises(UiPortError, match=f"127.0.0.1:{port}"):
            start_ui_port("127.0.0.1", UiConfig(port=port, api_port=1))
    finally:
        server.should_exit = True
