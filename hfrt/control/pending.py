"""A call the controller waits on: its record (daemon, endpoint, timer, when it was sent, and where
its outcome goes: its own future, or its slot in a Gather), settling it at most once, and the
Gather of a group call (one future over the calls sent to several ranks at once).

It knows asyncio futures and the daemon record; nothing of sockets or messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from hfrt.control.daemons import DaemonInfo


class Gather:
    """One future over the calls of a group call, in the order they were sent: the combined values
    once every call answered, or the first failure (the other calls still run; their outcomes are
    dropped). Its parts have no futures of their own, so a call to N ranks makes one future and
    one callback, not N futures and 2N callbacks. Cancelling the future gives every part still
    pending to `cancel(call_ids)` (the controller cancels them on their daemons)."""

    __slots__ = ("future", "values", "left", "call_ids", "combine")

    def __init__(self, future: asyncio.Future[Any], size: int, combine: Callable[[list[Any]], Any]) -> None:
        self.future = future
        self.values: list[Any] = [None] * size
        self.left = size
        self.call_ids: list[int] = []
        self.combine = combine

    def fill(self, index: int, value: Any) -> None:
        """Part `index` answered `value`; the last answer settles the future with the combined values."""
        self.values[index] = value
        self.left -= 1
        if self.left == 0 and not self.future.done():
            try:
                self.future.set_result(self.combine(self.values))
            except Exception as exc:
                self.future.set_exception(exc)

    def fail(self, exc: BaseException) -> None:
        """A part failed: the first failure is the future's."""
        if not self.future.done():
            self.future.set_exception(exc)


class Pending:
    """One sent call whose reply the controller waits for: its outcome settles `future`, or, for a
    part of a group call, slot `index` of `gather` (then `future` is None)."""

    __slots__ = ("daemon", "endpoint", "future", "gather", "index", "timer", "sent")

    def __init__(self, future: asyncio.Future[Any] | None, daemon: DaemonInfo, endpoint: str, sent: float,
                 gather: Gather | None = None, index: int = 0) -> None:
        self.future = future
        self.daemon = daemon
        self.endpoint = endpoint
        self.gather = gather
        self.index = index
        self.timer: asyncio.TimerHandle | None = None
        self.sent = sent  # time.perf_counter() when the call went out (for the call trace)

    @property
    def where(self) -> str:
        """`role[rank].endpoint`, as errors name the call."""
        return f"{self.daemon.role}[{self.daemon.rank}].{self.endpoint}"

    def resolve(self, value: Any) -> None:
        """The call answered `value`."""
        if self.gather is not None:
            self.gather.fill(self.index, value)
        elif self.future is not None and not self.future.done():
            self.future.set_result(value)

    def fail(self, exc: BaseException) -> None:
        """The call failed with `exc` (nothing happens when its outcome is already settled)."""
        if self.gather is not None:
            self.gather.fail(exc)
        elif self.future is not None:
            settle(self.future, exc=exc)


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
        pending.fail(error(pending))
