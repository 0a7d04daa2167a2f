"""The daemon's heartbeat thread: proves liveness to the controller and notices an absent one.

It runs on its own thread and socket so a long synchronous endpoint never looks like death; the
DaemonServer owns it and hears from it through one `notify(event, detail)` function. It reports
two events (HeartbeatEvent): REHELLO (a controller with a new session answered) and ORPHANED (no
answer for orphan_timeout_s); if the loop does not stop within exit_grace_s after ORPHANED, it
ends the process itself so no daemon outlives its controller. What to do when is decided by a
Vigil, on a clock it is given (so the decisions are tested without sockets or waiting). It knows
the wire protocol and zmq; it knows nothing of endpoints.

A daemon started for one run (`exit_with_controller`: launchers set it unless the daemons are kept
for `--attach`) also ends when its controller is dead: the controller's echoes have stopped for
CONTROLLER_DEAD_AFTER intervals *and* the connection to it is down (ZeroMQ's socket monitor saw it
close). A killed controller's kernel closes its sockets, so its daemons exit within two intervals;
a controller that is only busy keeps its connection, so a slow step never ends a run; a host that
vanished without closing anything is caught by orphan_timeout_s.

It beats BEATS_PER_INTERVAL times per heartbeat interval, so a beat delayed by a starved thread
(a loaded machine, a C extension holding the GIL) is covered by the next one before the controller
judges silence. A beat that cannot be sent (queue full, controller gone) is dropped and logged; the
thread never dies of it. A beat is skipped while the serving loop's own exchange with the
controller proves as much (Traffic: it sent a reply and heard a message within the beat spacing;
the controller counts replies as signs of life and the Vigil counts what the loop heard), so a
busy daemon costs the controller no heartbeats; beats resume one spacing after the exchange stops.
"""

from __future__ import annotations

import argparse
import enum
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from hfrt.log import get_logger
from hfrt.protocols import Heartbeat, Limits, Wire, WireError, check_heartbeat_s
from hfrt.wire.channel import unbatch

POLL_CAP_S = 0.05
#: Beats sent per heartbeat interval (the controller declares death after hfrt.control.liveness.DEAD_AFTER intervals).
BEATS_PER_INTERVAL = 2
#: Beats queued for an unreachable controller before new ones are dropped (stale beats prove nothing).
SEND_HWM = 4
#: Heartbeat intervals without an echo, with the connection down, after which the controller is dead.
#: The controller echoes every other beat (two go out per interval): the last echo came at most an
#: interval before a kill, so the daemon knows within one interval of the kill and has the second
#: to wind down and exit.
CONTROLLER_DEAD_AFTER = 1.0


class Traffic:
    """When (time.monotonic()) the serving loop last sent its controller a reply and last heard a
    signed message from it: written by the loop's thread, read by the heartbeat thread (a float
    store is atomic under the GIL)."""

    __slots__ = ("heard", "sent")

    def __init__(self) -> None:
        self.sent = float("-inf")
        self.heard = float("-inf")


def beat_deferred(traffic: Traffic, now: float, spacing_s: float) -> float | None:
    """When the beat due `now` may wait until (None: send it now). The loop both sent a reply and
    heard from the controller within `spacing_s`: the reply told the controller what a beat would,
    and the message told us it is there, so the beat waits until `spacing_s` after the older of
    the two — the controller never goes longer without a sign of life than it does with beats."""
    proof = min(traffic.sent, traffic.heard)
    return proof + spacing_s if now - proof < spacing_s else None


class Beats(Protocol):
    """A server's heartbeat (HeartbeatThread, or a daemon host's share of one thread): started with
    the server, told each Welcome, stopped and joined at its end; it reports HeartbeatEvents
    through the `notify` function it was made with."""

    interval_s: float
    #: the serving loop's exchange with the controller (the server sets its own before start())
    traffic: Traffic

    def welcome(self, session: str, interval_s: float) -> None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class HeartbeatEvent(enum.StrEnum):
    """What the heartbeat thread tells the serving loop (with a detail string)."""

    #: a controller with a new session answered (detail: the session): say hello again
    REHELLO = "rehello"
    #: no word from the controller, or it is dead (detail: why): stop serving
    ORPHANED = "orphaned"


