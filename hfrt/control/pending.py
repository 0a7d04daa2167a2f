"""A call the controller waits on: its record (future, daemon, endpoint, timer, when it was sent)
and settling its future with an error at most once.

It knows asyncio futures and the daemon record; nothing of sockets or messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from hfrt.control.daemons import DaemonInfo


class Pending:
    """One sent call whose reply the controller waits for."""

    __slots__ = ("daemon", "endpoint", "future", "timer", "sent")

    def __init__(self, future: asyncio.Future[Any], daemon: DaemonInfo, endpoint: str, sent: float) -> None:
        self.future = future
        self.daemon = daemon
        self.endpoint = endpoint
        self.timer: asyncio.TimerHandle | None = None
        self.sent = sent  # time.perf_counter() when the call went out (for the call trace)

    @property
    def where(self) -> str:
        """`role[rank].endpoint`, as errors name the call."""
        return f"{self.daemon.role}[{self.daemon.rank}].{self.endpoint}"


def settle(future: asyncio.Future[Any], *, exc: BaseException) -> None:
    """Fail `future` with `exc` unless it is already done (answered, cancelled or failed)."""
    if not future.done():
        future.set_exception(exc)


def fail_all(calls: dict[int, Pending], error: Callable[[Pending], BaseException],
             given_up: Callable[[int, Pending, str], None], *, of: DaemonInfo | None = None) -> None:
    """Take out of `calls` every call (`of`: only those sent to that daemon), failing each with
    error(call) after stopping its timer; `given_up` records each (call id, call, "gone") first,
    as the call trace and the stray-reply count want."""
    for call_id in [c for c, p in calls.items() if of is None or p.daemon is of]:
        pending = calls.pop(call_id)
        given_up(call_id, pending, "gone")
        if pending.timer is not None:
            pending.timer.cancel()
        settle(pending.future, exc=error(pending))
