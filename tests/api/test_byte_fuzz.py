"""Byte-level fuzzing of a real ``runtime-serve --mock-engine`` process, beside the schema fuzzing.

``tests.api.test_openapi_fuzz`` sends what the OpenAPI document describes; this file sends what
no schema describes. A seeded generator (``random.Random(SEED)``: every run sends the same bytes)
starts from valid bodies for each body route and breaks them: flipped bits, invalid UTF-8,
truncation, lone surrogate escapes, NaN/Infinity literals, numbers past 64 bits or past a double,
nesting 10,000 levels deep, duplicate keys, strings around the body cap, junk, other encodings,
and every content type (or none). ``CASES`` bodies go out in ``BATCHES`` over ``CLIENTS``
keep-alive connections at once. Every answer must come within ``RESPONSE_TIMEOUT_S``, be below 500,
and an error must be the OpenAI envelope; after each batch ``/health`` must be 200 and a plain chat
must succeed, and at the end the server must have logged no error.

Below the bodies, raw sockets: pipelined requests, chunked bodies (valid and malformed), a body
shorter than its Content-Length, garbage instead of HTTP, header floods, and slow senders, which
``--request-read-timeout`` (``api.cli.http_protocol``) cuts off with a 408 while other clients are
served. Each ends in a 4xx envelope or a closed connection, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.serve_process import ServerProcess, running_server

# Each test (the fuzz run, about 15 s on two cores, included) fails instead of stalling CI.
pytestmark = pytest.mark.timeout(120)

SEED = 20261125
CASES = 10_000
BATCHES = 10
CLIENTS = 4  # keep-alive connections sending at once
RESPONSE_TIMEOUT_S = 10.0  # for one answer: a hang fails the case instead of stalling the run
BODY_CAP = 64 * 1024  # --max-request-body-bytes, small so bodies around the cap are cheap to send
READ_TIMEOUT_S = 3.0  # --request-read-timeout: how long a slow sender may take over one request
DEPTHS = (10_000, 900, 500, 200)  # nesting levels: past and below the recursion limit
ENVELOPE_KEYS = {"message", "type", "param", "code"}
HELLO = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}

VALID_BODIES: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [
        HELLO,
        {
            "model": "mock",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "héllo ✓"}]},
            ],
            "temperature": 0.5,
            "top_p": 0.9,
            "max_tokens": 4,
            "stop": ["x"],
            "seed": 7,
        },
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4},
        {
            "messages": [{"role": "user", "content": "call"}],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object"}},
                }
            ],
            "max_tokens": 4,
            "logit_bias": {"5": 1.5},
        },
    ],
    "/v1/completions": [
        {"prompt": "once upon", "max_tokens": 4},
        {"prompt": ["a", "b"], "max_tokens": 2, "logprobs": 1, "n": 2},
        {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True},
    ],
    "/v1/embeddings": [
        {"input": "hello"},
        {"input": ["a", "b"], "encoding_format": "base64"},
        {"input": [1, 2, 3], "pooling": "last", "normalize": False},
    ],
    "/v1/responses": [
        {"input": "hello", "max_output_tokens": 4},
        {
            "input": [{"role": "user", "content": "hi"}],
            "instructions": "be brief",
            "max_output_tokens": 4,
            "store": False,
        },
    ],
    "/tokenize": [
        {"prompt": "hello"},
        {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    ],
}
ROUTES = tuple(VALID_BODIES)

JSON = "application/json"
CONTENT_TYPES: tuple[str | None, ...] = (
    None,
    "",
    "text/plain",
    "text/plain; charset=utf-8",
    "multipart/form-data; boundary=xyz",
    "multipart/form-data",
    "application/x-www-form-urlencoded",
    "application/octet-stream",
    "application/xml",
    "application/json; charset=latin-1",
    "application/json; charset=utf-16",
    "application/json; boundary=",
    "application/jsonx",
    "APPLICATION/JSON",
    "*/*",
    "text/event-stream",
    "image/png",
    ";;;",
)
SPECIAL_NUMBERS = (
    b"NaN",
    b"-NaN",
    b"Infinity",
    b"-Infinity",
    b"inf",
    b"18446744073709551616",  # 2**64
    b"-9223372036854775809",  # -2**63 - 1
    b"340282366920938463463374607431768211456",  # 2**128
    b"1e400",
    b"-1e400",
    b"1e-400",
    b"1" + b"0" * 5000,
    b"0x10",
    b"01",
    b"+1",
    b".5",
    b"1.",
    b"1e",
    b"-",
    b"1_000",
)
BAD_STRINGS = (
    rb'"\ud800"',
    rb'"\udfff"',
    rb'"a\ud800b"',
    rb'"\udc00\ud800"',
    rb'"\ud800\u0041"',
    rb'"\u0000"',
    rb'"\x41"',
    rb'"\u12"',
    rb'"\uZZZZ"',
    b'"\x00\x01\x1f"',  # raw control characters
    b'"\xed\xa0\x80"',  # a surrogate encoded as UTF-8
    b'"\xc0\xaf"',  # an overlong encoding
    b'"\xf4\x90\x80\x80"',  # past U+10FFFF
    b'"\xe2\x82"',  # a cut multi-byte sequence
    b'"\xff\xfe"',
    b'"unterminated',
)
INVALID_UTF8 = (b"\xff", b"\xfe", b"\xc0", b"\xc1", b"\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\xf8")
FRAGMENTS = (
    b"null",
    b"true",
    b"[]",
    b"{}",
    b"[null]",
    b'{"": null}',
    b'""',
    b"-0",
    b"1e308",
    b'[1, "a", {}, [], null]',
    b'{"role": "user"}',
    b",",
    b"]",
    b"}",
    b":",
    b"[",
    b"{",
)


@dataclass(frozen=True)
class Case:
    route: str
    body: bytes
    content_type: str | None = JSON
    kind: str = ""


def _valid_bytes(rng: random.Random, route: str) -> bytes:
    return json.dumps(rng.choice(VALID_BODIES[route]), ensure_ascii=False).encode()


def _flip_bits(rng: random.Random, body: bytes) -> bytes:
    data = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


def _insert_bytes(rng: random.Random, body: bytes) -> bytes:
    at = rng.randrange(len(body) + 1)
    return body[:at] + rng.choice(INVALID_UTF8) * rng.randint(1, 3) + body[at:]


def _truncate(rng: random.Random, body: bytes) -> bytes:
    return body[: rng.randrange(len(body))]


def _value_spans(body: bytes) -> list[tuple[int, int]]:
    """The byte spans of the scalar values (strings, numbers, literals) after each ``":"``."""
    spans = []
    for at in range(len(body) - 1):
        if body[at : at + 2] != b": ":
            continue
        start = at + 2
        if body[start : start + 1] in (b"[", b"{"):
            continue
        end = start + 1
        if body[start : start + 1] == b'"':
            while end < len(body) and body[end : end + 1] != b'"':
                end += 2 if body[end : end + 1] == b"\\" else 1
            end += 1
        else:
            while end < len(body) and body[end : end + 1] not in (b",", b"}", b"]"):
                end += 1
        spans.append((start, end))
    return spans


def _replace_value(rng: random.Random, body: bytes, choices: tuple[bytes, ...]) -> bytes:
    spans = _value_spans(body)
    if not spans:
        return body + rng.choice(choices)
    start, end = rng.choice(spans)
    return body[:start] + rng.choice(choices) + body[end:]


def _deep(rng: random.Random, body: bytes) -> bytes:
    opener, closer = rng.choice(((b"[", b"]"), (b'{"a":', b"}"), (b'{"content":[', b"]}")))
    closed = rng.random() < 0.5
    depth = rng.choice(DEPTHS)
    nest = opener * depth + b"1" + (closer * depth if closed else b"")
    if rng.random() < 0.3:
        return nest
    return _replace_value(rng, body, (nest,))


def _duplicate_keys(rng: random.Random, body: bytes) -> bytes:
    try:
        obj = json.loads(body)
    except ValueError:  # already broken by an earlier mutation
        return b'{"model": "a", ' + body[1:]
    if not isinstance(obj, dict) or not obj:
        return body
    key = rng.choice(list(obj))
    again = json.dumps({key: rng.choice((obj[key], None, "x", 1, [], {}))})[1:-1].encode()
    head, tail = body[:-1], body[-1:]
    return head + b", " + again + tail if rng.random() < 0.5 else b"{" + again + b", " + body[1:]


def _huge_string(rng: random.Random, body: bytes) -> bytes:
    # Around the cap: some just under (a valid long prompt or an over-long one), some just over.
    target = BODY_CAP + rng.randint(-64, 64)
    filler = rng.choice((b"a", b"\\u00e9", "é".encode(), b" "))
    text = filler * max(0, (target - len(body)) // len(filler))
    return _replace_value(rng, body, (b'"' + text + b'"',))


def _junk(rng: random.Random, _: bytes) -> bytes:
    return rng.randbytes(rng.randint(0, 256))


def _reencode(rng: random.Random, body: bytes) -> bytes:
    text = body.decode(errors="surrogateescape")
    return rng.choice(
        (
            b"\xef\xbb\xbf" + body,  # a UTF-8 byte order mark
            text.encode("utf-16", errors="surrogatepass"),
            text.encode("utf-32-le", errors="surrogatepass"),
            text.encode("latin-1", errors="replace"),
            b"",
            b" \t\r\n ",
            b"[" + body + b"]",
            json.dumps(text).encode(),  # the body as one JSON string
            body + b"\x00",
            body + body,
            b"\x00" + body,
            b"1",
            b"null",
        )
    )


MUTATIONS: dict[str, Callable[[random.Random, bytes], bytes]] = {
    "flip": _flip_bits,
    "utf8": _insert_bytes,
    "truncate": _truncate,
    "surrogate": lambda rng, body: _replace_value(rng, body, BAD_STRINGS),
    "number": lambda rng, body: _replace_value(rng, body, SPECIAL_NUMBERS),
    "fragment": lambda rng, body: _replace_value(rng, body, FRAGMENTS),
    "deep": _deep,
    "duplicate": _duplicate_keys,
    "huge": _huge_string,
    "junk": _junk,
    "encoding": _reencode,
}


def generate_cases(seed: int, count: int) -> list[Case]:
    """``count`` cases, the same for the same seed: mostly one mutation of a valid body, some
    two, and some a valid or mutated body under another content type."""
    rng = random.Random(seed)
    names = sorted(MUTATIONS)
    cases = []
    for _ in range(count):
        route = rng.choice(ROUTES)
        body = _valid_bytes(rng, route)
        kinds = [rng.choice(names) for _ in range(1 if rng.random() < 0.8 else 2)]
        if "huge" in kinds or "deep" in kinds:
            kinds = kinds[:1]  # keep the large ones whole, so they are what the case is about
        for kind in kinds:
            body = MUTATIONS[kind](rng, body) if body else body
        content_type = JSON
        if rng.random() < 0.15:
            content_type = rng.choice(CONTENT_TYPES)
            kinds.append("content-type")
        cases.append(Case(route, body, content_type, "+".join(kinds)))
    return cases


def envelope_problem(status: int, body: bytes) -> str | None:
    """Why a response breaks the rules (a 5xx, or an error that is not the envelope); None if not."""
    if status >= 500:
        return f"status {status}"
    if status < 400:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return f"status {status} with a body that is not JSON: {body[:200]!r}"
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return f"status {status} without the envelope: {payload!r:.200}"
    error = payload["error"]
    if not isinstance(error, dict) or set(error) != ENVELOPE_KEYS:
        return f"status {status} with error keys {sorted(error)!r}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"status {status} without a message: {error!r:.200}"
    return None


@dataclass
class FuzzLog:
    statuses: Counter[int] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    slowest_s: float = 0.0

    @property
    def cases(self) -> int:
        return sum(self.statuses.values()) + len(self.failures)


async def _send(client: httpx.AsyncClient, case: Case, log: FuzzLog) -> None:
    headers = {} if case.content_type is None else {"content-type": case.content_type}
    started = time.monotonic()
    try:
        reply = await client.post(case.route, content=case.body, headers=headers)
    except httpx.HTTPError as exc:
        log.failures.append(
            f"{case.kind} {case.route}: {type(exc).__name__} {exc} {case.body[:120]!r}"
        )
        return
    log.slowest_s = max(log.slowest_s, time.monotonic() - started)
    log.statuses[reply.status_code] += 1
    log.kinds[case.kind.split("+")[0]] += 1
    if problem := envelope_problem(reply.status_code, reply.content):
        log.failures.append(f"{case.kind} {case.route}: {problem}; sent {case.body[:120]!r}")


async def _send_all(client: httpx.AsyncClient, cases: list[Case], log: FuzzLog) -> None:
    queue = iter(cases)

    async def worker() -> None:
        for case in queue:
            await _send(client, case, log)

    await asyncio.gather(*(worker() for _ in range(CLIENTS)))


async def _check_healthy(client: httpx.AsyncClient) -> None:
    health = await client.get("/health")
    assert health.status_code == 200, health.text
    reply = await client.post("/v1/chat/completions", json=HELLO)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "olleh"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``runtime-serve --mock-engine`` with a small body cap and a short read deadline; its log
    must hold no error."""
    log = tmp_path_factory.mktemp("byte_fuzz") / "server.log"
    args = [
        "--mock-engine",
        "--served-model-name",
        "mock",
        "--log-level",
        "warn",
        "--max-request-body-bytes",
        str(BODY_CAP),
        "--request-read-timeout",
        str(READ_TIMEOUT_S),
    ]
    with running_server(args, log, stop_timeout=15) as process:
        yield process
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]


