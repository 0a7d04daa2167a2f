"""The OpenAI-compatible endpoint on a real rollout daemon (tiny preset, a 512-token context) under
requests that used to hurt it: the context checked once on the request (the refusal names the
request's own numbers, every time), text longer than the context can hold refused before it is
tokenised (a 3 MB prompt while a small request is answered fast), a body that stops coming, a
slowloris crowd, a lower-case `bearer` scheme and the OpenAPI schema behind the key.

Figures asserted here are quoted in docs/agents-and-openai.md (hostile load)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from hfrt.serve.server import OpenAIServer, ServerLimits
from tests.integration.test_openai_server import POOL, _http, call, chat_model, ctl  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

LIMITS = ServerLimits(header_timeout_s=2.0, body_timeout_s=2.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(ctl: Any) -> AsyncIterator[OpenAIServer]:  # noqa: F811
    rollout = await ctl.role("rollout", timeout_s=90)
    async with OpenAIServer(rollout, model="tiny", flush_after_s=0.01, limits=LIMITS, timeout_s=60, api_key="sk-hostile") as srv:
        yield srv


KEY = {"Authorization": "Bearer sk-hostile"}


def _bound(quiet: float) -> float:
    """A latency bound: `quiet` on a quiet machine (load below 3 on the 2 cores), 5x that otherwise."""
    return quiet if os.getloadavg()[0] < 3 else 5 * quiet


async def test_the_context_is_checked_once_and_the_refusal_names_the_requests_numbers(server: OpenAIServer) -> None:
    prompt = "x" * 200
    status, out = await call(server, "/completions", {"prompt": prompt, "max_tokens": 1}, **KEY)
    assert status == 200, out
    tokens = len(out["prompt_token_ids"])
    for _ in range(3):  # the same answer every time (it used to depend on where a 16-token chunk ended)
        status, out = await call(server, "/completions", {"prompt": prompt, "max_tokens": 400, "temperature": 0}, **KEY)
        assert status == 400, out
        error = out["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt", error
        assert f"the model's context is 512 tokens, and this request asks for {tokens + 400} ({tokens} in the prompt, 400 for max_tokens)" \
            in error["message"], error
    # a chat request without max_tokens samples until the context is full: finish_reason length
    status, out = await call(server, "/chat/completions", {"messages": [{"role": "user", "content": "y" * 480}], "temperature": 0,
                                                            "stop": []}, **KEY)
    assert status == 200, out
    assert len(out["prompt_token_ids"]) + len(out["choices"][0]["token_ids"]) <= 512
    assert out["choices"][0]["finish_reason"] == ("length" if len(out["prompt_token_ids"]) + len(out["choices"][0]["token_ids"]) == 512
                                                 else "stop")


async def test_text_longer_than_the_context_holds_is_refused_before_tokenising(server: OpenAIServer) -> None:
    calls = server.generate_calls
    huge = {"prompt": "z" * (3 << 20), "max_tokens": 4}
    started = time.monotonic()
    status, out = await call(server, "/completions", huge, **KEY)
    took = time.monotonic() - started
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert "at most 2560 bytes fit" in out["error"]["message"]  # 512 tokens x 5 bytes, the tiny vocabulary's longest token
    assert server.generate_calls == calls  # never sent to the rollout daemon
    print(f"3 MB prompt refused in {took * 1000:.0f} ms (load {os.getloadavg()[0]:.1f})")
    assert took < _bound(1.0), took
    status, out = await call(server, "/chat/completions", {"messages": [{"role": "user", "content": "z" * 3000}]}, **KEY)
    assert status == 400 and out["error"]["param"] == "messages", out


async def test_a_small_request_is_answered_fast_while_a_3mb_prompt_arrives(server: OpenAIServer) -> None:
    huge = asyncio.ensure_future(call(server, "/completions", {"prompt": "z" * (3 << 20), "max_tokens": 4}, **KEY))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    status, out = await call(server, "/completions", {"prompt": "1+1=", "max_tokens": 4}, **KEY)
    waited = time.monotonic() - started
    assert status == 200, out
    assert (await huge)[0] == 400
    print(f"the 4-token request beside a 3 MB prompt took {waited * 1000:.0f} ms (load {os.getloadavg()[0]:.1f})")
    assert waited < _bound(1.0), waited


def _raw(port: int, data: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send `data`, then read until the server closes (or `wait_s` passes): (reply, seconds to close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        started = time.monotonic()
        sock.sendall(data)
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except TimeoutError:
            return reply, float("inf")
        return reply, time.monotonic() - started


async def test_a_body_that_stops_coming_is_answered_408_and_closed(server: OpenAIServer) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-hostile\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    reply, closed_after = await asyncio.get_running_loop().run_in_executor(POOL, _raw, server.port, head + b'{"prompt":', 15.0)
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(body)["error"]["code"] == "body_timeout_s"
    assert LIMITS.body_timeout_s <= closed_after < LIMITS.body_timeout_s + _bound(1.0), closed_after


def _slowloris(port: int, sockets: int, drip_s: float, give_up_s: float) -> list[float]:
    """`sockets` connections that each send a header line's bytes one at a time, `drip_s` apart;
    the seconds until the server closed each (inf: still open after give_up_s)."""
    conns = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(sockets)]
    started, closed = time.monotonic(), [float("inf")] * sockets
    data = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    try:
        for byte in range(len(data)):
            for i, conn in enumerate(conns):
                if closed[i] != float("inf"):
                    continue
                try:
                    conn.sendall(data[byte:byte + 1])
                    conn.setblocking(False)
                    try:
                        conn.recv(65536)  # the 408, or the end: either way the server is done with it
                        closed[i] = time.monotonic() - started
                    except BlockingIOError:
                        pass
                    except (ConnectionResetError, BrokenPipeError):
                        closed[i] = time.monotonic() - started
                    conn.setblocking(True)
                except (ConnectionResetError, BrokenPipeError):
                    closed[i] = time.monotonic() - started
            if all(c != float("inf") for c in closed) or time.monotonic() - started > give_up_s:
                break
            time.sleep(drip_s)
    finally:
        for conn in conns:
            conn.close()
    return closed


async def test_slowloris_connections_are_closed_at_the_header_deadline(server: OpenAIServer) -> None:
    crowd = asyncio.get_running_loop().run_in_executor(POOL, _slowloris, server.port, 100, 0.2, 20.0)
    await asyncio.sleep(0.5)
    started = time.monotonic()
    status, _ = await call(server, "/models", **KEY)  # the server answers others meanwhile
    assert status == 200 and time.monotonic() - started < _bound(1.0)
    closed = await crowd
    print(f"100 slowloris sockets: the last closed after {max(closed):.1f} s (header_timeout_s {LIMITS.header_timeout_s})")
    assert max(closed) < LIMITS.header_timeout_s + _bound(2.0), sorted(closed)[-5:]


async def test_bearer_in_any_case_and_the_schema_behind_the_key(server: OpenAIServer) -> None:
    base = server.url.removesuffix("/v1")
    loop = asyncio.get_running_loop()
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert (await call(server, "/models", Authorization=f"{scheme} sk-hostile"))[0] == 200, scheme
    assert (await call(server, "/models", Authorization="Basic sk-hostile"))[0] == 401
    status, out = await loop.run_in_executor(POOL, _http, base + "/openapi.json", None, {})
    assert status == 401 and out["error"]["code"] == "invalid_api_key"
    status, schema = await loop.run_in_executor(POOL, _http, base + "/openapi.json", None, {"Authorization": "bearer sk-hostile"})
    assert status == 200 and "/v1/completions" in schema["paths"]
