"""The controller's roster: every daemon that said hello (alive or gone) by identity, the daemons
that never got that far (refused, or gone before their hello), and what a Hello means.

A Hello is judged here (`judge_hello`): refused (another protocol version, or an identity that is
not its role:rank), a new process (registered; a live one of the same identity is replaced), or
the same live process saying hello again. The Controller owns the roster and acts on its
verdicts (answers, declares the replaced process gone). It knows Hello records and DaemonInfo;
nothing of sockets, calls or liveness.
"""

from __future__ import annotations

from collections.abc import ValuesView
from dataclasses import dataclass

from hfrt.control.daemons import DaemonInfo
from hfrt.protocols import PROTOCOL_VERSION, Hello
from hfrt.wire.errors import DaemonGone, ProtocolMismatch


@dataclass(frozen=True, slots=True)
class HelloVerdict:
    """What a Hello means. refusal: (error type, reason) to answer with, registering nothing.
    replaces: a live daemon of this identity in another process, to declare gone first.
    fresh: a new process (or one of a gone daemon's identity) to register and announce."""

    refusal: tuple[str, str] | None = None
    replaces: DaemonInfo | None = None
    fresh: bool = False


class Roster:
    """The daemons one controller knows (see the module docstring)."""

    def __init__(self) -> None:
        self._by_identity: dict[str, DaemonInfo] = {}
        self._by_heartbeat_route: dict[bytes, str] = {}
        self._gone_before_hello: dict[str, str] = {}
        self._refused: dict[str, str] = {}

    def get(self, identity: str) -> DaemonInfo | None:
        """The latest daemon that said hello as `identity` (alive or not), if any."""
        return self._by_identity.get(identity)

    def all(self) -> ValuesView[DaemonInfo]:
        """Every daemon that said hello, alive or gone, in the order they first did (a live view)."""
        return self._by_identity.values()

    def of_role(self, role: str | None) -> list[DaemonInfo]:
        """The daemons of `role` (None: all), sorted by role and rank."""
        infos = [d for d in self._by_identity.values() if role is None or d.role == role]
        return sorted(infos, key=lambda d: (d.role, d.rank))

    def of_heartbeat(self, route: bytes) -> DaemonInfo | None:
        """The daemon whose heartbeat socket has routing id `route` (identity + "/hb")."""
        return self._by_identity.get(self._by_heartbeat_route.get(route, ""))

    def check_role(self, role: str) -> None:
        """Raise ProtocolMismatch if a daemon of `role` was refused, DaemonGone if one exited
        before saying hello: waiting for the role would be in vain."""
        for identity, reason in self._refused.items():
            if identity.startswith(role + ":"):
                raise ProtocolMismatch(f"daemon {identity} was refused: {reason}")
        for identity, reason in self._gone_before_hello.items():
            if identity.startswith(role + ":"):
                raise DaemonGone(f"daemon {identity} exited before saying hello: {reason}")

    def gone_before_hello(self, identity: str, reason: str) -> None:
        """A daemon that never said hello is gone; a first reason (a Bye's) is kept ahead of later ones."""
        first = self._gone_before_hello.get(identity)
        self._gone_before_hello[identity] = reason if first is None else f"{first}; {reason}"

    def judge_hello(self, identity: str, msg: Hello) -> HelloVerdict:
        """What the Hello `msg`, from the peer with routing id `identity`, means (HelloVerdict).
        A refusal for another protocol version is remembered, so a wait for its role fails."""
        if msg.version != PROTOCOL_VERSION:
            reason = f"daemon speaks protocol {msg.version}, controller speaks {PROTOCOL_VERSION}"
            self._refused[identity] = reason
            return HelloVerdict(refusal=("ProtocolMismatch", reason))
        if identity != f"{msg.role}:{msg.rank}":
            return HelloVerdict(refusal=("BadHello", f"identity {identity!r} does not match {msg.role}:{msg.rank}"))
        old = self._by_identity.get(identity)
        replaces = old if old is not None and old.alive and old.pid != msg.pid else None
        return HelloVerdict(replaces=replaces, fresh=old is None or old.pid != msg.pid or not old.alive)

    def register(self, identity: str, msg: Hello, now: float) -> DaemonInfo:
        """Record the process that said `msg` as `identity`, heard at `now` (loop clock)."""
        info = DaemonInfo(identity, msg.role, msg.rank, msg.world_size, msg.dp_rank, msg.dp_size, msg.pid,
                          msg.host, msg.impl, msg.endpoints, now, meta=msg.meta)
        self._by_identity[identity] = info
        self._by_heartbeat_route[f"{identity}/hb".encode()] = identity
        self._gone_before_hello.pop(identity, None)
        return info
