"""The small HTTP/1.1 JSON server: request parsing (request line, headers, Content-Length bodies,
Expect: 100-continue, limits) and serving over real loopback sockets with stdlib clients
(keep-alive, malformed requests answered then closed, handler errors as 500 with the server going on)."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from hfrt.flows.agent.openai.http_json import (
    HttpError,
    JsonHttpServer,
    Request,
    Response,
    body_length,
    parse_header,
    parse_request_line,
    read_request,
)


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=8192)
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_request_line_and_headers() -> None:
    assert parse_request_line("GET /v1/models?x=1 HTTP/1.1") == ("GET", "/v1/models", "x=1", "HTTP/1.1")
    for bad in ("GET /v1/models", "GET v1 HTTP/1.1", "GET  /x HTTP/1.1", ""):
        with pytest.raises(HttpError, match="malformed request line") as info:
            parse_request_line(bad)
        assert info.value.status == 400
    with pytest.raises(HttpError, match="HTTP/2.0") as info:
        parse_request_line("GET / HTTP/2.0")
    assert info.value.status == 505
    assert parse_header("Content-Type:  application/json ") == ("content-type", "application/json")
    with pytest.raises(HttpError, match="malformed header line"):
        parse_header("no colon here")


def test_body_length_limits() -> None:
    assert body_length({}, 10) == 0 and body_length({"content-length": "10"}, 10) == 10
    with pytest.raises(HttpError, match="more than the 10") as info:
        body_length({"content-length": "11"}, 10)
    assert info.value.status == 413
    with pytest.raises(HttpError, match="not a non-negative integer"):
        body_length({"content-length": "-1"}, 10)
    with pytest.raises(HttpError, match="chunked") as info:
        body_length({"transfer-encoding": "chunked"}, 10)
    assert info.value.status == 411


async def test_read_request_body_and_keep_alive() -> None:
    raw = b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 14\r\nConnection: close\r\n\r\n{"prompt":"a"}'
    request = await read_request(reader_of(raw))
    assert request.method == "POST" and request.headers["host"] == "x" and not request.keep_alive
    assert request.json() == {"prompt": "a"}
    two = b"GET /a HTTP/1.1\r\n\r\n\r\nGET /b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    reader = reader_of(two)
    first, second = await read_request(reader), await read_request(reader)
    assert (first.path, first.keep_alive, second.path, second.keep_alive) == ("/a", True, "/b", True)
    with pytest.raises(EOFError):
        await read_request(reader)
    with pytest.raises(HttpError, match="body ended after 2 of 5 bytes"):
        await read_request(reader_of(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab"))
    with pytest.raises(HttpError, match="longer than 8192") as info:
        await read_request(reader_of(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n"))
    assert info.value.status == 431
    with pytest.raises(HttpError, match="not valid JSON"):
        Request("POST", "/", body=b"{oops").json()


async def handler(request: Request) -> Response:
    if request.path == "/boom":
        raise RuntimeError("handler bug")
    if request.path == "/refuse":
        raise HttpError(404, "nothing at /refuse")
    return Response(200, {"path": request.path, "body": request.json() if request.body else None})


@pytest_asyncio.fixture
async def server() -> AsyncIterator[JsonHttpServer]:
    srv = JsonHttpServer(handler, lambda exc: {"error": exc.message})
    await srv.start()
    try:
        yield srv
    finally:
        await srv.close()


def _exchange(port: int, requests: list[tuple[str, str, Any]]) -> list[tuple[int, Any]]:
    """Several requests on one keep-alive connection (http.client, as a user's client would)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    out = []
    try:
        for method, path, body in requests:
            conn.request(method, path, body=None if body is None else json.dumps(body), headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            out.append((reply.status, json.loads(reply.read())))
    finally:
        conn.close()
    return out


async def test_keep_alive_errors_and_serving_on(server: JsonHttpServer) -> None:
    replies = await asyncio.to_thread(_exchange, server.port, [
        ("POST", "/x", {"a": 1}), ("GET", "/boom", None), ("GET", "/refuse", None), ("POST", "/y", [2]),
    ])
    assert replies == [
        (200, {"path": "/x", "body": {"a": 1}}), (500, {"error": "RuntimeError: handler bug"}),
        (404, {"error": "nothing at /refuse"}), (200, {"path": "/y", "body": [2]}),
    ]


async def test_malformed_request_is_answered_and_closed_and_expect_continue(server: JsonHttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"BROKEN\r\n\r\n")
    reply = await asyncio.wait_for(reader.read(), 10)  # read() to EOF: the server closed the connection
    assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"malformed request line" in reply
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /z HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\nConnection: close\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"[]")
    reply = await asyncio.wait_for(reader.read(), 10)
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and reply.endswith(b'{"path":"/z","body":[]}')
    writer.close()