class Silence(enum.Enum):
    """A Vigil's judgement of the controller's silence."""

    FINE = "fine"  # heard from recently enough (or nothing to judge)
    ORPHANED = "orphaned"  # newly orphaned: tell the serving loop
    FORCE_EXIT = "force_exit"  # orphaned longer than exit_grace_s and still running: end the process


@dataclass(frozen=True, slots=True)
class Judgement:
    """A Vigil's verdict, with what it rests on: seconds since the last echo, and whether the
    controller is known dead (not only silent)."""

    silence: Silence
    silent_s: float = 0.0
    controller_dead: bool = False

    @property
    def detail(self) -> str:
        """Why the daemon is orphaned, as the ORPHANED event says it."""
        why = "its controller is gone (connection closed), no echo" if self.controller_dead else "no word from the controller"
        return f"{why} for {self.silent_s:.1f}s"


class Vigil:
    """The heartbeat thread's decisions, on the clock times it is given (time.monotonic()).

    orphan_timeout_s: orphaned after this long without an echo (0: never, for silence alone).
    exit_grace_s: how long after ORPHANED the process may still run before it is ended.
    exit_with_controller: a run's daemon, orphaned as soon as its welcomed controller is dead.
    """

    def __init__(self, now: float, *, orphan_timeout_s: float, exit_grace_s: float, exit_with_controller: bool) -> None:
        self.orphan_timeout_s = orphan_timeout_s
        self.exit_grace_s = exit_grace_s
        self.exit_with_controller = exit_with_controller
        self.last_heard = now
        self.orphaned_at: float | None = None
        self._rehello_at: dict[str, float] = {}  # session → when we last said hello again for it

    def echo(self, now: float, session: str, own_session: str, interval_s: float) -> bool:
        """An echo of `session` arrived: the controller is there. True when the serving loop must
        say hello again — another session than ours, not already asked for in 2 intervals."""
        self.last_heard = now
        self.orphaned_at = None
        if session == own_session or now - self._rehello_at.get(session, -1e9) <= 2 * interval_s:
            return False
        self._rehello_at[session] = now
        return True

    def heard(self, at: float) -> None:
        """The serving loop heard a signed message from the controller at `at` (its calls prove
        it is there as an echo does, while beats are skipped)."""
        if at > self.last_heard:
            self.last_heard = at
            self.orphaned_at = None

    def judge(self, now: float, *, welcomed: bool, connected: bool, interval_s: float) -> Judgement:
        """The silence so far: ORPHANED once (a welcomed run's daemon whose controller's connection
        is down and echoes stopped CONTROLLER_DEAD_AFTER intervals ago, or any daemon silent past
        orphan_timeout_s), then FORCE_EXIT once exit_grace_s has passed since."""
        silent = now - self.last_heard
        dead = (self.exit_with_controller and welcomed and not connected
                and silent > CONTROLLER_DEAD_AFTER * interval_s)
        if not (dead or (self.orphan_timeout_s > 0 and silent > self.orphan_timeout_s)):
            return Judgement(Silence.FINE, silent, dead)
        if self.orphaned_at is None:
            self.orphaned_at = now
            return Judgement(Silence.ORPHANED, silent, dead)
        if now - self.orphaned_at > self.exit_grace_s:
            return Judgement(Silence.FORCE_EXIT, silent, dead)
        return Judgement(Silence.FINE, silent, dead)


def heartbeat_flag(text: str) -> float:
    """argparse type for --heartbeat: a number of seconds in the range both ends accept."""
    try:
        return check_heartbeat_s(float(text), "--heartbeat")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--heartbeat: ")) from None


