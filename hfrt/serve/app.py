"""The HTTP side of the OpenAI-compatible endpoint: a Starlette app on uvicorn (in the caller's
event loop) that checks the API key (on every route, /openapi.json included), the body size and
its deadline, the number of requests in progress and each request's time limit, and hands checked
JSON to OpenAIServer (a large body is parsed in a worker thread). Every error is OpenAI's JSON error
shape naming the field or the limit; a client that goes away mid-request is a debug line.

It knows HTTP, the ServerLimits and the routes; nothing of sampling, sessions or tokenizers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hfrt.log import get_logger
from hfrt.serve.api import error_body, parse_body
from hfrt.serve.errors import ApiError, BadRequest
from hfrt.serve.framing import protocol
from hfrt.serve.responses import models_body
from hfrt.serve.schema import openapi_schema

#: what the app serves: an OpenAIServer (limits, api_key, model, requests, chat_turn, completion_turn, complete)
OpenAIServer = Any

ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/sessions/ID/end",
          "/v1/sessions/ID/reward", "/openapi.json")


def _error(exc: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers={**(exc.headers or {}), **(headers or {})})


def bearer_key(header: str) -> str | None:
    """The credentials of an `Authorization: Bearer <key>` header, the scheme in any case (RFC 7235)."""
    scheme, _, key = header.strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def is_loopback(host: str) -> bool:
    """Whether binding `host` only serves this machine (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: bodies larger than this are parsed as JSON in a worker thread, not on the event loop
THREAD_PARSE_BYTES = 256 << 10
CLOSE = {"Connection": "close"}


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The body, refused with 413 as soon as its announced or received size passes `limit`, and
    with 408 when it is not whole within `timeout_s` of the headers (both close the connection:
    the rest of the body is not read)."""
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > limit:
        raise ApiError(413, f"the body is {announced} bytes, more than the max_body_bytes limit of {limit}", code="max_body_bytes",
                       headers=CLOSE)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the body is more than the max_body_bytes limit of {limit} bytes", code="max_body_bytes",
                                   headers=CLOSE)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within the body_timeout_s limit of {timeout_s:g} s ({size} bytes came)",
                       code="body_timeout_s", headers=CLOSE) from None
    return b"".join(chunks)


async def read_json(request: Request, limits: Any) -> Any:
    """The body read (read_body) and parsed (api.parse_body); a large one is parsed in a worker
    thread, so a multi-megabyte body does not hold the event loop (and every other client)."""
    raw = await read_body(request, limits.max_body_bytes, limits.body_timeout_s)
    return await asyncio.to_thread(parse_body, raw) if len(raw) > THREAD_PARSE_BYTES else parse_body(raw)


def build_app(server: OpenAIServer) -> Starlette:
    """The Starlette app serving `server`: /v1/models, /v1/completions, /v1/chat/completions,
    /v1/responses and the OpenAPI schema at /openapi.json."""
    limits, log = server.limits, get_logger(part="openai_server")
    in_progress = 0

    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            nonlocal in_progress
            refused = _unauthorized(server.api_key, request)
            if refused is not None:
                return refused
            if in_progress >= limits.max_concurrent_requests:
                return _error(ApiError(429, f"more than the max_concurrent_requests limit of {limits.max_concurrent_requests} "
                                            "requests in progress: retry later", code="max_concurrent_requests"))
            in_progress += 1
            server.requests += 1
            try:
                return await asyncio.wait_for(handler(request), limits.request_timeout_s)
            except ApiError as exc:
                return _error(exc)
            except TimeoutError:
                return _error(ApiError(408, f"the request took longer than the request_timeout_s limit of {limits.request_timeout_s} s",
                                       code="request_timeout_s"))
            except ClientDisconnect:
                log.debug("client_disconnected", path=request.url.path)
                return Response(status_code=499)
            except Exception as exc:  # a server bug: logged, the client hears no details, the server serves on
                log.exception("request_failed", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
                return _error(ApiError(500, "the server failed on this request (the server log has the details)"))
            finally:
                in_progress -= 1

        return endpoint

    async def models(request: Request) -> Response:
        return JSONResponse(models_body(server.model, server.created))

    async def sample(request: Request, kind: str) -> Response:
        body = await read_json(request, limits)
        turn = server.chat_turn(body) if kind == "chat" else server.completion_turn(body)
        if turn.stream:  # the first events before the 200: a refused request still gets its JSON error
            events = server.stream(turn, request.headers.get("x-session-id"))
            first = await events.__anext__()
            return StreamingResponse(_events(first, events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        results, reply = await server.complete(turn, request.headers.get("x-session-id"))
        return JSONResponse(reply)

    async def responses(request: Request) -> Response:
        rt = server.responses_turn(await read_json(request, limits))
        session = request.headers.get("x-session-id")
        if rt.turn.stream:  # the first events wait for the first token: a refused request still gets its JSON error
            events = server.respond_stream(rt, session)
            first = await events.__anext__()
            return StreamingResponse(_events(first, events, responses_error), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await server.respond(rt, session))

    async def completions(request: Request) -> Response:
        return await sample(request, "completion")

    async def chat(request: Request) -> Response:
        return await sample(request, "chat")

    async def end(request: Request) -> Response:
        """POST /v1/sessions/ID/end, body {} or {"reward": R}: the session ends (written when recording)."""
        name, reward = request.path_params["session"], await _reward(request, limits, required=False)
        if name not in server.sessions:
            raise ApiError(404, f"no open session {name!r}", code="session_not_found")
        server.end_session(name, reward)
        return JSONResponse({"session": name, "ended": True, "recorded": server.recorder is not None, "reward": reward})

    async def reward(request: Request) -> Response:
        """POST /v1/sessions/ID/reward, body {"reward": R}: a reward for the session (recording only)."""
        name, value = request.path_params["session"], await _reward(request, limits, required=True)
        assert value is not None
        return JSONResponse({"session": name, "reward": value, "status": server.give_reward(name, value)})

    async def schema(request: Request) -> Response:
        refused = _unauthorized(server.api_key, request)
        return refused or JSONResponse(openapi_schema(server.model, limits))

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(ApiError(404, f"no route {request.method} {request.url.path}: serving {', '.join(ROUTES)}"))

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    routes = [Route("/v1/models", guarded(models), methods=["GET"]),
              Route("/v1/completions", guarded(completions), methods=["POST"]),
              Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
              Route("/v1/responses", guarded(responses), methods=["POST"]),
              Route("/v1/sessions/{session}/end", guarded(end), methods=["POST"]),
              Route("/v1/sessions/{session}/reward", guarded(reward), methods=["POST"]),
              Route("/openapi.json", schema, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})


async def _reward(request: Request, limits: Any, *, required: bool) -> float | None:
    """The body's `reward` (a number; absent or an empty body: None unless required)."""
    raw = await read_body(request, limits.max_body_bytes, limits.body_timeout_s)
    body = parse_body(raw) if raw.strip() else {}
    value = body.get("reward") if isinstance(body, dict) else None
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest("reward", f"must be a number, not {value!r}")
    return float(value)


def _unauthorized(api_key: str | None, request: Request) -> Response | None:
    """401 unless `api_key` is None or the request carries it as a bearer key (compared in constant time)."""
    if api_key is None:
        return None
    sent = request.headers.get("authorization", "")
    key = bearer_key(sent)
    if key is not None and hmac.compare_digest(key.encode(), api_key.encode()):
        return None
    why = "no API key sent (header Authorization: Bearer <key>)" if not sent else "the API key is not valid"
    return _error(ApiError(401, why, code="invalid_api_key"), {"WWW-Authenticate": "Bearer"})


def chat_error(exc: ApiError) -> bytes:
    """A chat or completions stream's error after the 200: OpenAI's error shape as one event."""
    return f"data: {json.dumps(error_body(exc))}\n\n".encode()


def responses_error(exc: ApiError) -> bytes:
    """A Responses stream's error after the 200: an `error` event."""
    err = error_body(exc)["error"]
    data = {"type": "error", "code": err["code"], "message": err["message"], "param": err["param"]}
    return f"event: error\ndata: {json.dumps(data)}\n\n".encode()


async def _events(first: bytes, rest: AsyncIterator[bytes], error: Callable[[ApiError], bytes] = chat_error) -> AsyncIterator[bytes]:
    """The stream's events; an error after the 200 went out ends it with an error event."""
    yield first
    try:
        async for chunk in rest:
            yield chunk
    except ApiError as exc:
        yield error(exc)
    except Exception as exc:  # logged; the client hears no details
        get_logger(part="openai_server").exception("stream_failed", error=f"{type(exc).__name__}: {exc}")
        yield error(ApiError(500, "the server failed on this request (the server log has the details)"))


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the hfrt process that hosts the server owns Ctrl-C
    and SIGTERM (hfrt.signals)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """uvicorn serving build_app(server) on host:port (0: a free port) in the running loop."""

    def __init__(self, server: OpenAIServer, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._app = build_app(server)
        self._header_timeout_s = float(server.limits.header_timeout_s)
        self._uvicorn: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        if server.api_key is None and not is_loopback(host):
            get_logger(part="openai_server").warning(
                "no_api_key", host=host, message=f"serving on {host} without an API key: anyone who can reach the port can generate "
                                                 "and write into training sessions (set --api-key or HFRT_API_KEY)")

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # IPPROTO_TCP: asyncio then sets TCP_NODELAY
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = int(sock.getsockname()[1])
        http = "httptools" if _has("httptools") else "h11"
        config = uvicorn.Config(self._app, http=protocol(http, self._header_timeout_s), lifespan="off", log_config=None, access_log=False, server_header=False,
                                timeout_keep_alive=60, timeout_graceful_shutdown=5)
        self._uvicorn = _Uvicorn(config)
        self._task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._task.done():
                self._task.result()  # startup failed: raise its error
                raise OSError(f"the HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.005)
        return self.port

    async def close(self) -> None:
        """Stop accepting, let requests in progress finish (at most 5 s), close connections."""
        if self._uvicorn is not None and self._task is not None:
            self._uvicorn.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._uvicorn = self._task = None


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


__all__ = ["BadRequest", "HttpServer", "bearer_key", "build_app", "is_loopback", "read_body", "read_json"]
