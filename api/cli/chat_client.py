"""``runtime-chat``: an interactive, streaming terminal chat with any OpenAI-compatible server.

1. Load ``.env`` (``api.cli.env_file``), parse the flags, and pick the model: ``--model``, else the
   first of the server's ``GET /v1/models``.
2. Each line typed is a user turn: the whole history (``--system`` first) goes to
   ``POST /v1/chat/completions`` with ``stream: true``; the reply's ``content`` deltas are printed
   as they arrive, its ``reasoning_content`` deltas apart (labelled, and dimmed on a terminal).
3. The reply joins the history. ``/reset`` clears it; ``/exit``, ``/quit`` or Ctrl+D quit.
   Ctrl+C during a reply closes the stream (the server aborts the request) and starts a new chat.

Only ``httpx`` is used; the server-sent events are parsed here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn, TextIO

import httpx

from jax_llm_runtime.api.cli.env_file import load_env_file

PROG = "runtime-chat"
DEFAULT_URL = "http://127.0.0.1:2000/v1"
API_KEY_ENV = "RUNTIME_API_KEY"  # the variable runtime-serve reads its key from, too
NO_COLOR_ENV = "NO_COLOR"  # https://no-color.org: set (to anything) for plain output
REASONING_LABEL = "[thinking] "
_DIM, _RESET = "\x1b[2m", "\x1b[0m"
_TIMEOUT = httpx.Timeout(30.0, read=None)  # a reply may pause for long between tokens
EXIT_COMMANDS = ("/exit", "/quit")
HELP = "/reset clears the history, /exit or Ctrl+D quits, Ctrl+C stops a reply"


class ChatError(RuntimeError):
    """The server refused a request or sent an error; the message is the server's."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every flag's help states its default."""
    parser = _Parser(
        prog=PROG,
        description=f"Chat with an OpenAI-compatible server in the terminal ({HELP}).",
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--url", default=DEFAULT_URL, help="the server's API base URL (default: %(default)s)")
    add(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"bearer token (default: ${API_KEY_ENV}, else none)",
    )
    add(
        "--port",
        type=int,
        default=None,
        help="the server's port on localhost, as candle-vllm's examples/chat.py takes it "
        "(sets --url to http://localhost:PORT/v1)",
    )
    add("--model", default=None, help="model name (default: the first of GET /models)")
    add(
        "--system",
        "--system_prompt",
        dest="system",
        default=None,
        help="a system message that opens every chat (default: none)",
    )
    add("--temperature", type=float, default=None, help="(default: the server's)")
    # candle-vllm's examples/chat.py spells these with underscores; both spellings work.
    for flag, kind in SAMPLING_FLAGS:
        dest = flag.replace("-", "_")
        add(
            f"--{flag}",
            f"--{dest}",
            dest=dest,
            type=kind,
            default=None,
            help="(default: the server's)",
        )
    add(
        "--thinking",
        type=_bool,
        default=None,
        help="true/false: a reasoning model thinks first or not (the request's enable_thinking; "
        "default: the model's template)",
    )
    # examples/chat.py's display options; replies here always stream as plain text.
    add("--stream", action="store_true", help="accepted for candle-vllm's chat.py; always on")
    add("--live", action="store_true", help=argparse.SUPPRESS)
    add("--frequency", type=int, default=None, help=argparse.SUPPRESS)
    add("--context_cache", type=_bool, default=None, help=argparse.SUPPRESS)
    return parser


# (flag, type) of the sampling settings sent with every turn when given.
SAMPLING_FLAGS = (
    ("top-p", float),
    ("top-k", int),
    ("min-p", float),
    ("max-tokens", int),
    ("frequency-penalty", float),
    ("presence-penalty", float),
    ("repeat-last-n", int),
)


def _bool(text: str) -> bool:
    """click's spellings of a boolean option value."""
    value = text.strip().lower()
    if value in ("1", "true", "t", "yes", "y", "on"):
        return True
    if value in ("0", "false", "f", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class ReplyRenderer:
    """Prints one streamed reply: reasoning labelled (and dimmed when ``color``), then content.

    Call ``reasoning``/``content`` with each delta's text in arrival order and ``end`` once.
    """

    def __init__(self, out: TextIO, color: bool) -> None:
        self._out = out
        self._color = color
        self._section: str | None = None  # "reasoning" or "content", once something printed

    def reasoning(self, text: str) -> None:
        if not text:
            return
        if self._section != "reasoning":
            if self._section is not None:
                self._out.write("\n")
            text = REASONING_LABEL + text
            self._section = "reasoning"
        self._write(f"{_DIM}{text}{_RESET}" if self._color else text)

    def content(self, text: str) -> None:
        if not text:
            return
        if self._section == "reasoning":
            self._out.write("\n")
        self._section = "content"
        self._write(text)

    def end(self) -> None:
        """Finish the reply's line (and any dimming a Ctrl+C cut short)."""
        self._write(f"{_RESET}\n" if self._color else "\n")

    def _write(self, text: str) -> None:
        self._out.write(text)
        self._out.flush()


def sse_data(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream's ``data:`` lines, up to ``[DONE]``.

    Raises ChatError for an ``error`` event (a failure after the stream started)."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        payload = json.loads(data)
        if "error" in payload:
            raise ChatError(_error_message(payload))
        yield payload


def _error_message(payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return json.dumps(payload)[:500]


class ChatSession:
    """The conversation and the HTTP client of one ``runtime-chat`` run."""

    def __init__(
        self, client: httpx.Client, model: str, args: argparse.Namespace, out: TextIO, color: bool
    ) -> None:
        self._client = client
        self._model = model
        self._system = args.system
        names = ["temperature", *(flag.replace("-", "_") for flag, _ in SAMPLING_FLAGS)]
        self._sampling: dict[str, Any] = {
            name: value for name in names if (value := getattr(args, name)) is not None
        }
        if args.thinking is not None:
            self._sampling["chat_template_kwargs"] = {"enable_thinking": args.thinking}
        self._out = out
        self._color = color
        self.history: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Forget every turn; the system message stays."""
        self.history = [{"role": "system", "content": self._system}] if self._system else []

    def send(self, text: str) -> None:
        """One user turn: stream the reply to the terminal and keep it in the history.

        Ctrl+C stops the reply and starts a new chat; a server error leaves the history as it
        was before the turn.
        """
        self.history.append({"role": "user", "content": text})
        renderer = ReplyRenderer(self._out, self._color)
        try:
            reply = self._stream(renderer)
        except KeyboardInterrupt:
            renderer.end()
            self._drop_connections()
            self.reset()
            self._out.write("[reply stopped; starting a new chat]\n")
            return
        except (ChatError, httpx.HTTPError, json.JSONDecodeError) as exc:
            renderer.end()
            self.history.pop()
            self._out.write(f"[error: {exc}]\n")
            return
        renderer.end()
        self.history.append({"role": "assistant", "content": reply})

    def _drop_connections(self) -> None:
        """Close every connection, so the server sees the interrupted stream end and aborts it
        (an interrupt inside a socket read can leave the half-read connection pooled), and go
        on with a fresh client."""
        old = self._client
        old.close()
        self._client = httpx.Client(base_url=old.base_url, headers=old.headers, timeout=old.timeout)

    def close(self) -> None:
        self._client.close()

    def _stream(self, renderer: ReplyRenderer) -> str:
        body = {"model": self._model, "messages": self.history, "stream": True, **self._sampling}
        parts: list[str] = []
        with self._client.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise ChatError(f"HTTP {response.status_code}: {_response_error(response)}")
            for chunk in sse_data(response.iter_lines()):
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    renderer.reasoning(delta.get("reasoning_content") or "")
                    text = delta.get("content") or ""
                    renderer.content(text)
                    parts.append(text)
        return "".join(parts)


def _response_error(response: httpx.Response) -> str:
    try:
        return _error_message(response.json())
    except json.JSONDecodeError:
        return response.text[:500]


def first_model(client: httpx.Client) -> str:
    """The first model id of ``GET /models``; ChatError when there is none."""
    response = client.get("/models")
    if response.status_code != 200:
        raise ChatError(f"GET /models: HTTP {response.status_code}: {_response_error(response)}")
    models = response.json().get("data") or []
    if not models:
        raise ChatError("the server lists no models; pass --model")
    return str(models[0]["id"])


def _color(out: TextIO) -> bool:
    return out.isatty() and NO_COLOR_ENV not in os.environ


def _read_line(prompt: str) -> str | None:
    """The next input line; None at end of input (Ctrl+D)."""
    try:
        return input(prompt)
    except EOFError:
        return None


def run_chat(session: ChatSession, out: TextIO) -> None:
    """Read turns until ``/exit`` or end of input."""
    while True:
        try:
            line = _read_line("> ")
        except KeyboardInterrupt:  # at the prompt: there is no reply to stop
            out.write(f"\n[{HELP}]\n")
            continue
        if line is None:
            out.write("\n")
            return
        text = line.strip()
        if text in EXIT_COMMANDS:
            return
        if text == "/reset":
            session.reset()
            out.write("[history cleared]\n")
        elif text:
            session.send(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``runtime-chat``; returns the process exit status."""
    try:
        load_env_file()
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    if args.port is not None:
        args.url = f"http://localhost:{args.port}/v1"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    out = sys.stdout
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=_TIMEOUT) as client:
        try:
            model = args.model or first_model(client)
        except (ChatError, httpx.HTTPError, json.JSONDecodeError) as exc:
            print(f"{PROG}: error: {args.url}: {exc}", file=sys.stderr)
            return 1
        out.write(f"Chatting with {model} at {args.url} ({HELP}).\n")
        session = ChatSession(client, model, args, out, _color(out))
        try:
            run_chat(session, out)
        finally:
            session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
