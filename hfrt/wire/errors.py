"""Exceptions the controller raises to flow code (each names the role, rank and endpoint involved),
and InvalidArgument, which a daemon's endpoint raises to refuse one of its inputs by name.

This module knows nothing of sockets or messages beyond the fields an error carries.
"""

from __future__ import annotations


class HfrtError(Exception):
    """Base of every hfrt runtime error."""


class InvalidArgument(ValueError):
    """Raised by an endpoint that refuses one of its arguments or options: `param` is its name as
    the endpoint takes it ("stop", "prompt", "top_logprobs", ...). The error that goes back to the
    controller carries `param` as a field of its own (protocols/README.md), so a caller (the
    OpenAI-compatible server's HTTP errors) learns which input was at fault without reading the
    message. A ValueError, so code that catches those still does."""

    def __init__(self, param: str, message: str) -> None:
        if not param:
            raise ValueError("InvalidArgument: param must name the argument or option at fault")
        super().__init__(message)
        self.param = param

    def at(self, where: str) -> InvalidArgument:
        """The same refusal (its class and param) with `where` before its message, e.g. the row it is about."""
        return type(self)(self.param, f"{where}: {self}")


class ContextTooLong(InvalidArgument):
    """The input (with the tokens asked for) does not fit the model's context: what OpenAI's
    API calls context_length_exceeded. Its type name travels in the error record."""


class RemoteError(HfrtError):
    """An endpoint raised on a daemon; carries the remote type name, message and traceback, and
    `param`: the argument or option the endpoint refused (InvalidArgument), None otherwise."""

    def __init__(self, where: str, type_name: str, message: str, traceback: str = "", param: str | None = None) -> None:
        self.where = where
        self.type_name = type_name
        self.message = message
        self.remote_traceback = traceback
        self.param = param
        text = f"{where} raised {type_name}: {message}"
        if traceback:
            text += "\n--- remote traceback ---\n" + traceback.rstrip()
        super().__init__(text)


class DaemonGone(HfrtError):
    """The daemon a call was waiting on exited, was killed, or stopped sending heartbeats."""


class CallTimeout(HfrtError, TimeoutError):
    """A call did not finish within its timeout; the daemon was told to cancel it."""


class UnknownEndpoint(HfrtError, AttributeError):
    """The role has no endpoint of that name (checked against the table the daemons sent)."""


class BadArguments(HfrtError, TypeError):
    """A call's arguments do not fit the endpoint's parameters (checked against the table the
    daemons sent, before anything is sent): an unknown keyword, too many positional arguments,
    a missing required one."""


class ControllerFailed(HfrtError):
    """The controller's own machinery failed (its liveness watcher, a gone-listener such as the
    recovery layer), so it can no longer tell when a daemon dies and the session cannot go on:
    pending calls, later calls, role lookups and close() raise it. `__cause__` is the original error."""


class ProtocolMismatch(HfrtError):
    """A daemon speaks a different protocol version than this controller."""