def test_the_generator_is_deterministic_and_covers_every_mutation() -> None:
    first, again = generate_cases(SEED, 500), generate_cases(SEED, 500)
    assert first == again
    assert first != generate_cases(SEED + 1, 500)
    kinds = {part for case in first for part in case.kind.split("+")}
    assert kinds == {*MUTATIONS, "content-type"}
    assert {case.route for case in first} == set(ROUTES)


@pytest.mark.e2e
async def test_mutated_bodies_get_no_5xx_and_errors_keep_the_envelope(
    server: ServerProcess,
) -> None:
    cases = generate_cases(SEED, CASES)
    log = FuzzLog()
    base_url = server.url.removesuffix("/v1")
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    started = time.monotonic()
    async with httpx.AsyncClient(
        base_url=base_url, timeout=RESPONSE_TIMEOUT_S, limits=limits
    ) as client:
        size = len(cases) // BATCHES
        for batch in range(BATCHES):
            await _send_all(client, cases[batch * size : (batch + 1) * size], log)
            assert not log.failures, log.failures[:20]
            await _check_healthy(client)
    wall_s = time.monotonic() - started
    print(
        f"\nbyte fuzz: {log.cases} cases in {wall_s:.1f}s over {CLIENTS} connections, "
        f"slowest answer {log.slowest_s:.2f}s; statuses {sorted(log.statuses.items())}; "
        f"first mutation {sorted(log.kinds.items())}"
    )
    assert log.cases == CASES
    assert not [status for status in log.statuses if status >= 500]
    # The mutations reach past validation and are also refused.
    assert log.statuses[200] and log.statuses[400] and log.statuses[413], log.statuses


