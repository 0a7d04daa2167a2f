"""Serving one Daemon: the command socket, call ordering, cancellation, heartbeats and shutdown.

Ordering guarantee (enforced here): calls to one daemon run one at a time, in the order they
arrived, unless their endpoint was declared `concurrent=True`; a concurrent endpoint starts as soon
as it arrives, so for it arrival order is only a start-order guarantee; a streaming endpoint
(`stream=True`) starts as it arrives and steps between other calls (hfrt.daemon.streaming). Synchronous endpoints run
on the loop thread (no thread hop: that is what keeps a no-op call cheap); heartbeats run on their
own thread, so a long endpoint never looks like death. Shutdown waits for every running call,
threaded ones included, within its grace period before teardown, and names any it gave up on.
The server owns its collaborators and calls them through their interfaces, each given what it
needs: the running-call records (hfrt.daemon.running), the outcome sender (replies), the stream
runner (streaming), the tensor plane (tensor_serving) and the heartbeat thread (heartbeat). A
daemon host (hfrt.daemon.host) runs many servers in one process and lends each its shared parts
(`Hosting`: one ZeroMQ context, one heartbeat thread, one data-plane server; signals are the
host's). It knows the protocol and the Daemon base class; nothing of any particular role or of
the algorithm.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import os
import signal
import socket
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from hfrt.daemon.base import Daemon, DaemonContext
from hfrt.daemon.heartbeat import Beats, HeartbeatEvent, HeartbeatThread, Traffic
from hfrt.daemon.replies import Replies
from hfrt.daemon.running import RunningCalls
from hfrt.daemon.streaming import StreamRunner
from hfrt.daemon.tensor_serving import INTERNAL, TensorServing
from hfrt.log import get_logger
from hfrt.protocols import (
    PROTOCOL_VERSION,
    Bye,
    Call,
    Cancel,
    Error,
    Hello,
    Limits,
    Message,
    Shutdown,
    Undecodable,
    UnknownKind,
    Welcome,
    Wire,
    WireError,
    check_heartbeat_s,
)
from hfrt.wire.channel import Channel
from hfrt.wire.endpoints import EndpointSpec, endpoint_table
from hfrt.wire.shm import host_id

if TYPE_CHECKING:
    from hfrt.daemon.tensors.plane import DataPlaneServer

EXIT_OK, EXIT_SETUP_FAILED, EXIT_PROTOCOL, EXIT_ORPHANED = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """How a daemon reaches its controller and how it behaves when left alone.

    controller: the controller's ZeroMQ address ("tcp://host:port" or "ipc:///path").
    heartbeat_s: beat interval until the controller's Welcome sets its own.
    orphan_timeout_s: exit after this long without word from any controller (0: never).
    shutdown_grace_s: how long running endpoints may take to finish on SIGTERM.
    exit_with_controller: exit once the controller that welcomed it is dead (hfrt.daemon.heartbeat);
        set for a run's daemons, not for daemons kept for `--attach`.
    """

    controller: str
    heartbeat_s: float = 2.0
    orphan_timeout_s: float = 60.0
    shutdown_grace_s: float = 5.0
    limits: Limits = field(default_factory=Limits)
    exit_with_controller: bool = False

    def __post_init__(self) -> None:
        check_heartbeat_s(self.heartbeat_s, "ServeConfig.heartbeat_s")


#: Makes one server's Beats: (identity, its ServeConfig, notify(event, detail)) → Beats.
BeatsFactory = Callable[[str, "ServeConfig", Callable[[HeartbeatEvent, str], None]], Beats]


@dataclass(frozen=True, slots=True)
class Hosting:
    """What a daemon host lends every server it runs in its one process (hfrt.daemon.host): its
    ZeroMQ context, its heartbeat thread (`beats` makes each server's share) and its data-plane
    server (whose address each server's hello declares). The host owns them and the signals."""

    zmq: zmq.Context[Any]
    beats: BeatsFactory
    data_plane: DataPlaneServer


class _Queued:
    __slots__ = ("call", "fn", "spec")

    def __init__(self, call: Call, spec: EndpointSpec, fn: Any) -> None:
        self.call, self.spec, self.fn = call, spec, fn


class DaemonServer:
    """Runs `daemon_cls` for one role rank until shutdown, SIGTERM or orphaning; returns an exit code."""

    def __init__(self, daemon_cls: type[Daemon], context: DaemonContext, config: ServeConfig, key: bytes) -> None:
        self.context = context
        self.config = config
        self._key = key
        self._daemon_cls = daemon_cls
        self._table = endpoint_table(daemon_cls)
        self._wire = Wire(key, config.limits)
        self._queue: deque[_Queued] = deque()
        self._ordered_busy = False
        self._pump_scheduled = False
        self._session = ""
        self._log = get_logger(role=context.role, rank=context.rank)
        self.daemon: Daemon | None = None
        self._channel: Channel | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._grace_s = 0.0  # how long running calls may take to finish, once stopping
        self.tensors = TensorServing(context.identity, key, context.options, self._table)
        self._calls = RunningCalls(self._log, self.tensors.forget)  # async, threaded, streaming
        #: the loop's exchange with the controller, which its heartbeat reads (beats it makes redundant are skipped)
        self.traffic = Traffic()
        self._replies = Replies(self._wire, self._send_frames, self._calls, self.tensors.export, self._log, self.traffic)
        self._streams = StreamRunner(self._track, self.tensors.arguments, self._replies)

    # -- life cycle ---------------------------------------------------------------------------

    async def run(self, hosting: Hosting | None = None) -> int:
        """Serve until shutdown, SIGTERM or orphaning; return the exit code. Alone, the server owns
        a ZeroMQ context, a heartbeat thread, a data-plane server and the process's signals; with
        `hosting` those are a daemon host's, shared by every server it runs."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stopped: asyncio.Future[tuple[str, int, float]] = loop.create_future()
        zctx: zmq.Context[Any] = zmq.Context() if hosting is None else hosting.zmq
        sock = zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.context.identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.config.controller)
        hb = self._own_heartbeat(zctx) if hosting is None else hosting.beats(
            self.context.identity, self.config, self._notify_from_heartbeat_thread)
        hb.traffic = self.traffic
        self._hb = hb
        if hosting is None:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop, f"signal {signal.Signals(sig).name}", EXIT_OK)
        hb.start()
        self.tensors.start(self.config.controller, None if hosting is None else hosting.data_plane)
        reason, code = "", EXIT_OK
        try:
            reason, code = await self._serve(sock)
        finally:
            await self._wind_down()
            self._say_bye(sock, reason, code)
            hb.stop()
            hb.join(timeout=2.0)
            self.tensors.close()
            linger = 0 if code == EXIT_ORPHANED else 1000  # nobody is left to read a Bye
            if self._channel is not None:
                self._channel.close(linger_ms=linger)
            else:
                sock.close(linger=linger)
            if hosting is None:
                zctx.term()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
        self._log.info("daemon_exit", reason=reason, exit_code=code)
        return code

    def _own_heartbeat(self, zctx: zmq.Context[Any]) -> HeartbeatThread:
        return HeartbeatThread(
            zctx,
            self.context.identity,
            self.config.controller,
            self._key,
            interval_s=self.config.heartbeat_s,
            orphan_timeout_s=self.config.orphan_timeout_s,
            notify=self._notify_from_heartbeat_thread,
            limits=self.config.limits,
            exit_with_controller=self.config.exit_with_controller,
        )

    def _notify_from_heartbeat_thread(self, event: HeartbeatEvent, detail: str) -> None:
        self._loop.call_soon_threadsafe(self._on_heartbeat_event, event, detail)

    async def _serve(self, sock: zmq.Socket[Any]) -> tuple[str, int]:
        try:
            self.daemon = self._daemon_cls(self.context)
            self.daemon.use_tensor_plane(self.tensors.runtime)
            await self.daemon.setup()
        except Exception as exc:
            self._log.error("setup_failed", error=f"{type(exc).__name__}: {exc}")
            return f"setup failed: {type(exc).__name__}: {exc}", EXIT_SETUP_FAILED
        self._channel = Channel(sock, self._on_frames, self._loop, limits=self.config.limits)
        self._channel.on_dropped = self._on_dropped_batch
        self._send_hello()
        self._log.info("daemon_ready", controller=self.config.controller, endpoints=sorted(self._table))
        reason, code, self._grace_s = await self._stopped
        return reason, code

    def stop(self, reason: str, code: int = EXIT_OK, grace_s: float | None = None) -> None:
        """Ask the serving loop to wind down (idempotent)."""
        if not self._stopped.done():
            grace = self.config.shutdown_grace_s if grace_s is None else grace_s
            self._stopped.set_result((reason, code, grace))

    async def _wind_down(self) -> None:
        self._queue.clear()
        grace_s = self._grace_s
        gave_up = await self._calls.settle(grace_s)  # threaded calls included
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if gave_up:  # still running: teardown runs beside them
            self._log.error("shutdown_gave_up", calls=gave_up, grace_s=grace_s)
        if self.daemon is not None:
            try:
                await asyncio.wait_for(self.daemon.teardown(), timeout=30.0)
            except Exception as exc:
                self._log.error("teardown_failed", error=f"{type(exc).__name__}: {exc}")

    def _say_bye(self, sock: zmq.Socket[Any], reason: str, code: int) -> None:
        """Send Bye after anything still queued, so no reply trails it."""
        frames = self._wire.pack(Bye(reason, code))
        try:
            if self._channel is not None:
                self._channel.send(frames)
                self._channel.flush()
            else:
                sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _send_hello(self) -> None:
        ctx = self.context
        hello = Hello(
            PROTOCOL_VERSION,
            ctx.role,
            ctx.rank,
            ctx.world_size,
            ctx.dp_rank,
            ctx.dp_size,
            os.getpid(),
            socket.gethostname(),
            ctx.impl,
            {name: spec.describe() for name, (spec, _) in self._table.items()},
            {"data": self.tensors.address, "host": host_id(), "pid": os.getpid(), **self._axes()},
        )
        self._send(hello)

    def _axes(self) -> dict[str, Any]:
        axes = self.daemon.dp_axes() if self.daemon is not None else {}
        return {"dp_axes": axes} if axes else {}

    # -- incoming -----------------------------------------------------------------------------

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            msg = self._wire.unpack(frames)
            self.traffic.heard = time.monotonic()  # signed by the controller: it is there
        except (Undecodable, UnknownKind) as exc:
            # Signed by our controller but unreadable: say so, the controller logs it.
            self._log.warning("bad_message", reason=str(exc), error=type(exc).__name__)
            self._send(Error(0, type(exc).__name__, f"{self.context.identity}: {exc}"))
            return
        except WireError as exc:
            # Unsigned, forged or oversized: read nothing, answer nothing.
            self._log.warning("dropped_frame", reason=str(exc), error=type(exc).__name__, frames=len(frames))
            return
        try:
            self._dispatch_message(msg)
        except Exception as exc:  # a bug here must cost one message, never the daemon or a hung call
            self._log.error("message_failed", kind=msg.NAME, error=f"{type(exc).__name__}: {exc}")
            if isinstance(msg, Call):
                self._replies.error(msg, "InternalError", f"{type(exc).__name__}: {exc}", traceback.format_exc())

    def _on_dropped_batch(self, peer: bytes, reason: str) -> None:
        self._log.warning("dropped_frame", reason=reason, error="FrameTooLarge")

    def _dispatch_message(self, msg: Message) -> None:
        kind = type(msg)
        if kind is Call:
            if self._wire.codec.records_seen:
                self.tensors.note_handles(msg.call_id)  # type: ignore[attr-defined]
            self._on_call(msg)  # type: ignore[arg-type]
        elif kind is Cancel:
            self._on_cancel(msg.call_id)  # type: ignore[attr-defined]
        elif kind is Welcome:
            self._on_welcome(msg)  # type: ignore[arg-type]
        elif kind is Shutdown:
            self._log.info("shutdown_requested", reason=msg.reason)  # type: ignore[attr-defined]
            self.stop(f"shutdown: {msg.reason}", EXIT_OK, msg.grace_s)  # type: ignore[attr-defined]
        elif kind is Error:
            self._on_controller_error(msg)  # type: ignore[arg-type]
        else:
            self._log.warning("unexpected_message", kind=msg.NAME)

    def _on_welcome(self, msg: Welcome) -> None:
        if msg.version != PROTOCOL_VERSION:
            self._log.error("protocol_mismatch", controller_version=msg.version, own_version=PROTOCOL_VERSION)
            self.stop(f"controller speaks protocol {msg.version}, daemon speaks {PROTOCOL_VERSION}", EXIT_PROTOCOL)
            return
        try:
            self._hb.welcome(msg.session, msg.heartbeat_s)
        except ValueError as exc:
            # The welcome is invalid: keep beating at our own interval (never flood, spin or fall
            # silent) and adopt nothing, so the next echo of its session makes us say hello again.
            self._log.error("bad_welcome", reason=str(exc), kept_heartbeat_s=self._hb.interval_s)
            self._send(Error(0, "BadWelcome", f"{self.context.identity}: {exc}; keeping {self._hb.interval_s}s"))
            return
        self._session = msg.session
        self._log.info("welcomed", session=msg.session, heartbeat_s=msg.heartbeat_s)

    def _on_controller_error(self, msg: Error) -> None:
        self._log.error("controller_error", type=msg.type, message=msg.message)
        if msg.type == "ProtocolMismatch":
            self.stop(f"controller refused hello: {msg.message}", EXIT_PROTOCOL)

    def _on_heartbeat_event(self, event: HeartbeatEvent, detail: str) -> None:
        if event is HeartbeatEvent.REHELLO:
            self._log.info("new_controller_session", session=detail)
            self._send_hello()
        elif event is HeartbeatEvent.ORPHANED:
            self.stop(f"orphaned: {detail}", EXIT_ORPHANED, 0.0)

    def _on_call(self, call: Call) -> None:
        entry = self._table.get(call.endpoint)
        if entry is None and call.endpoint in INTERNAL:
            self._run_internal(call)
            return
        if entry is None:
            known = ", ".join(sorted(self._table))
            self._replies.error(
                call, "UnknownEndpoint", f"role {self.context.role!r} has no endpoint {call.endpoint!r}; it has: {known}"
            )
            return
        spec, fn = entry
        try:
            spec.accepts(call.args, call.kwargs)
        except TypeError as exc:
            self._replies.error(call, "BadArguments", f"{call.endpoint}{_public_signature(spec)}: {exc}")
            return
        if spec.stream:  # hfrt.daemon.streaming: starts now, one step per loop turn
            self._streams.start(call, fn, self.daemon)
        elif spec.concurrent:
            self._start_concurrent(call, spec, fn)
        elif (
            not spec.is_async
            and not self._queue
            and not self._ordered_busy
            and not self._pump_scheduled
            and self._channel is not None
            and not self._channel.has_input()
        ):
            # Fast path: nothing queued, running or waiting to be read, so nothing could
            # cancel this call before it starts; run it now rather than one loop turn later.
            self._run_sync(call, fn)
        else:
            self._queue.append(_Queued(call, spec, fn))
            self._schedule_pump()

    def _on_cancel(self, call_id: int) -> None:
        for item in self._queue:
            if item.call.call_id == call_id:
                self._queue.remove(item)
                self.tensors.forget(call_id)
                self._log.debug("cancelled_queued", call_id=call_id)
                return
        if self._calls.cancel(call_id):  # a threaded one cannot be interrupted: its reply is dropped
            self._log.debug("cancelled_running", call_id=call_id)

    # -- running calls ------------------------------------------------------------------------

    def _schedule_pump(self) -> None:
        # Via call_soon, so every message already waiting (a Cancel among them) is read first.
        if not self._pump_scheduled and not self._ordered_busy and self._queue:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        """Run queued ordered calls until one is async, the queue empties, or input arrives.

        Stopping at new input lets the reader see a Cancel before the next queued call starts.
        """
        self._pump_scheduled = False
        assert self._channel is not None
        while self._queue and not self._ordered_busy and not self._stopped.done():
            item = self._queue.popleft()
            if item.spec.is_async:
                self._ordered_busy = True
                task = self._track(item.call, self._run_async(item.call, item.fn))
                task.add_done_callback(self._ordered_done)
                return
            self._run_sync(item.call, item.fn)
            if self._channel.has_input():
                break
        self._schedule_pump()

    def _ordered_done(self, task: asyncio.Task[Any]) -> None:
        self._ordered_busy = False
        self._schedule_pump()

    def _start_concurrent(self, call: Call, spec: EndpointSpec, fn: Any) -> None:
        if spec.is_async:
            coro = self._run_async(call, fn)
        else:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="hfrt-endpoint")
            coro = self._run_threaded(call, fn)
        self._track(call, coro)

    def _track(self, call: Call, coro: Any) -> asyncio.Task[Any]:
        return self._calls.start(self._loop, call, coro)

    def _run_sync(self, call: Call, fn: Any) -> None:
        start = time.perf_counter()
        try:
            args, kwargs = self.tensors.arguments(call)
            value = fn(self.daemon, *args, **kwargs)
        except Exception as exc:
            self._replies.raised(call, exc)
        else:
            self._replies.result(call, value, time.perf_counter() - start)

    async def _run_async(self, call: Call, fn: Any) -> None:
        start = time.perf_counter()
        try:
            args, kwargs = self.tensors.arguments(call)
            value = await fn(self.daemon, *args, **kwargs)
        except Exception as exc:
            self._replies.raised(call, exc)
        else:
            self._replies.result(call, value, time.perf_counter() - start)

    async def _run_threaded(self, call: Call, fn: Any) -> None:
        assert self._pool is not None
        start = time.perf_counter()
        self._calls.in_thread(call.call_id)
        try:
            args, kwargs = self.tensors.arguments(call)
            job = functools.partial(fn, self.daemon, *args, **kwargs)
            value = await self._loop.run_in_executor(self._pool, job)
        except Exception as exc:
            self._replies.raised(call, exc)
        else:
            self._replies.result(call, value, time.perf_counter() - start)

    def _run_internal(self, call: Call) -> None:
        """A tensor-plane call of the controller's (hfrt.daemon.tensor_serving.INTERNAL)."""
        start = time.perf_counter()
        try:
            value = self.tensors.internal(call)
        except Exception as exc:
            self._replies.raised(call, exc)
        else:
            self._replies.result(call, value, time.perf_counter() - start)

    # -- outgoing -----------------------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        self._send_frames(self._wire.pack(msg))

    def _send_frames(self, frames: list[Any]) -> None:
        if self._channel is not None:
            self._channel.send(frames)


def _public_signature(spec: EndpointSpec) -> str:
    """`(a, b=1, *rest)`: the endpoint's parameters after self, without annotations."""
    params = [
        p.replace(annotation=inspect.Parameter.empty) for p in list(spec.signature.parameters.values())[1:]
    ]
    return str(spec.signature.replace(parameters=params, return_annotation=inspect.Signature.empty))
