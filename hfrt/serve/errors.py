"""The errors of the OpenAI-compatible endpoint: a request that cannot be served, with its HTTP
status, a client-facing message, OpenAI's `param` (the field at fault) and `code` (the limit).

Pure data: it knows nothing of HTTP framing or of which field is checked where.
"""

from __future__ import annotations


class ApiError(Exception):
    """A request that cannot be served: the HTTP status, a message for the client (never server
    paths or logs), OpenAI's `param` (the field at fault), `code`, and headers the reply carries
    (Retry-After on a 503 while a daemon is being replaced)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


class BadRequest(ApiError):
    """A request OpenAI would refuse (400 unless told): `param` names the field."""

    def __init__(self, param: str | None, message: str, *, status: int = 400, code: str | None = None) -> None:
        super().__init__(status, f"{param}: {message}" if param else message, param=param, code=code)


__all__ = ["ApiError", "BadRequest"]