# ------------------------------------------------------------------------ protocol level: raw bytes

HELLO_BYTES = json.dumps(HELLO).encode()


def _request(path: str, body: bytes, *headers: bytes) -> bytes:
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: fuzz", *headers]
    if not any(h.lower().startswith(b"transfer-encoding") for h in headers):
        head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


@dataclass
class Reply:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def _read_reply(reader: asyncio.StreamReader) -> Reply | None:
    """One HTTP/1.1 response (a Content-Length or a chunked body); None at end of stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        assert not exc.partial, f"a partial response: {exc.partial!r}"
        return None
    status_line, *lines = head[:-4].split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
    else:
        body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return Reply(int(status_line.split()[1]), headers, body)


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (reading nothing more) within a few seconds."""
    try:
        return await asyncio.wait_for(reader.read(1), RESPONSE_TIMEOUT_S) == b""
    except ConnectionResetError:
        return True


def _assert_envelope(reply: Reply, status: int | None = None) -> dict[str, Any]:
    assert 400 <= reply.status < 500, (reply.status, reply.body[:300])
    assert status is None or reply.status == status, (reply.status, reply.body[:300])
    assert envelope_problem(reply.status, reply.body) is None, reply.body[:300]
    return reply.json()["error"]


async def _send_raw(server: ServerProcess, data: bytes, *, end: bool = False) -> Reply | None:
    """Send ``data`` on a fresh connection (then half-close it when ``end``) and read one reply;
    a 4xx must be the envelope, and the server must keep serving."""
    reader, writer = await asyncio.open_connection(*_address(server))
    try:
        try:
            writer.write(data)
            await writer.drain()
            if end:
                writer.write_eof()
        except ConnectionError:  # the server refused the request before it was all sent
            pass
        try:
            reply = await asyncio.wait_for(_read_reply(reader), RESPONSE_TIMEOUT_S)
        except (ConnectionError, asyncio.IncompleteReadError):
            # A server that answers and closes while request bytes it did not read are still
            # in its socket makes the kernel send a reset, which can discard the reply's tail
            # before it is read (seen under load); or it closes while the rest of a flood is
            # still being written, and the write's broken pipe surfaces on the read: a closed
            # connection either way.
            reply = None
    finally:
        writer.close()
    if reply is not None and reply.status >= 400:
        _assert_envelope(reply)
    return reply


