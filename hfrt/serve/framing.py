"""uvicorn's HTTP protocols with two guards the endpoint needs before any application code runs:

- a JSON 400 for requests their parser refuses (a bad Content-Length, broken chunked framing, a
  malformed request line or header): uvicorn answers those itself with a plain-text "Invalid HTTP
  request received."; here the body is OpenAI's error shape (code `malformed_http`);
- a header deadline: a request's headers must be whole within `header_timeout_s` of their first
  byte (or of the connection opening). uvicorn has none (its keep-alive timer restarts on every
  byte), so a client that sends a header byte every few seconds (slowloris) held a connection for
  ever; past the deadline it is answered 408 (code `header_timeout_s`) and closed.

It knows uvicorn's protocol classes (their send_400_response hook, `cycle`, `loop` and `transport`)
and nothing of the endpoint's routes. The body's own deadline is the app's (app.read_body). A body
that ends early (the client closed before sending Content-Length bytes) cannot be answered at all:
the client is gone; uvicorn tells the app it disconnected.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any


def json_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response whose body is OpenAI's error JSON; the connection closes."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


def json_400(msg: str) -> bytes:
    """A 400 for a request uvicorn's parser refused."""
    return json_error(400, "Bad Request", f"malformed HTTP request: {msg}", "malformed_http")


def protocol(http: str, header_timeout_s: float = 10.0) -> Any:
    """The uvicorn protocol class for `http` ("httptools" or "h11") with JSON parse-error replies
    and the header deadline (see the module docstring)."""
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]

    class Guarded(base):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: Any = None
        _bytes_seen = False

        def send_400_response(self, msg: str) -> None:
            self.transport.write(json_400(msg))
            self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head()  # a connection that never sends a whole head is closed too

        def data_received(self, data: bytes) -> None:
            self._bytes_seen = True
            if self._awaiting_head() and (self._head_timer is None or self._head_cycle is not self.cycle):
                self._arm_head()  # the first byte of a new request's head (or a timer left from the request before)
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head()
            super().connection_lost(exc)

        def _awaiting_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_head(self) -> None:
            self._disarm_head()
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_expired)

        def _disarm_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.cycle is not self._head_cycle or not self._awaiting_head():
                return  # the head came in time (a request is in progress, or done: keep-alive takes over)
            if self._bytes_seen:
                self.transport.write(json_error(408, "Request Timeout", f"the request's headers did not arrive within the "
                                                f"header_timeout_s limit of {header_timeout_s:g} s", "header_timeout_s"))
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
