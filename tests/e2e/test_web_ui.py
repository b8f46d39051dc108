"""The web chat UI (``--ui-server``) in headless Chromium, against real ``runtime-serve`` processes.

The embedded SmolLM2 model streams real answers: a reply renders as it streams, the stop button
aborts a generation on the server and keeps the partial text, and conversations survive a reload.
The mock engine (fast to start) serves the rest: Markdown, highlighting, sanitizing and reasoning
from a canned stream, regenerate, the API key, and the UI on a port of its own.

``UI_SCREENSHOT=docs/ui.png`` makes the screenshot test write the README's picture there.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.browser import chromium
from tests.serve_process import running_server

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
TIMEOUT_MS = 120_000  # a busy 2-core machine may take a while for the first tokens
REPLY = ".message.assistant .content"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as browser:
        yield browser


def _root(url: str) -> str:
    return url.removesuffix("/v1")


@pytest.fixture(scope="module")
def smollm2_ui(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real server with the UI on its port; yields its root URL."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    args = ["--ui-server", "--max-model-len", "512", "--max-num-seqs", "2"]
    with running_server(args, log) as server:
        yield _root(server.url)
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def mock_ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with running_server(["--mock-engine", "--ui-server"], log) as server:
        yield _root(server.url)


class PageErrors:
    """Uncaught exceptions and console errors of a page, but for failed loads (a 401 is one)
    and messages a test declares expected (``allow``)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.allowed = ["Failed to load resource"]

    def watch(self, page: Page) -> None:
        page.on("pageerror", lambda error: self.errors.append(f"uncaught: {error}"))
        page.on("console", self._console)

    def allow(self, text: str) -> None:
        self.allowed.append(text)

    def _console(self, message) -> None:
        if message.type == "error":
            self.errors.append(f"console: {message.text}")

    def unexpected(self) -> list[str]:
        return [e for e in self.errors if not any(text in e for text in self.allowed)]


@pytest.fixture
def page_errors() -> PageErrors:
    return PageErrors()


@pytest.fixture
def page(browser: Browser, page_errors: PageErrors) -> Iterator[Page]:
    """A page in a fresh context (empty localStorage); fails on any unexpected script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page_errors.watch(page)
    yield page
    context.close()
    assert not page_errors.unexpected()


def reply_text(page: Page) -> str:
    return page.text_content(REPLY).strip()


def open_ui(page: Page, url: str, model: str = MODEL) -> None:
    page.goto(url + "/")
    page.wait_for_selector("#status[data-kind=ready]")
    assert page.text_content("#model-name") == model


def set_parameters(page: Page, **values: str) -> None:
    page.click("#toggle-settings")
    for field, value in values.items():
        page.fill(f"#{field}", value)
    page.click("#toggle-settings")


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_idle(page: Page) -> None:
    """Wait for the reply to end (sending starts streaming at once, before the first await).

    Predicates are function expressions: the page's CSP forbids eval, which Playwright uses to
    poll a bare expression."""
    page.wait_for_function("() => document.body.dataset.state === 'idle'")


def record_reply_lengths(page: Page) -> None:
    """Record, in the page, the reply's text length each time it changes while streaming."""
    page.evaluate(
        """() => {
        window.replyLengths = [];
        new MutationObserver(() => {
            const reply = document.querySelector('.message.assistant:last-child .content');
            if (document.body.dataset.state === 'streaming' && reply)
                window.replyLengths.push(reply.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true,
                                                         characterData: true});
    }"""
    )