def _address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    return host, int(port)


async def _assert_serving(server: ServerProcess) -> None:
    async with httpx.AsyncClient(
        base_url=server.url.removesuffix("/v1"), timeout=RESPONSE_TIMEOUT_S
    ) as client:
        await _check_healthy(client)


@pytest.mark.e2e
async def test_pipelined_requests_are_answered_in_order(server: ServerProcess) -> None:
    reader, writer = await asyncio.open_connection(*_address(server))
    tokenize = json.dumps({"prompt": "abc"}).encode()
    writer.write(
        _request("/v1/chat/completions", HELLO_BYTES, b"Content-Type: application/json")
        + _request("/tokenize", tokenize)
        + _request("/v1/embeddings", b'{"input": "\xff"}')
    )
    chat, tokens, embedding = [await asyncio.wait_for(_read_reply(reader), 10) for _ in range(3)]
    writer.close()
    assert (
        chat and chat.status == 200 and chat.json()["choices"][0]["message"]["content"] == "olleh"
    )
    assert (
        tokens and tokens.status == 200 and tokens.json()["count"] == len(tokens.json()["tokens"])
    )
    assert embedding and "JSON" in _assert_envelope(embedding, 400)["message"]


@pytest.mark.e2e
async def test_chunked_bodies(server: ServerProcess) -> None:
    chunked = b"Transfer-Encoding: chunked"
    pieces = [HELLO_BYTES[:7], HELLO_BYTES[7:8], HELLO_BYTES[8:]]
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    reply = await _send_raw(server, _request("/v1/chat/completions", body, chunked))
    assert reply and reply.status == 200, reply
    assert reply.json()["choices"][0]["message"]["content"] == "olleh"

    malformed = (
        b"zz\r\nabc\r\n0\r\n\r\n",  # a size that is not hex
        b"5\r\nabc\r\n0\r\n\r\n",  # a chunk shorter than its size
        b"ffffffffffffffffffff\r\n{}",  # a size past any cap
        b"3\r\n{}}XX0\r\n\r\n",  # no CRLF after the chunk
    )
    for body in malformed:
        reply = await _send_raw(server, _request("/v1/chat/completions", body, chunked), end=True)
        assert reply is None or reply.status in (400, 413), (body, reply)
    await _assert_serving(server)


