"""One heartbeat thread for every daemon a daemon host runs (hfrt.daemon.host).

Each daemon keeps what a lone daemon's HeartbeatThread has: its own heartbeat socket (routing id
`identity/hb`) and its connection monitor, its session, its interval, its beat sequence and its
Vigil (hfrt.daemon.heartbeat decides, on the same rules). What is shared is the thread: it wakes
every TICK_S, reads whatever echoes and connection events arrived for any daemon, sends the beats
that are due and judges each daemon's silence every JUDGE_EVERY ticks, so a host of N daemons
costs one thread and at most about 2N beats per heartbeat interval, not N threads (none for a
daemon whose serving loop is exchanging calls and replies with the controller:
hfrt.daemon.heartbeat.Traffic). A judgement of ORPHANED goes to that daemon's own `notify`;
FORCE_EXIT ends the process, as it does for a lone daemon (a host's daemons share their
controller, so they are orphaned together).

It knows the wire protocol, zmq and the Vigil; nothing of endpoints or of how daemons serve.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from hfrt.daemon.heartbeat import BEATS_PER_INTERVAL, SEND_HWM, HeartbeatEvent, Silence, Traffic, Vigil, beat_deferred
from hfrt.log import get_logger
from hfrt.protocols import Heartbeat, Limits, Wire, WireError, check_heartbeat_s
from hfrt.wire.channel import unbatch

if TYPE_CHECKING:
    from hfrt.daemon.server import ServeConfig

#: How often the shared thread wakes (reads echoes, sends due beats); beats are due twice per
#: interval, so a tick this short moves a beat by at most a few percent of an interval.
TICK_S = 0.05
#: Judge every daemon's silence every this many ticks (each judgement is a few microseconds × N).
JUDGE_EVERY = 2
#: Grace after ORPHANED before the hub ends the process itself (as HeartbeatThread's exit_grace_s).
EXIT_GRACE_S = 10.0

Notify = Callable[[HeartbeatEvent, str], None]


class HubBeats:
    """One daemon's share of the hub: the `Beats` a DaemonServer starts, welcomes and stops
    (hfrt.daemon.server.Beats). Its socket lives on the hub's thread, from start() to stop()."""

    def __init__(self, hub: BeatHub, identity: str, config: ServeConfig, notify: Notify) -> None:
        self.identity = identity
        self.interval_s = check_heartbeat_s(config.heartbeat_s, f"{identity} heartbeat interval")
        self.session = ""
        self.orphan_timeout_s = config.orphan_timeout_s
        self.exit_with_controller = config.exit_with_controller
        self.notify = notify
        self.connected = True  # until a DISCONNECTED event (see HeartbeatThread.connected)
        self.traffic = Traffic()  # the serving loop's exchange with the controller (the server sets its own)
        self.seq = 0
        self.next_beat = 0.0
        self.vigil: Vigil | None = None
        self.sock: zmq.Socket[Any] | None = None
        self.monitor: zmq.Socket[Any] | None = None
        self._hub = hub

    def welcome(self, session: str, interval_s: float) -> None:
        """A Welcome arrived: beat at the controller's interval under its session (ValueError,
        changing nothing, for an interval outside the accepted range)."""
        interval_s = check_heartbeat_s(interval_s, "welcome.heartbeat_s")
        self.session = session
        self.interval_s = interval_s

    def start(self) -> None:
        self._hub.join_member(self)

    def stop(self) -> None:
        self._hub.leave_member(self)

    def join(self, timeout: float | None = None) -> None:
        """Returns at once: the hub closes this daemon's socket on its next tick, and the host
        joins the hub before it ends the context (a wait here would hold the loop every daemon
        of the host shares)."""