class HeartbeatThread(threading.Thread):
    """Beats to the controller at `address` as `identity`/hb until stop(); `notify(event, detail)`
    is called on this thread (the serving loop hands it over to its own)."""

    def __init__(
        self,
        context: zmq.Context[Any],
        identity: str,
        address: str,
        key: bytes,
        *,
        interval_s: float,
        orphan_timeout_s: float,
        notify: Callable[[HeartbeatEvent, str], None],
        limits: Limits | None = None,
        exit_grace_s: float = 10.0,
        exit_with_controller: bool = False,
    ) -> None:
        super().__init__(name="hfrt-heartbeat", daemon=True)
        self._zmq = context
        self._identity = identity
        self._address = address
        self._wire = Wire(key, limits)
        self.interval_s = check_heartbeat_s(interval_s, f"{identity} heartbeat interval")
        #: beats that could not be sent (dropped, the thread went on)
        self.dropped = 0
        self.orphan_timeout_s = orphan_timeout_s
        self.session = ""
        self._notify = notify
        self._exit_grace_s = exit_grace_s
        self.exit_with_controller = exit_with_controller
        # False once a DISCONNECTED event said the controller's end closed, until it connects again: a
        # socket still connecting (a controller busy accepting thousands) is no sign of a dead controller
        self.connected = True
        #: the serving loop's exchange with the controller (the server replaces it with its own)
        self.traffic = Traffic()
        self._stopping = threading.Event()
        self._log = get_logger(daemon=identity, part="heartbeat")

    def welcome(self, session: str, interval_s: float) -> None:
        """The serving loop got a Welcome: beat at the controller's interval, under its session.

        An interval outside the accepted range raises ValueError and changes nothing."""
        interval_s = check_heartbeat_s(interval_s, "welcome.heartbeat_s")
        self.session = session
        self.interval_s = interval_s

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        sock = self._zmq.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, f"{self._identity}/hb".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self._address)
        try:
            self._beat(sock, monitor)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _beat(self, sock: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        vigil = Vigil(time.monotonic(), orphan_timeout_s=self.orphan_timeout_s, exit_grace_s=self._exit_grace_s,
                      exit_with_controller=self.exit_with_controller)
        next_beat = vigil.last_heard
        seq = 0
        while not self._stopping.is_set():
            now = time.monotonic()
            if now >= next_beat:
                spacing = self.interval_s / BEATS_PER_INTERVAL
                deferred = beat_deferred(self.traffic, now, spacing)
                if deferred is None:
                    self._send_beat(sock, seq)
                    seq += 1
                next_beat = now + spacing if deferred is None else deferred
            ready = dict(poller.poll(int(1000 * min(POLL_CAP_S, max(0.0, next_beat - now)))))
            if monitor in ready:
                self._read_monitor(monitor)
            if sock in ready:
                self._read_echoes(sock, vigil)
            vigil.heard(self.traffic.heard)
            self._act_on(vigil.judge(time.monotonic(), welcomed=bool(self.session), connected=self.connected,
                                     interval_s=self.interval_s))

    def _read_echoes(self, sock: zmq.Socket[Any], vigil: Vigil) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            for message in unbatch(frames):  # echoes queued while the controller was busy leave as one batch
                session = self._read_echo(message)
                if session is not None and vigil.echo(time.monotonic(), session, self.session, self.interval_s):
                    self._notify(HeartbeatEvent.REHELLO, session)

    def _act_on(self, judgement: Judgement) -> None:
        if judgement.silence is Silence.ORPHANED:
            self._log.warning("orphaned", silent_s=round(judgement.silent_s, 1), controller_gone=judgement.controller_dead)
            self._notify(HeartbeatEvent.ORPHANED, judgement.detail)
        elif judgement.silence is Silence.FORCE_EXIT:
            self._log.error("orphaned_forced_exit", grace_s=self._exit_grace_s)
            os._exit(3)

    def _read_monitor(self, monitor: zmq.Socket[Any]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False

    def _send_beat(self, sock: zmq.Socket[Any], seq: int) -> None:
        """Send one beat now, or drop it: a full queue or any other send error costs one beat."""
        try:
            sock.send_multipart(self._wire.pack(Heartbeat(self.session, seq, time.time())), zmq.NOBLOCK)
        except Exception as exc:  # zmq.Again at the high-water mark, a closing context, ...
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # log the 1st, 2nd, 4th, 8th, ... drop
                self._log.warning("heartbeat_dropped", dropped=self.dropped, error=f"{type(exc).__name__}: {exc}")

    def _read_echo(self, frames: list[bytes]) -> str | None:
        try:
            msg = self._wire.unpack(frames)
        except WireError as exc:
            self._log.warning("dropped_frame", reason=str(exc), error=type(exc).__name__)
            return None
        if not isinstance(msg, Heartbeat):
            self._log.warning("unexpected_message", kind=msg.NAME)
            return None
        return msg.session
