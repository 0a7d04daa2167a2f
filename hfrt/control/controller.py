"""The controller: one ROUTER socket, the calls in flight, the daemon registry and liveness.

Every call returns an asyncio future as soon as its message is sent, so independent calls overlap
by construction (start early, await late). A daemon that exits, is killed or stops beating fails
every call pending on it within 2× the heartbeat interval, naming it. The controller never imports
torch and knows nothing of any algorithm or of how daemons were started (launchers tell it when a
process they own exits, through `mark_gone`). After `record_calls()`, every settled call appends
one span (daemon, endpoint, call id, sent, settled, status) to `trace` (hfrt.control.trace). Its
liveness watcher and gone-listeners are supervised (hfrt.control.supervision): if one fails, the
session fails loudly (pending calls, later calls and close() raise ControllerFailed). It owns its
collaborators, each given what it needs (a send function, registry views, counters): the calls in
flight (hfrt.control.calls: call id → pending call; a group call is one future over its ranks'
calls), the roster, the tensor plane, the open streams, the stray-reply count and the supervisor.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any

import zmq

from hfrt.control import liveness
from hfrt.control.calls import CallTable, Combine
from hfrt.control.daemons import DaemonInfo, GoneListener
from hfrt.control.group import CallLayer, RoleGroup
from hfrt.control.pending import Pending
from hfrt.control.roster import Roster
from hfrt.control.strays import StrayReplies
from hfrt.control.streams import CallStream, StreamCalls
from hfrt.control.supervision import Supervisor
from hfrt.control.tensor_plane import DIRECTORY_CALL, TensorPlane
from hfrt.control.trace import MAX_SPANS, CallTrace
from hfrt.log import get_logger
from hfrt.protocols import (
    PROTOCOL_VERSION,
    Bye,
    Cancel,
    Error,
    Heartbeat,
    Hello,
    Limits,
    Message,
    Partial,
    Reply,
    Shutdown,
    Welcome,
    Wire,
    WireError,
    check_heartbeat_s,
)
from hfrt.wire import shm
from hfrt.wire.channel import Channel
from hfrt.wire.errors import ControllerFailed, DaemonGone

#: connections the controller's socket lets wait to be accepted (ZeroMQ's default, 100, makes the rest
#: of a thousand daemons starting together retry; the kernel caps it at net.core.somaxconn)
LISTEN_BACKLOG = 4096


class Controller:
    """Binds `address`, welcomes daemons, and turns endpoint calls into futures.

    Use as `async with Controller(address, key) as ctl: actor = await ctl.role("actor")`.
    heartbeat_s: the interval daemons must beat at (told to them in Welcome).
    default_timeout_s: per-call timeout when the call gives none (None: wait forever, but a dead
        daemon still fails the call).
    recovery: the call layer every role group routes its calls through (hfrt.control.recovery's
        Recovery; None: calls go straight out). It is attached to this controller's registry here.
    """

    def __init__(
        self,
        address: str,
        key: bytes,
        *,
        heartbeat_s: float = 2.0,
        limits: Limits | None = None,
        default_timeout_s: float | None = None,
        recovery: CallLayer | None = None,
    ) -> None:
        self.requested_address = address
        self.address = address
        self.heartbeat_s = check_heartbeat_s(heartbeat_s, "controller heartbeat_s")
        self.session = secrets.token_hex(8)
        self._wire = Wire(key, limits)
        self._limits = self._wire.limits
        self._roster = Roster()  # every daemon that said hello, and what a hello means
        self._changed: asyncio.Event | None = None
        self._channel: Channel | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._zmq: zmq.Context[Any] | None = None
        self._log = get_logger(part="controller", session=self.session)
        self._supervisor = Supervisor(self._log, self._fail_session)  # owns the watcher, guards listeners
        #: told of every daemon declared gone, before the calls pending on it fail
        self.gone_listeners: list[GoneListener] = []
        #: the call layer role groups route calls through (None: recovery off)
        self.recovery = recovery
        #: the roles this run started daemons for (set by the session that launched them; None when
        #: unknown, e.g. attached daemons): lets a flow tell "not said hello yet" from "not launched"
        self.launched_roles: frozenset[str] | None = None
        if recovery is not None:
            recovery.attach(self)
        names = ("calls_sent", "replies", "errors", "heartbeats", "dropped_frames", "dropped_replies", "controller_bulk_bytes",
                 "keys_freed", "peer_directory_bytes")
        self._stats: dict[str, int] = dict.fromkeys(names, 0)
        self._strays = StrayReplies(self._stats, self._log)  # late_replies, unmatched_replies
        self._plane = TensorPlane(self._roster.all, self._roster.get, self.submit, self._stats)
        self._table = CallTable(self._wire, self._send_frames, introduce=self._plane.introduce, track=self._plane.track,
                                refusal=self._refusal, overdue=self._overdue, cancel=self._cancel_call, strays=self._strays,
                                stats=self._stats, log=self._log, default_timeout_s=default_timeout_s,
                                byte_counts={DIRECTORY_CALL: "peer_directory_bytes"})
        self._streams = StreamCalls(self._send_call, self._table.calls.get, self._table.restart_deadline, self._stats,
                                    self._strays)

    # -- life cycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Controller:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> Controller:
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._zmq = zmq.Context()
        sock = self._zmq.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished daemon raises, never drops
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted daemon takes its identity back
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_frame_bytes + 1024)  # strangers cannot balloon us
        sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)  # thousands of daemons connect at once
        sock.bind(self.requested_address)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._plane.start(self._loop)
        self._table.start(self._loop)
        self._channel = Channel(sock, self._on_frames, self._loop, routed=True, limits=self._limits)
        self._channel.on_unroutable = self._on_unroutable
        self._channel.on_dropped = self._on_dropped
        watch = liveness.watch(lambda: list(self._roster.all()), self.heartbeat_s, self._read_waiting, self.mark_gone)
        self._watcher = self._supervisor.own(self._loop.create_task(watch, name="hfrt-liveness"), "liveness watcher")
        self._log.info("controller_listening", address=self.address)
        return self

    async def close(self) -> None:
        """Fail whatever is pending and close the socket (daemons are not told: see shutdown_daemons).
        Raises ControllerFailed, after closing, if the session failed (hfrt.control.supervision)."""
        await self._supervisor.close()
        self._table.fail_all(lambda p: DaemonGone(f"controller closed before {p.endpoint} finished"))
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
        self._supervisor.check("")

    def _fail_session(self, failure: ControllerFailed) -> None:
        """The supervisor's verdict: fail every pending call with it, wake whoever waits for a role."""
        self._table.fail_all(lambda p: self._supervisor.error(f"{p.where} did not finish"))
        self.notify_change()

    async def shutdown_daemons(self, reason: str = "controller finished", *, grace_s: float = 5.0, wait_s: float = 10.0) -> None:
        """Tell every live daemon to exit and wait (up to wait_s) until each has said bye."""
        for info in self._roster.all():
            if info.alive:
                self._send_to(info, Shutdown(reason, grace_s))
        deadline = time.monotonic() + wait_s
        while any(d.alive for d in self._roster.all()) and time.monotonic() < deadline:
            await self.wait_change(max(0.0, deadline - time.monotonic()))

    # -- registry -----------------------------------------------------------------------------

    def daemons(self, role: str | None = None) -> list[DaemonInfo]:
        return self._roster.of_role(role)

    async def role(self, name: str, *, timeout_s: float = 120.0) -> RoleGroup:
        """Wait until every rank of role `name` has said hello and return its RoleGroup (typed: typed_roles.typed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._supervisor.check(f"role {name!r}")
            self._roster.check_role(name)  # refused, or gone before its hello: waiting is in vain
            ranks = [d for d in self.daemons(name) if d.alive]
            if ranks and len(ranks) == ranks[0].world_size:
                return RoleGroup(self, name, ranks)
            left = deadline - time.monotonic()
            if left <= 0:
                have = [d.rank for d in ranks]
                want = ranks[0].world_size if ranks else "?"
                raise TimeoutError(
                    f"role {name!r}: {len(have)} of {want} ranks said hello within {timeout_s:.0f}s "
                    f"(have ranks {have}) at {self.address}"
                )
            await self.wait_change(left)

    def daemon(self, identity: str) -> DaemonInfo | None:
        """The latest daemon that said hello as `identity` (alive or not), if any."""
        return self._roster.get(identity)

    async def wait_change(self, timeout: float) -> None:
        """Return when a daemon said hello or was declared gone, or after `timeout` seconds."""
        assert self._changed is not None
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    def notify_change(self) -> None:
        """Wake whoever waits in wait_change (e.g. a launcher saw a process end)."""
        if self._changed is not None:
            self._changed.set()

    def mark_gone(self, identity: str, reason: str, *, expected: bool = False) -> None:
        """Declare a daemon dead and fail every call pending on it (launchers call this on exit).

        expected: a clean exit (a Bye with code 0), logged at info rather than warning.
        """
        info = self._roster.get(identity)
        if info is None:
            self._roster.gone_before_hello(identity, reason)
            self.notify_change()
            return
        shm.remove_files_of(info.pid, str(info.meta.get("host", "")))  # a killed daemon's /dev/shm tensor files
        if not info.alive:
            return
        info.alive = False
        info.gone_reason = reason
        (self._log.info if expected else self._log.warning)("daemon_gone", daemon=info.describe(), reason=reason)
        for listener in self.gone_listeners:  # one that raises fails the session (not this loop)
            self._supervisor.guarded("gone-listener", listener, info, reason, expected)
        self._table.fail_all(lambda p: DaemonGone(f"{info.describe()} is gone ({reason}); {p.endpoint} did not finish"), of=info)
        self.notify_change()

    # -- calls --------------------------------------------------------------------------------

    @property
    def trace(self) -> CallTrace | None:
        """Spans of the calls sent since record_calls() (None: not recording)."""
        return self._table.trace

    @property
    def default_timeout_s(self) -> float | None:
        """The per-call timeout when a call gives none (None: wait forever; a dead daemon still fails it)."""
        return self._table.default_timeout_s

    def record_calls(self, max_spans: int = MAX_SPANS, path: str | Path | None = None) -> CallTrace:
        """From now on, record a span for every call this controller sends: streamed to `path` as a
        Chrome trace (`CallTrace.close()` ends it), or without one, the latest `max_spans` kept in
        memory (`CallTrace.write(path)` saves them)."""
        self._table.trace = CallTrace(max_spans, path)
        return self._table.trace

    def submit(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
               timeout_s: float | None = None, reply: bool = True) -> asyncio.Future[Any]:
        """Send one Call to one daemon now; the future resolves with its Reply value."""
        return self._table.send(info, endpoint, args, kwargs, timeout_s=timeout_s, reply=reply)

    def submit_all(self, infos: list[DaemonInfo], endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
                   timeout_s: float | None = None, combine: Combine = list) -> asyncio.Future[Any]:
        """Send the same Call to every daemon of `infos` now, its arguments encoded once; the future
        resolves with combine(their values, in order), or fails with the first failure."""
        return self._table.send_all(infos, endpoint, args, kwargs, timeout_s=timeout_s, combine=combine)

    def submit_each(self, parts: list[tuple[DaemonInfo, list[Any], dict[str, Any]]], endpoint: str, *,
                    timeout_s: float | None = None, combine: Combine = list) -> asyncio.Future[Any]:
        """Send one Call per (daemon, args, kwargs) now; one future: combine(their values, in order)."""
        return self._table.send_each(parts, endpoint, timeout_s=timeout_s, combine=combine)

    def _refusal(self, info: DaemonInfo, endpoint: str) -> BaseException | None:
        """Why `endpoint` cannot be called on `info` now (the session failed, the daemon is gone), if it cannot."""
        if self._supervisor.failure is not None:
            return self._supervisor.error(f"{info.role}[{info.rank}].{endpoint} not sent")
        if not info.alive:
            return DaemonGone(f"{info.describe()} is gone ({info.gone_reason}); cannot call {endpoint}")
        return None

    def _send_call(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any],
                   timeout_s: float | None) -> tuple[int, asyncio.Future[Any]]:
        """submit(), also giving the call id it sends the call under (streams route partials by it)."""
        call_id = self._table.next_id
        return call_id, self.submit(info, endpoint, args, kwargs, timeout_s=timeout_s)

    def submit_stream(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
                      timeout_s: float | None = None) -> CallStream:
        """Send one Call of a streaming endpoint to one daemon now; its partials feed the stream.
        `timeout_s` (else default_timeout_s) bounds each wait (hfrt.control.streams.StreamCalls.open)."""
        return self._streams.open(info, endpoint, args, kwargs, self.default_timeout_s if timeout_s is None else timeout_s)

    def _overdue(self, call_id: int, pending: Pending, timeout: float) -> bool:
        """A call ran past its deadline: with recovery on and its daemon hung, that daemon is declared
        gone (its calls fail with it, to be retried); True then, False for a plain timeout."""
        info = pending.daemon
        if self.recovery is None or not self.recovery.hung(info):
            return False
        self._table.calls[call_id] = pending
        self.mark_gone(info.identity, f"hung: {pending.endpoint} ran past its {timeout:.1f}s deadline")
        return True

    def _cancel_call(self, info: DaemonInfo, call_id: int) -> None:
        self._send_to(info, Cancel(call_id))

    # -- incoming -----------------------------------------------------------------------------

    def _on_frames(self, frames: list[bytes]) -> None:
        ident = frames[0]
        try:
            msg = self._wire.unpack(frames[1:])
        except WireError as exc:
            self._on_dropped(ident, str(exc), type(exc).__name__)
            return
        try:
            self._dispatch_message(ident, msg)
        except Exception as exc:  # one bad message must not stop the controller's reader
            self._log.error("message_failed", peer=ident.decode("utf-8", "replace"), kind=msg.NAME,
                            error=f"{type(exc).__name__}: {exc}")

    def _on_dropped(self, ident: bytes, reason: str, error: str = "FrameTooLarge") -> None:
        self._stats["dropped_frames"] += 1
        self._log.warning("dropped_frame", peer=ident.decode("utf-8", "replace"), reason=reason, error=error)

    def _dispatch_message(self, ident: bytes, msg: Message) -> None:
        kind = type(msg)
        if kind is Reply:
            if not self._table.reply(ident, msg, self._loop.time()):  # type: ignore[arg-type]
                self._seen(ident)  # a late reply is a sign of life too (the daemon skips beats it makes redundant)
        elif kind is Error:
            if not self._table.error(ident, msg, self._loop.time()):  # type: ignore[arg-type]
                self._seen(ident)
        elif kind is Heartbeat:
            self._on_heartbeat(ident, msg)  # type: ignore[arg-type]
        elif kind is Partial:  # a streaming endpoint's yielded value (hfrt.control.streams)
            self._streams.partial(ident, msg)  # type: ignore[arg-type]
        elif kind is Hello:
            self._on_hello(ident, msg)  # type: ignore[arg-type]
        elif kind is Bye:
            self._on_bye(ident, msg)  # type: ignore[arg-type]
        else:
            self._log.warning("unexpected_message", peer=ident.decode("utf-8", "replace"), kind=msg.NAME)

    def _seen(self, ident: bytes) -> None:
        """The daemon whose main socket has routing id `ident` (if one said hello) was heard now."""
        info = self._roster.get(ident.decode("utf-8", "replace"))
        if info is not None and info.route == ident:
            info.last_seen = self._loop.time()

    def _on_heartbeat(self, ident: bytes, msg: Heartbeat) -> None:
        self._stats["heartbeats"] += 1
        owner = self._roster.of_heartbeat(ident)
        if owner is not None:
            owner.last_seen = self._loop.time()
        if msg.seq % liveness.ECHO_EVERY == 0:
            self._send_raw(ident, Heartbeat(self.session, msg.seq, time.time()))

    def _on_hello(self, ident: bytes, msg: Hello) -> None:
        identity = ident.decode("utf-8", "replace")
        verdict = self._roster.judge_hello(identity, msg)
        if verdict.refusal is not None:
            kind, reason = verdict.refusal
            if kind == "ProtocolMismatch":
                self._log.error("protocol_mismatch", daemon=identity, reason=reason)
            self._send_raw(ident, Error(0, kind, reason))
            self.notify_change()
            return
        if verdict.replaces is not None:
            self.mark_gone(identity, f"replaced by a new process (pid {msg.pid})")
        info = self._roster.register(identity, msg, self._loop.time()) if verdict.fresh else None
        if info is not None:
            self._log.info("daemon_hello", daemon=identity, host=msg.host, pid=msg.pid, impl=msg.impl)
        self._send_raw(ident, Welcome(PROTOCOL_VERSION, self.session, self.heartbeat_s))
        if info is not None:  # not when the same live process says hello again: it has the directory already
            self._plane.joined(info)
        self.notify_change()

    def _on_bye(self, ident: bytes, msg: Bye) -> None:
        identity = ident.decode("utf-8", "replace")
        self.mark_gone(identity, f"exited: {msg.reason} (code {msg.exit_code})", expected=msg.exit_code == 0)

    # -- liveness (hfrt.control.liveness judges; this reads the socket for it) ----------------

    def _read_waiting(self) -> None:
        """Hand over every message already waiting on the socket (heartbeats among them)."""
        if self._channel is not None:
            self._channel.drain_all()

    # -- outgoing -----------------------------------------------------------------------------

    def _send_to(self, info: DaemonInfo, msg: Message) -> None:
        if info.alive:
            self._send_frames(info, self._wire.pack(msg))

    def _send_frames(self, info: DaemonInfo, frames: list[Any]) -> None:
        assert self._channel is not None, "controller not started"
        self._channel.send(frames, info.route)

    def _send_raw(self, ident: bytes, msg: Message) -> None:
        assert self._channel is not None, "controller not started"
        self._channel.send(self._wire.pack(msg), ident)

    def _on_unroutable(self, peer: bytes, exc: zmq.ZMQError) -> None:
        identity = peer.decode("utf-8", "replace")
        if self._roster.get(identity) is not None:
            self.mark_gone(identity, f"unreachable: {exc.strerror}")
        elif self._roster.of_heartbeat(peer) is None:  # an echo to an exiting daemon's closed heartbeat socket is no news
            self._log.warning("send_failed", peer=identity, reason=exc.strerror)

    # -- metrics ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters since start; controller_bulk_bytes counts tensor payload that passed through here."""
        out: dict[str, Any] = dict(self._stats)
        out["pending_calls"] = len(self._table.calls)
        out["daemons_alive"] = sum(d.alive for d in self._roster.all())
        out["live_tensor_keys"] = self._plane.live_keys
        return out

    def count_bulk_bytes(self, nbytes: int) -> None:
        """Record tensor payload bytes that were materialised in the controller on purpose."""
        self._plane.count_bulk_bytes(nbytes)

    # -- the tensor plane (hfrt.control.tensor_plane.TensorPlane says more) ---------------------

    async def fetch(self, value: Any) -> Any:
        """Materialise a TensorHandle (→ torch.Tensor) or BatchHandle (→ Batch) here, the bytes
        counted in stats()["controller_bulk_bytes"]; for debugging and small controller-side math."""
        return await self._plane.fetch(value)

    def free_now(self) -> None:
        """Send the frees of handles dropped so far now (normally they go on the next loop turn)."""
        self._plane.free_now()

    async def daemon_stats(self, role: str | None = None) -> dict[str, Any]:
        """Per-daemon tensor-plane figures: store size, bytes pulled per backend, bytes served."""
        return await self._plane.daemon_stats(role)

    async def form_data_plane(self, backend: str = "gloo", *, timeout_s: float = 120.0) -> dict[str, int]:
        """Join every live daemon into one torch.distributed group (gloo on CPU, nccl on GPU) for
        transfers between hosts. Returns the ranks."""
        return await self._plane.form_data_plane(backend, timeout_s=timeout_s)