class BeatHub(threading.Thread):
    """Beats for many daemons to the controller at `address` (see the module docstring).

    context: the host's ZeroMQ context. key, limits: as each daemon's.
    """

    def __init__(self, context: zmq.Context[Any], address: str, key: bytes, *, limits: Limits | None = None,
                 tick_s: float = TICK_S, exit_grace_s: float = EXIT_GRACE_S) -> None:
        super().__init__(name="hfrt-beat-hub", daemon=True)
        self._zmq = context
        self._address = address
        self._wire = Wire(key, limits)
        self._tick_s = tick_s
        self._exit_grace_s = exit_grace_s
        self._lock = threading.Lock()
        self._joining: list[HubBeats] = []
        self._leaving: list[HubBeats] = []
        self._members: dict[zmq.Socket[Any], HubBeats] = {}  # heartbeat socket → its daemon
        self._monitors: dict[zmq.Socket[Any], HubBeats] = {}  # monitor socket → its daemon
        self._poller = zmq.Poller()
        self._stopping = threading.Event()
        #: beats that could not be sent, over all daemons
        self.dropped = 0
        self._log = get_logger(part="beat-hub")

    def beats(self, identity: str, config: ServeConfig, notify: Notify) -> HubBeats:
        """One daemon's Beats (hfrt.daemon.server.BeatsFactory)."""
        return HubBeats(self, identity, config, notify)

    def join_member(self, member: HubBeats) -> None:
        with self._lock:
            self._joining.append(member)

    def leave_member(self, member: HubBeats) -> None:
        with self._lock:
            self._leaving.append(member)

    def stop(self) -> None:
        self._stopping.set()

    @property
    def size(self) -> int:
        """Daemons whose heartbeat socket is open."""
        return len(self._members)

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # no daemon may go on without beats: every one is told, loudly
            self._log.error("beat_hub_failed", error=f"{type(exc).__name__}: {exc}")
            for member in [*self._members.values(), *self._joining]:
                member.notify(HeartbeatEvent.ORPHANED, f"the daemon host's heartbeat thread failed: {exc}")
            raise

    def _run(self) -> None:
        tick = 0
        try:
            while not self._stopping.is_set():
                started = time.monotonic()
                self._adopt()
                self._read(started)
                self._beat(time.monotonic())
                tick += 1
                if tick % JUDGE_EVERY == 0:
                    self._judge(time.monotonic())
                self._stopping.wait(max(0.0, self._tick_s - (time.monotonic() - started)))
        finally:
            for member in list(self._members.values()):
                self._close(member)

    def _adopt(self) -> None:
        """Open the sockets of daemons that started, close those of daemons that stopped."""
        with self._lock:
            joining, self._joining = self._joining, []
            leaving, self._leaving = self._leaving, []
        for member in joining:
            self._open(member)
        for member in leaving:
            self._close(member)

    def _open(self, member: HubBeats) -> None:
        sock = self._zmq.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, f"{member.identity}/hb".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self._address)
        now = time.monotonic()
        # the first beat at a random point of the first half-interval: a host's daemons do not beat in step
        member.sock, member.monitor = sock, monitor
        member.next_beat = now + random.uniform(0.0, member.interval_s / BEATS_PER_INTERVAL)
        member.vigil = Vigil(now, orphan_timeout_s=member.orphan_timeout_s, exit_grace_s=self._exit_grace_s,
                             exit_with_controller=member.exit_with_controller)
        self._members[sock] = member
        self._monitors[monitor] = member
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)

    def _close(self, member: HubBeats) -> None:
        sock, monitor = member.sock, member.monitor
        if sock is not None and monitor is not None and sock in self._members:
            del self._members[sock], self._monitors[monitor]
            self._poller.unregister(sock)
            self._poller.unregister(monitor)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _read(self, now: float) -> None:
        for sock, _ in self._poller.poll(0):
            member = self._members.get(sock)
            if member is not None:
                self._read_echoes(member, now)
                continue
            member = self._monitors.get(sock)
            if member is not None:
                _read_monitor(member)

    def _read_echoes(self, member: HubBeats, now: float) -> None:
        assert member.sock is not None and member.vigil is not None
        while True:
            try:
                frames = member.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            for message in unbatch(frames):  # echoes queued while the controller was busy leave as one batch
                self._echoed(member, message, now)

    def _echoed(self, member: HubBeats, frames: list[bytes], now: float) -> None:
        assert member.vigil is not None
        try:
            msg = self._wire.unpack(frames)
        except WireError as exc:
            self._log.warning("dropped_frame", daemon=member.identity, reason=str(exc), error=type(exc).__name__)
            return
        if not isinstance(msg, Heartbeat):
            self._log.warning("unexpected_message", daemon=member.identity, kind=msg.NAME)
            return
        if member.vigil.echo(now, msg.session, member.session, member.interval_s):
            member.notify(HeartbeatEvent.REHELLO, msg.session)

    def _beat(self, now: float) -> None:
        for member in self._members.values():
            if now < member.next_beat:
                continue
            spacing = member.interval_s / BEATS_PER_INTERVAL
            deferred = beat_deferred(member.traffic, now, spacing)
            if deferred is not None:  # its replies and the controller's calls prove as much as a beat
                member.next_beat = deferred
                continue
            assert member.sock is not None
            try:  # one pack per beat: the body names the daemon's session and sequence
                member.sock.send_multipart(self._wire.pack(Heartbeat(member.session, member.seq, time.time())), zmq.NOBLOCK)
            except Exception as exc:  # zmq.Again at the high-water mark, a closing context, ...
                self.dropped += 1
                if self.dropped & (self.dropped - 1) == 0:
                    self._log.warning("heartbeat_dropped", dropped=self.dropped, error=f"{type(exc).__name__}: {exc}")
            member.seq += 1
            member.next_beat = now + spacing

    def _judge(self, now: float) -> None:
        for member in self._members.values():
            assert member.vigil is not None
            member.vigil.heard(member.traffic.heard)
            judgement = member.vigil.judge(now, welcomed=bool(member.session), connected=member.connected,
                                           interval_s=member.interval_s)
            if judgement.silence is Silence.ORPHANED:
                self._log.warning("orphaned", daemon=member.identity, silent_s=round(judgement.silent_s, 1),
                                  controller_gone=judgement.controller_dead)
                member.notify(HeartbeatEvent.ORPHANED, judgement.detail)
            elif judgement.silence is Silence.FORCE_EXIT:
                self._log.error("orphaned_forced_exit", daemon=member.identity, grace_s=self._exit_grace_s)
                os._exit(3)


def _read_monitor(member: HubBeats) -> None:
    assert member.monitor is not None
    while True:
        try:
            event = recv_monitor_message(member.monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        if event["event"] == zmq.EVENT_CONNECTED:
            member.connected = True
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            member.connected = False
