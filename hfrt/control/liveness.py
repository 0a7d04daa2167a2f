"""When a silent daemon is declared dead, and the watcher task that judges it.

It knows DaemonInfo's last_seen and the heartbeat interval; the controller gives it a way to read
what waits on its socket and a way to declare a daemon gone. It knows nothing of calls or sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from hfrt.control.daemons import DaemonInfo

#: A daemon silent for this many heartbeat intervals is declared dead. Daemons beat twice per
#: interval, so a live one is silent for at most half an interval plus its own scheduling delays;
#: the check is timed to each daemon's deadline, so a death is declared 1.75 intervals after the
#: last beat (plus the controller's own lateness), within the 2 intervals the protocol promises.
DEAD_AFTER = 1.75
#: The controller echoes one beat in this many (the one whose sequence number it divides): a daemon
#: needs an echo about once an interval to know its controller's session and that it is there
#: (hfrt.daemon.heartbeat), not twice; each echo costs about a third of a heartbeat's controller CPU.
ECHO_EVERY = 2
#: A watcher that wakes more than this many intervals late was not running itself: it reads what
#: waits on its socket, lets ZeroMQ's I/O thread catch up for SETTLE intervals, and only then judges.
LATE_AFTER = 0.1
SETTLE = 0.05
#: Longest sleep of the watcher between judgements, in intervals (new daemons, changed deadlines).
MAX_NAP = 0.5


def next_deadline(daemons: Iterable[DaemonInfo], heartbeat_s: float) -> float:
    """The earliest time (loop clock) at which a live daemon's silence becomes death."""
    limit = DEAD_AFTER * heartbeat_s
    return min((d.last_seen + limit for d in daemons if d.alive), default=float("inf"))


def silent(daemons: Iterable[DaemonInfo], now: float, heartbeat_s: float) -> list[tuple[str, str]]:
    """(identity, reason) of every live daemon silent past DEAD_AFTER intervals at `now`."""
    limit = DEAD_AFTER * heartbeat_s
    return [(d.identity, f"no heartbeat for {now - d.last_seen:.2f}s")
            for d in daemons if d.alive and now - d.last_seen > limit]


async def watch(
    daemons: Callable[[], list[DaemonInfo]], heartbeat_s: float, read_waiting: Callable[[], None],
    declare_gone: Callable[[str, str], None],
) -> None:
    """Declare daemons dead after DEAD_AFTER silent heartbeat intervals (runs until cancelled).

    It wakes at the earliest deadline (last heard + DEAD_AFTER intervals) and, before judging,
    reads everything already waiting on the socket. When it woke late, this process was busy
    or descheduled: heartbeats may sit unread in the kernel or in ZeroMQ, and that is no
    daemon's fault, so it reads again after a short settle before judging.
    """
    loop = asyncio.get_running_loop()
    while True:
        planned = min(next_deadline(daemons(), heartbeat_s), loop.time() + MAX_NAP * heartbeat_s)
        await asyncio.sleep(max(0.0, planned - loop.time()))
        late = loop.time() - planned
        read_waiting()
        if late > LATE_AFTER * heartbeat_s:
            await asyncio.sleep(SETTLE * heartbeat_s)
            read_waiting()
        for identity, reason in silent(daemons(), loop.time(), heartbeat_s):
            declare_gone(identity, reason)
