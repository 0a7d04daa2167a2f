"""A small HTTP/1.1 server for JSON APIs on asyncio streams (stdlib only): request line, headers,
a Content-Length body (with `Expect: 100-continue`), keep-alive, and JSON responses.

It knows HTTP framing and nothing of the API it serves: a handler maps a Request to a Response.
It deliberately does not do chunked request bodies, TLS, HTTP/2 or pipelining beyond in-order
replies (one request at a time per connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

#: longest request line or header line accepted
MAX_LINE = 8192
#: most header lines accepted
MAX_HEADERS = 100

REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable", 505: "HTTP Version Not Supported",
}


class HttpError(Exception):
    """A request that cannot be served: its status and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Request:
    """One parsed request: method, path (query string split off), lower-cased headers, raw body."""

    method: str
    path: str
    query: str = ""
    version: str = "HTTP/1.1"
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    @property
    def keep_alive(self) -> bool:
        """HTTP/1.1 keeps the connection unless `Connection: close`; HTTP/1.0 only with keep-alive."""
        connection = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in connection
        return "close" not in connection

    def json(self) -> Any:
        """The body parsed as JSON (HttpError 400 naming the problem when it is not)."""
        if not self.body:
            raise HttpError(400, "the request has no body: send a JSON object with Content-Type: application/json")
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, ValueError) as exc:
            raise HttpError(400, f"the body is not valid JSON: {exc}") from exc


@dataclass
class Response:
    """A reply: status, a JSON-able body (or bytes sent as they are, of `content_type`), extra headers."""

    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"

    def encode(self, *, keep_alive: bool) -> bytes:
        payload = self.body if isinstance(self.body, bytes) else json.dumps(self.body, separators=(",", ":")).encode()
        head = [f"HTTP/1.1 {self.status} {REASONS.get(self.status, 'Unknown')}",
                f"Content-Type: {self.content_type}", f"Content-Length: {len(payload)}",
                f"Connection: {'keep-alive' if keep_alive else 'close'}"]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload


Handler = Callable[[Request], Awaitable[Response]]
#: how an HttpError becomes a body (the API decides its error shape)
ErrorBody = Callable[[HttpError], Any]


async def _line(reader: asyncio.StreamReader) -> str:
    try:
        raw = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError as exc:
        raise HttpError(431, f"a request or header line is longer than {MAX_LINE} bytes") from exc
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise EOFError from exc
        raise HttpError(400, "the connection closed in the middle of the request head") from exc
    if len(raw) > MAX_LINE:
        raise HttpError(431, f"a request or header line is longer than {MAX_LINE} bytes")
    return raw.decode("latin-1").rstrip("\r\n")


def parse_request_line(line: str) -> tuple[str, str, str, str]:
    """(method, path, query, version) of `GET /v1/models?x=1 HTTP/1.1`."""
    parts = line.split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1].startswith("/"):
        raise HttpError(400, f"malformed request line {line[:120]!r}: expected 'METHOD /path HTTP/1.1'")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(505, f"unsupported protocol version {version[:20]!r}: use HTTP/1.1")
    path, _, query = target.partition("?")
    return method.upper(), path, query, version


def parse_header(line: str) -> tuple[str, str]:
    """(lower-cased name, stripped value) of one `Name: value` line."""
    name, sep, value = line.partition(":")
    if not sep or not name or name != name.strip() or " " in name:
        raise HttpError(400, f"malformed header line {line[:120]!r}: expected 'Name: value'")
    return name.lower(), value.strip()


def body_length(headers: dict[str, str], max_body: int) -> int:
    """The Content-Length a request announces (0 without one); chunked bodies are refused."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HttpError(411, "chunked request bodies are not supported: send a Content-Length")
    raw = headers.get("content-length")
    if raw is None:
        return 0
    if not raw.isdigit():
        raise HttpError(400, f"Content-Length {raw[:40]!r} is not a non-negative integer")
    length = int(raw)
    if length > max_body:
        raise HttpError(413, f"the body is {length} bytes, more than the {max_body} this server accepts")
    return length


async def read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None = None, *, max_body: int = 16 << 20) -> Request:
    """The next request on a connection (EOFError when the client closed it between requests).
    With `Expect: 100-continue` it answers 100 on `writer` before reading the body."""
    line = await _line(reader)
    while not line:  # tolerate stray CRLFs between requests (RFC 9112 2.2)
        line = await _line(reader)
    method, path, query, version = parse_request_line(line)
    headers: dict[str, str] = {}
    while (line := await _line(reader)):
        if len(headers) >= MAX_HEADERS:
            raise HttpError(431, f"more than {MAX_HEADERS} header lines")
        name, value = parse_header(line)
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    length = body_length(headers, max_body)
    if length and writer is not None and headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    try:
        body = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError as exc:
        raise HttpError(400, f"the body ended after {len(exc.partial)} of {length} bytes") from exc
    return Request(method, path, query, version, headers, body)


class JsonHttpServer:
    """Serves `handler` on host:port (port 0: a free one, see `port` after start). Each connection
    is served one request at a time, replies in request order; an exception in the handler
    becomes a 500 and the server keeps serving. `idle_timeout_s` closes quiet keep-alive
    connections."""

    def __init__(self, handler: Handler, error_body: ErrorBody, *, host: str = "127.0.0.1", port: int = 0,
                 max_body: int = 16 << 20, idle_timeout_s: float = 60.0) -> None:
        self.handler, self.error_body = handler, error_body
        self.host, self.port, self.max_body, self.idle_timeout_s = host, port, max_body, idle_timeout_s
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_LINE)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop accepting, end open connections (in-flight requests are cancelled)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._requests(reader, writer)
        except (EOFError, ConnectionError, TimeoutError, asyncio.CancelledError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                request = await asyncio.wait_for(read_request(reader, writer, max_body=self.max_body), self.idle_timeout_s)
            except HttpError as exc:  # the stream is out of step: answer and close
                writer.write(Response(exc.status, self.error_body(exc)).encode(keep_alive=False))
                await writer.drain()
                return
            response = await self._respond(request)
            writer.write(response.encode(keep_alive=request.keep_alive))
            await writer.drain()
            if not request.keep_alive:
                return

    async def _respond(self, request: Request) -> Response:
        try:
            return await self.handler(request)
        except HttpError as exc:
            return Response(exc.status, self.error_body(exc))
        except Exception as exc:  # a handler bug: the client hears of it, the server goes on
            return Response(500, self.error_body(HttpError(500, f"{type(exc).__name__}: {exc}")))