@pytest.mark.e2e
async def test_a_body_shorter_than_its_content_length_then_close(server: ServerProcess) -> None:
    """The client promises more than it sends and half-closes: no answer, no error logged."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: fuzz\r\nContent-Length: 1000\r\n\r\n"
    assert await _send_raw(server, head + HELLO_BYTES, end=True) is None
    assert await _send_raw(server, head, end=True) is None
    await _assert_serving(server)


GARBAGE = (
    b"\x00\xff GARBAGE\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: fuzz\r\nno colon here\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: fuzz\r\nX: a\x00b\r\n\r\n",
    b"GET /\x7f\x80 HTTP/1.1\r\nHost: fuzz\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # the HTTP/2 preface
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: fuzz\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: fuzz\r\nContent-Length: 1e3\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: fuzz\r\nContent-Length: 99999999999999999999\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: fuzz\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: fuzz\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: fuzz\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 3\r\n\r\n0\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.0\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\n\r\n",  # no Host
    b"GET / HTTP/1.1\r\nHost: fuzz\r\n Folded: header\r\n\r\n",
    b"G\xc3\x89T / HTTP/1.1\r\nHost: fuzz\r\n\r\n",
    b"GET http://[::1 HTTP/1.1\r\nHost: fuzz\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: fuzz\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
    b"\r\n" * 20 + b"GET /health HTTP/1.1\r\nHost: fuzz\r\n\r\n",
)


@pytest.mark.e2e
async def test_protocol_garbage_is_a_4xx_envelope_or_a_closed_connection(
    server: ServerProcess,
) -> None:
    rng = random.Random(SEED)
    junk = [rng.randbytes(rng.randint(1, 2000)) for _ in range(20)]
    replies: Counter[int | None] = Counter()
    for data in (*GARBAGE, *junk):
        reply = await _send_raw(server, data, end=True)
        assert reply is None or reply.status < 500, (data, reply)
        replies[reply and reply.status] += 1
    print(f"\nprotocol garbage: {sorted(replies.items(), key=str)}")
    await _assert_serving(server)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "headers",
    [
        pytest.param([b"X-Many-%d: %s" % (i, b"v" * 50) for i in range(200)], id="200-headers"),
        pytest.param([b"X-Big: " + b"v" * 12_000], id="one-12k-header"),
        pytest.param([b"X-%d: v" % i for i in range(20_000)], id="20k-headers"),
        pytest.param([b"X-Huge: " + b"v" * 2**20], id="one-1m-header"),
    ],
)
async def test_header_floods_are_refused(server: ServerProcess, headers: list[bytes]) -> None:
    """Heads that arrive whole reach the 431 guard; larger ones are refused (a 400 or 431
    envelope) or cut off by uvicorn before it buffers them."""
    reply = await _send_raw(server, _request("/v1/chat/completions", HELLO_BYTES, *headers))
    assert reply is None or reply.status in (400, 431), reply
    await _assert_serving(server)


async def _trickle(server: ServerProcess, head: bytes, body: bytes) -> tuple[Reply | None, float]:
    """Send ``head`` and then ``body`` a byte a second; the reply, and when the server ended."""
    reader, writer = await asyncio.open_connection(*_address(server))
    started = time.monotonic()
    writer.write(head)
    reply_task = asyncio.ensure_future(_read_reply(reader))
    try:
        for byte in body:
            await asyncio.wait([reply_task], timeout=1.0)
            if reply_task.done():
                break
            writer.write(bytes([byte]))
        reply = await asyncio.wait_for(reply_task, RESPONSE_TIMEOUT_S)
        assert await _closed(reader)
        return reply, time.monotonic() - started
    finally:
        reply_task.cancel()
        writer.close()


@pytest.mark.e2e
async def test_slow_senders_are_cut_off_and_block_no_one(server: ServerProcess) -> None:
    """Head and body a byte a second, or a stalled head: a 408 and a closed connection after
    ``--request-read-timeout``, while other clients are served as usual."""
    body_head = _request("/v1/chat/completions", HELLO_BYTES)[: -len(HELLO_BYTES)]
    slow = [
        asyncio.ensure_future(_trickle(server, body_head, HELLO_BYTES)),  # a slow body
        asyncio.ensure_future(_trickle(server, b"", _request("/tokenize", b"{}"))),  # a slow head
        asyncio.ensure_future(_trickle(server, b"POST /v1/chat", b"")),  # a stalled head
    ]
    async with httpx.AsyncClient(
        base_url=server.url.removesuffix("/v1"), timeout=RESPONSE_TIMEOUT_S
    ) as client:
        while not all(task.done() for task in slow):
            started = time.monotonic()
            await _check_healthy(client)
            assert time.monotonic() - started < 2.0
            await asyncio.sleep(0.25)
    for task in slow:
        reply, took_s = task.result()
        assert reply is not None and _assert_envelope(reply, 408)["code"] == "request_timeout"
        assert READ_TIMEOUT_S - 0.5 < took_s < READ_TIMEOUT_S + 3, took_s
    await _assert_serving(server)
