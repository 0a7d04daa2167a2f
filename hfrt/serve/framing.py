"""uvicorn's HTTP protocols with a JSON 400 for requests their parser refuses (a bad Content-Length,
broken chunked framing, a malformed request line or header): uvicorn answers those itself, before
any application code runs, with a plain-text "Invalid HTTP request received."; here the body is
OpenAI's error shape (code `malformed_http`) like every other refusal of the endpoint.

It knows uvicorn's protocol classes (their send_400_response hook) and nothing of the endpoint's
routes. A body that ends early (the client closed before sending Content-Length bytes) cannot be
answered at all: the client is gone; uvicorn tells the app it disconnected (see app.read_body).
"""

from __future__ import annotations

import json
from typing import Any


def json_400(msg: str) -> bytes:
    """A whole HTTP/1.1 400 response whose body is OpenAI's error JSON; the connection closes."""
    body = json.dumps({"error": {"message": f"malformed HTTP request: {msg}", "type": "invalid_request_error",
                                 "param": None, "code": "malformed_http"}}).encode()
    head = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n")
    return head + body


def protocol(http: str) -> Any:
    """The uvicorn protocol class for `http` ("httptools" or "h11") with JSON parse-error replies."""
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]

    class JsonErrors(base):  # type: ignore[misc, valid-type]
        def send_400_response(self, msg: str) -> None:
            self.transport.write(json_400(msg))
            self.transport.close()

    JsonErrors.__name__ = JsonErrors.__qualname__ = f"JsonErrors{base.__name__}"
    return JsonErrors
