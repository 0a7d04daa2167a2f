"""The message kinds of the hfrt wire protocol, as small typed records.

Each record knows its kind code and how to check the types of its fields; it knows nothing of
frames, signatures or sockets (see wire.py) nor of what the runtime does with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from hfrt.protocols.endpoints import read_endpoint_table

#: Bumped whenever a record's layout or meaning changes. Both ends check it at hello/welcome.
#: 2: `error` may carry a fifth field, `param` (a version-1 reader refuses a five-field error).
PROTOCOL_VERSION = 3

#: The heartbeat intervals (seconds) both ends accept. Below the minimum, daemons flood the
#: controller and busy-spin their heartbeat threads; above the maximum, a dead daemon would go
#: unnoticed for over ten minutes.
HEARTBEAT_MIN_S = 0.05
HEARTBEAT_MAX_S = 300.0


def check_heartbeat_s(value: object, where: str) -> float:
    """`value` as a float when it is a finite interval in [HEARTBEAT_MIN_S, HEARTBEAT_MAX_S];
    otherwise a ValueError naming `where` (a flag, a spec field, a message field)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and HEARTBEAT_MIN_S <= value <= HEARTBEAT_MAX_S
    ):
        raise ValueError(
            f"{where}: heartbeat interval must be a finite number of seconds in "
            f"[{HEARTBEAT_MIN_S}, {HEARTBEAT_MAX_S}], got {value!r}"
        )
    return float(value)

# A field's accepted exact Python types after msgpack decoding; _ANY accepts any decodable value.
_Types = frozenset[type]


@dataclass(slots=True)
class Message:
    """Base of every record. On the wire a record is the msgpack array `[KIND, *fields]`."""

    KIND: ClassVar[int] = -1
    NAME: ClassVar[str] = "message"
    TYPES: ClassVar[tuple[_Types, ...]] = ()
    FIELD_NAMES: ClassVar[tuple[str, ...]] = ()
    #: indexes of the float fields (an int received there is converted to float)
    FLOATS: ClassVar[tuple[int, ...]] = ()
    #: how many trailing fields are optional: a writer leaves out those that are None (from the
    #: end), a reader accepts them absent and reads None
    OPTIONAL: ClassVar[int] = 0

    def to_wire(self) -> list[Any]:
        values = [getattr(self, n) for n in self.FIELD_NAMES]
        if not self.OPTIONAL:
            return [self.KIND, *values]
        end, first_optional = len(values), len(values) - self.OPTIONAL
        while end > first_optional and values[end - 1] is None:
            end -= 1
        return [self.KIND, *values[:end]]

    @classmethod
    def from_fields(cls, values: list[Any]) -> Message:
        """Build the record from decoded field values, refusing wrong counts or types.

        Types are compared exactly (msgpack yields exact types), so a bool is not an int.
        """
        most = len(cls.TYPES)
        if not most - cls.OPTIONAL <= len(values) <= most:
            want = f"{most - cls.OPTIONAL} to {most}" if cls.OPTIONAL else f"{most}"
            raise ValueError(f"{cls.NAME}: expected {want} fields, got {len(values)}")
        for value, types in zip(values, cls.TYPES, strict=False):
            if type(value) not in types and types is not _ANY:
                cls._raise_type(values)
        for i in cls.FLOATS:  # a float field may arrive as a msgpack int (protocols/README.md)
            if type(values[i]) is int:
                values[i] = float(values[i])
        values = values + [None] * (most - len(values))  # optional fields left out
        cls.check_fields(values)
        return cls(*values)

    @classmethod
    def check_fields(cls, values: list[Any]) -> None:
        """Checks of a field's inside beyond its type (a ValueError naming it); none by default."""

    @classmethod
    def _raise_type(cls, values: list[Any]) -> None:
        for name, value, types in zip(cls.FIELD_NAMES, values, cls.TYPES, strict=False):
            if type(value) not in types and types is not _ANY:
                want = "|".join(sorted(t.__name__ for t in types))
                raise ValueError(f"{cls.NAME}.{name}: expected {want}, got {type(value).__name__}")


def _record(kind: int, name: str, *types: _Types, optional: int = 0):  # type: ignore[no-untyped-def]
    """Class decorator: attach kind code, wire name, per-field accepted types and how many
    trailing fields are optional (each defaults to None)."""

    def wrap(cls: type[Message]) -> type[Message]:
        cls.KIND = kind
        cls.NAME = name
        cls.FIELD_NAMES = tuple(f.name for f in fields(cls))
        assert len(cls.FIELD_NAMES) == len(types), f"{name}: types do not match fields"
        assert all(f.default is None for f in fields(cls)[len(types) - optional:]), f"{name}: optional fields default to None"
        cls.TYPES = types
        cls.FLOATS = tuple(i for i, t in enumerate(types) if t is _NUM)
        cls.OPTIONAL = optional
        return cls

    return wrap


_ANY: _Types = frozenset({object})
_INT: _Types = frozenset({int})
_NUM: _Types = frozenset({int, float})  # a float field; an int is accepted and made a float
_STR: _Types = frozenset({str})
_BOOL: _Types = frozenset({bool})
_LIST: _Types = frozenset({list})
_DICT: _Types = frozenset({dict})