def metrics(url: str) -> dict[str, float]:
    """Running requests and finished requests (all finish reasons) from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    finished = sum(s.value for s in samples if s.name == "runtime_request_success_total")
    running = [s.value for s in samples if s.name == "runtime_num_requests_running"]
    assert len(running) == 1, f"one served model, one running gauge: {running}"
    return {"finished": finished, "running": running[0]}


# ------------------------------------------------------------------ the real model


def test_a_reply_streams_in_and_the_conversation_survives_a_reload(
    page: Page, smollm2_ui: str
) -> None:
    open_ui(page, smollm2_ui)
    set_parameters(page, temperature="0", **{"max-tokens": "48"})
    record_reply_lengths(page)
    send(page, "Name the capital city of France.")
    page.wait_for_function("() => document.body.dataset.state === 'streaming'")
    wait_idle(page)
    answer = page.text_content(REPLY)
    assert "Paris" in answer
    lengths = page.evaluate("window.replyLengths")
    assert len(set(lengths)) >= 2, f"the reply did not render as it streamed: {lengths}"
    assert "tok/s" in page.text_content("#speed")
    assert "tokens" in page.text_content(".message.assistant .stats")

    page.reload()
    page.wait_for_selector("#status[data-kind=ready]")
    titles = page.locator("#conversations .open").all_text_contents()
    assert titles == ["Name the capital city of France."]
    assert page.text_content(REPLY) == answer  # the active conversation is shown again
    page.click("#new-chat")
    assert page.locator(".message").count() == 0
    page.click("#conversations .open")
    assert page.text_content(".message.user") == "Name the capital city of France."
    assert page.text_content(REPLY) == answer
    page.click("#conversations .delete")
    assert page.locator("#conversations li").count() == 0
    page.reload()
    page.wait_for_selector("#status[data-kind=ready]")
    assert page.locator("#conversations li").count() == 0


def test_stop_aborts_the_generation_and_keeps_the_partial_reply(
    page: Page, smollm2_ui: str
) -> None:
    open_ui(page, smollm2_ui)
    set_parameters(page, **{"max-tokens": "400"})
    before = metrics(smollm2_ui)
    send(page, "Write a long story about a dragon who learns to cook.")
    page.wait_for_function(
        f"() => document.querySelector('{REPLY}')?.textContent.length > 40"
        " && document.body.dataset.state === 'streaming'"
    )
    page.click("#stop")
    page.wait_for_function("() => document.body.dataset.state === 'idle'")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    partial = page.text_content(REPLY)
    assert len(partial) > 40
    assert "stopped" in page.text_content(".message.assistant .stats")

    deadline = time.monotonic() + 30
    while metrics(smollm2_ui)["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    after = metrics(smollm2_ui)
    assert after["running"] == 0, "the server still generates the stopped reply"
    assert after["finished"] == before["finished"], "the stopped reply ran to its end"
    time.sleep(0.5)
    assert page.text_content(REPLY) == partial  # nothing arrived after the stop

    page.reload()
    page.wait_for_selector("#status[data-kind=ready]")
    assert page.text_content(REPLY) == partial  # kept, marked stopped
    assert "stopped" in page.text_content(".message.assistant .stats")


def test_screenshot_of_a_conversation(page: Page, smollm2_ui: str, tmp_path: Path) -> None:
    open_ui(page, smollm2_ui)
    set_parameters(page, temperature="0", **{"max-tokens": "200"})
    send(page, "Write a haiku about the sea.")
    wait_idle(page)
    page.click("#new-chat")
    send(page, "Show me how to reverse a list in Python.")
    wait_idle(page)
    assert page.locator(f"{REPLY} pre code.hljs .hljs-keyword").count() >= 1  # highlighted
    assert page.locator("#conversations li").count() == 2
    page.click("#toggle-settings")
    path = tmp_path / "ui.png"
    page.screenshot(path=str(path))
    assert path.stat().st_size > 10_000
    if target := os.environ.get("UI_SCREENSHOT"):
        shutil.copyfile(path, target)


# ------------------------------------------------------------------ the mock engine

CANNED_STREAM = [
    {"delta": {"role": "assistant", "content": ""}},
    {"delta": {"reasoning_content": "The user wants a loop. "}},
    {"delta": {"reasoning_content": "Python is fine."}},
    {"delta": {"content": "Here is one:\n\n```python\nfor i in range(3):\n    print(i)\n```\n"}},
    {"delta": {"content": '\n<img src=x onerror="window.pwned=1"><script>window.pwned=2'}},
    {"delta": {"content": "</script> and a [link](https://example.com)."}},
    {"delta": {}, "finish_reason": "stop"},
]


def canned_sse() -> str:
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": MODEL}
    events = [{**chunk, "choices": [{"index": 0, **choice}]} for choice in CANNED_STREAM]
    events.append({"id": "c", "choices": [], "usage": {"completion_tokens": 6}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_markdown_highlighting_sanitizing_and_reasoning(
    page: Page, page_errors: PageErrors, mock_ui: str
) -> None:
    # Chromium reports the handler attribute against the page's CSP as soon as DOMPurify parses
    # it (in an inert document: nothing runs or loads); the DOM checks below are what count.
    page_errors.allow("Executing inline event handler violates")
    open_ui(page, mock_ui)
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, content_type="text/event-stream", body=canned_sse()
        ),
    )
    send(page, "Show me a loop")
    wait_idle(page)
    reasoning = page.locator(".message.assistant details.reasoning")
    assert reasoning.is_visible() and reasoning.get_attribute("open") is None  # collapsed
    assert page.text_content("details.reasoning summary") == "Reasoning"
    reasoning.locator("summary").click()
    assert page.text_content(".reasoning-body") == "The user wants a loop. Python is fine."
    code = page.locator(f"{REPLY} pre code.hljs")
    assert code.count() == 1 and code.locator(".hljs-keyword").count() >= 1
    assert "print(i)" in code.text_content()
    assert page.locator(f"{REPLY} script, {REPLY} [onerror]").count() == 0
    assert page.evaluate("window.pwned") is None
    link = page.locator(f"{REPLY} a[href='https://example.com']")
    assert link.get_attribute("rel") == "noopener noreferrer"
    assert "6 tokens" in page.text_content(".message.assistant .stats")


def test_regenerate_replaces_the_last_reply(page: Page, mock_ui: str) -> None:
    open_ui(page, mock_ui)
    posts: list[dict] = []

    def record(request) -> None:
        if request.url.endswith("/chat/completions"):
            posts.append(request.post_data_json)

    page.on("request", record)
    set_parameters(page, **{"system-prompt": "Be brief.", "top-p": "0.5", "top-k": "4"})
    send(page, "abc")
    wait_idle(page)
    assert reply_text(page) == "cba"  # the mock engine reverses the message
    page.click(".message.assistant .regenerate")
    wait_idle(page)
    assert page.locator(".message.assistant").count() == 1
    assert reply_text(page) == "cba"
    assert len(posts) == 2 and posts[0] == posts[1]
    body = posts[0]
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "abc"},
    ]
    assert (body["top_p"], body["top_k"], body["model"]) == (0.5, 4, MODEL)
    assert body["stream"] is True and "temperature" not in body


def test_api_key_is_asked_for_kept_and_sent(page: Page, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with running_server(["--mock-engine", "--ui-server", "--api-key", "sekrit"], log) as server:
        url = _root(server.url)
        page.goto(url + "/")
        page.wait_for_selector("#status[data-kind=error]")
        assert page.text_content("#model-name") == "API key needed"
        assert page.is_visible("#api-key")  # the parameters panel opened on the key
        page.fill("#api-key", "sekrit")
        page.press("#api-key", "Enter")
        page.wait_for_selector("#status[data-kind=ready]")
        send(page, "key")
        wait_idle(page)
        assert reply_text(page) == "yek"
        page.reload()
        page.wait_for_selector("#status[data-kind=ready]")  # the key was kept
        page.goto("about:blank")  # no open connection delays the server's stop


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ui_on_its_own_port_calls_the_api_port(page: Page, tmp_path: Path) -> None:
    api_port, ui_port = _free_port(), _free_port()
    args = ["--mock-engine", "--port", str(api_port), "--ui-port", str(ui_port)]
    with running_server(args, tmp_path / "server.log") as server:
        assert httpx.get(_root(server.url) + "/", timeout=10).status_code == 404
        open_ui(page, f"http://127.0.0.1:{ui_port}")  # GET /v1/models across origins
        send(page, "cross")
        wait_idle(page)
        assert reply_text(page) == "ssorc"
        page.goto("about:blank")


def _png(color: str) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(out, format="PNG")
    return out.getvalue()


DROP = """async (b64) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const files = new DataTransfer();
  files.items.add(new File([bytes], "blue.png", { type: "image/png" }));
  const drop = new DragEvent("drop", { dataTransfer: files, bubbles: true, cancelable: true });
  document.getElementById("composer").dispatchEvent(drop);
}"""


def test_images_picked_and_dropped_go_as_content_parts_and_stay_in_the_conversation(
    page: Page, mock_ui: str, tmp_path: Path
) -> None:
    # The mock model takes no images, so the chat route is answered here: the test checks what
    # the page sends (OpenAI's image_url parts) and shows, not a model's reading of them.
    import base64

    bodies: list[dict] = []
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": "Red, then blue."}, "finish_reason": "stop"}],
    }

    def answer(route) -> None:
        bodies.append(json.loads(route.request.post_data))
        sse = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=sse)

    page.route("**/v1/chat/completions", answer)
    open_ui(page, mock_ui)
    red, blue = _png("red"), _png("blue")
    (tmp_path / "red.png").write_bytes(red)
    page.set_input_files("#attach-input", str(tmp_path / "red.png"))
    page.wait_for_selector("#attachments .attachment img")
    page.evaluate(DROP, base64.b64encode(blue).decode())
    page.wait_for_function("() => document.querySelectorAll('#attachments img').length === 2")
    send(page, "Which colours?")
    wait_idle(page)

    (body,) = bodies
    content = body["messages"][-1]["content"]
    urls = [f"data:image/png;base64,{base64.b64encode(png).decode()}" for png in (red, blue)]
    assert content == [
        {"type": "image_url", "image_url": {"url": urls[0]}},
        {"type": "image_url", "image_url": {"url": urls[1]}},
        {"type": "text", "text": "Which colours?"},
    ]
    assert page.is_hidden("#attachments")
    shown = page.locator(".message.user .images img")
    assert [shown.nth(i).get_attribute("src") for i in range(2)] == urls
    assert reply_text(page) == "Red, then blue."

    page.reload()  # the images are part of the saved conversation
    page.wait_for_selector("#status[data-kind=ready]")
    assert page.locator(".message.user .images img").count() == 2
    # A file that is not an image is refused by name, and nothing is attached.
    (tmp_path / "notes.txt").write_text("not an image")
    page.set_input_files("#attach-input", str(tmp_path / "notes.txt"))
    page.wait_for_selector("#notice:not([hidden])")
    assert "notes.txt is not a PNG, JPEG, WebP or GIF image" in page.text_content("#notice")
    assert page.is_hidden("#attachments")
