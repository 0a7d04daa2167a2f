"""The controller's record of one connected daemon, and the registry view that recovery uses.

It knows what a Hello says and whether a daemon is alive; it knows nothing of sockets, calls or
how daemons were started.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Called with (daemon, reason, expected) when a daemon that said hello is declared gone.
GoneListener = Callable[["DaemonInfo", str, bool], None]


@dataclass(slots=True)
class DaemonInfo:
    """What the controller knows of one connected daemon (from its Hello, plus liveness)."""

    identity: str
    role: str
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    pid: int
    host: str
    impl: str
    endpoints: dict[str, dict[str, Any]]
    last_seen: float
    alive: bool = True
    gone_reason: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    #: the ZeroMQ routing id of the daemon's command socket (identity, encoded once)
    route: bytes = field(default=b"", init=False)

    def describe(self) -> str:
        return f"{self.role}[{self.rank}] ({self.host} pid {self.pid})"

    def __post_init__(self) -> None:
        self.route = self.identity.encode()


class Registry(Protocol):
    """The controller's daemon registry, as a call layer (hfrt.control.recovery) sees it."""

    heartbeat_s: float
    gone_listeners: list[GoneListener]

    def daemons(self, role: str | None = None) -> list[DaemonInfo]: ...

    def daemon(self, identity: str) -> DaemonInfo | None: ...

    def mark_gone(self, identity: str, reason: str, *, expected: bool = False) -> None: ...

    def notify_change(self) -> None: ...

    async def wait_change(self, timeout: float) -> None: ...