@_record(1, "hello", _INT, _STR, _INT, _INT, _INT, _INT, _INT, _STR, _STR, _DICT, _DICT)
@dataclass(slots=True)
class Hello(Message):
    """Daemon → controller, on the command socket, once the daemon is ready to serve.

    version: the daemon's PROTOCOL_VERSION; the controller refuses a mismatch with an Error.
    role: the role name this daemon serves ("actor", "critic", "cost", ...).
    rank / world_size: this daemon's index in its role group and the group's size.
    dp_rank / dp_size: its data-parallel coordinate (ranks sharing dp_rank receive the same rows).
    pid / host: where the daemon process runs, for error messages and for stopping it.
    impl: the daemon implementation ("echo", "pkg.mod:Class").
    endpoints: name → entry, the endpoint table: each entry a map {"dispatch": str,
        "concurrent": bool} plus optional "stream", "params" (each parameter's name, kind and
        whether it has a default) and "keywords" (the option names a **kwargs endpoint accepts);
        protocols/endpoints.py's EndpointEntry. Checked on receipt: a malformed entry refuses the hello.
    meta: free-form facts the daemon wants the controller to know (devices, addresses).
    """

    version: int
    role: str
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    pid: int
    host: str
    impl: str
    endpoints: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def check_fields(cls, values: list[Any]) -> None:
        read_endpoint_table(values[9], "hello.endpoints")


@_record(2, "welcome", _INT, _STR, _NUM)
@dataclass(slots=True)
class Welcome(Message):
    """Controller → daemon, the answer to a Hello it accepts.

    version: the controller's PROTOCOL_VERSION; the daemon exits on a mismatch.
    session: a random id of this controller's lifetime; heartbeat echoes carry it, so a daemon
        notices a new controller (re-attach) and says hello again.
    heartbeat_s: the interval at which the daemon must send heartbeats.
    """

    version: int
    session: str
    heartbeat_s: float


@_record(3, "call", _INT, _STR, _LIST, _DICT, _BOOL)
@dataclass(slots=True)
class Call(Message):
    """Controller → daemon: run one endpoint.

    call_id: unique per controller session; the Reply or Error carries it back.
    endpoint: the endpoint name.
    args / kwargs: positional and keyword arguments (msgpack values and registered records).
    reply: False for fire-and-forget broadcasts; the daemon then answers only failures.
    """

    call_id: int
    endpoint: str
    args: list[Any]
    kwargs: dict[str, Any]
    reply: bool = True


@_record(4, "reply", _INT, _ANY, _NUM)
@dataclass(slots=True)
class Reply(Message):
    """Daemon → controller: an endpoint returned.

    call_id: the Call's id. value: the return value. elapsed_s: time the endpoint ran.
    """

    call_id: int
    value: Any
    elapsed_s: float


@_record(5, "error", _INT, _STR, _STR, _STR, _STR, optional=1)
@dataclass(slots=True)
class Error(Message):
    """Either direction: something failed; errors are values on the wire.

    call_id: the failed Call's id, or 0 when the error is not about a call (e.g. a hello).
    type: the exception type name ("ValueError", "UnknownEndpoint", "VersionMismatch", ...).
    message: str(exception). traceback: the remote traceback text, "" when there is none.
    param: optional, left out when None: the name of the argument or option the endpoint refused
        (an hfrt.wire.errors.InvalidArgument's `param`), so a caller can tell which input was at
        fault without reading the message.
    """

    call_id: int
    type: str
    message: str
    traceback: str = ""
    param: str | None = None


@_record(6, "cancel", _INT)
@dataclass(slots=True)
class Cancel(Message):
    """Controller → daemon: the caller gave up on call_id (cancelled or timed out).

    A queued call is dropped without running; a running async endpoint is cancelled; a running
    synchronous endpoint cannot be interrupted and finishes, its reply ignored.
    """

    call_id: int


@_record(7, "heartbeat", _STR, _INT, _NUM)
@dataclass(slots=True)
class Heartbeat(Message):
    """Daemon → controller on the daemon's heartbeat socket, echoed back by the controller.

    session: the controller session the daemon believes in ("" before its first Welcome);
        the echo carries the controller's real session.
    seq: a counter, for logs. sent_at: sender's time.time(), for logs.
    """

    session: str
    seq: int
    sent_at: float


@_record(8, "shutdown", _STR, _NUM)
@dataclass(slots=True)
class Shutdown(Message):
    """Controller → daemon: stop serving and exit.

    reason: why, for the daemon's log. grace_s: how long a running endpoint may take to finish.
    """

    reason: str
    grace_s: float = 5.0


@_record(9, "bye", _STR, _INT)
@dataclass(slots=True)
class Bye(Message):
    """Daemon → controller: the daemon is exiting; pending calls on it fail at once.

    reason: "shutdown", "sigterm", "orphaned", "setup failed: ..." and the like.
    exit_code: the code the process will exit with.
    """

    reason: str
    exit_code: int = 0


@_record(10, "partial", _INT, _ANY)
@dataclass(slots=True)
class Partial(Message):
    """Daemon → controller: one value a streaming endpoint yielded before its Reply.

    Sent only for a Call of an endpoint declared `stream` (its Hello entry has "stream": true),
    so a controller that never calls one never receives it. Partials of one call arrive in the
    order they were yielded and all before the call's Reply or Error (one socket, in order).
    call_id: the Call's id. value: the yielded value (a msgpack value; no tensors).
    """

    call_id: int
    value: Any


KINDS: dict[int, type[Message]] = {
    cls.KIND: cls
    for cls in (Hello, Welcome, Call, Reply, Error, Cancel, Heartbeat, Shutdown, Bye, Partial)
}
