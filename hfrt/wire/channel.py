"""A synchronous ZeroMQ socket driven by an asyncio loop's reader callback, with send batching.

zmq.asyncio wraps every send and receive in futures; here the loop's reader callback drains the
socket directly and hands each message to one function. Sends are queued per peer and flushed
once per loop turn: several messages for one peer leave as one multipart ZeroMQ message
`[b"", m1, m2, ...]` (a real message's first frame is never empty), so a burst of calls costs one
wake-up of ZeroMQ's I/O thread instead of one each. A batch obeys the message limits as a whole
(frames, the empty one included, and bytes: protocols/README.md); one that breaks them on receipt
is dropped whole and reported to `on_dropped`. ZeroMQ's FD is edge-triggered, so after
every send we look at ZMQ_EVENTS and drain if input is waiting. Frames go through pyzmq's
compiled backend with plain int flags (pyzmq's Python layer builds enum flags per frame and
costs ~5x more per message). It knows nothing of what the frames mean. Not thread-safe: only the
loop's thread may touch the socket.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from hfrt.protocols import Limits

#: Messages handled per reader callback before yielding to other callbacks (fairness).
DRAIN_BATCH = 256
#: First frame of a coalesced batch.
BATCH_MARK = b""

_send: Any
_recv: Any
_get: Any
try:  # pyzmq's compiled socket methods, without the Python sugar layer around them
    _send = zmq.backend.Socket.send
    _recv = zmq.backend.Socket.recv
    _get = zmq.backend.Socket.get
except AttributeError:  # pragma: no cover - other pyzmq backends
    _send, _recv, _get = zmq.Socket.send, zmq.Socket.recv, zmq.Socket.getsockopt

_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE) | _NOBLOCK
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

#: A queued outgoing message: (routing prefix frames, message frames).
_Out = tuple[tuple[bytes, ...], list[Any]]


def send_frames(socket: zmq.Socket[Any], frames: list[Any]) -> None:
    """Send one multipart message without blocking (raises zmq.Again when the queue is full).

    A refusal can only come on the first frame (ZeroMQ queues multipart messages atomically).
    """
    if len(frames) == 2:  # the common case: a routing id and one frame
        _send(socket, frames[0], _MORE)
        _send(socket, frames[1], _NOBLOCK)
        return
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _send(socket, frame, _MORE if i < last else _NOBLOCK)


def recv_frames(socket: zmq.Socket[Any], routed: bool = False) -> list[bytes]:
    """One whole multipart message (raises zmq.Again when none is waiting). A ROUTER's first frame
    (the peer's routing id) always has another after it, so that frame's RCVMORE is not asked.
    Whether more follow is read from the frame itself (`Frame.more`): asking RCVMORE through
    getsockopt builds a SocketOption enum each time, a microsecond a message."""
    parts = [_recv(socket, _NOBLOCK)] if routed else []
    frame = _recv(socket, _NOBLOCK, copy=False)
    parts.append(frame.bytes)
    while frame.more:
        frame = _recv(socket, _NOBLOCK, copy=False)
        parts.append(frame.bytes)
    return parts


def unbatch(frames: list[bytes]) -> list[list[bytes]]:
    """The messages of one received multipart message (no routing id): a Channel's coalesced batch
    `[b"", m1, m2, ...]` is several one-frame messages, anything else one message. For readers of
    a Channel's peer without a Channel of their own (a daemon's heartbeat thread)."""
    if len(frames) > 1 and frames[0] == BATCH_MARK:
        return [[frame] for frame in frames[1:]]
    return [frames]


def readable(socket: zmq.Socket[Any]) -> bool:
    return bool(_get(socket, _EVENTS) & _POLLIN)


class Channel:
    """Owns one zmq socket on one event loop: `send` frames, `on_message` receives them.

    routed: True for a ROUTER socket, whose messages start with the peer's routing id; the
        routing id is passed to `send` as `peer` and handed to `on_message` as frame 0.
    """

    def __init__(
        self,
        socket: zmq.Socket[Any],
        on_message: Callable[[list[bytes]], None],
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        routed: bool = False,
        limits: Limits | None = None,
    ) -> None:
        self.socket = socket
        self._limits = limits or Limits()
        self._max_batch = self._limits.max_frames - 1  # the empty first frame counts
        self._on_message = on_message
        self._loop = loop or asyncio.get_running_loop()
        self._routed = routed
        self._fd = int(socket.getsockopt(zmq.FD))
        self._outbox: dict[bytes, list[list[Any]]] = {}
        self._backlog: deque[list[Any]] = deque()
        self._flush_scheduled = False
        self._writing = False
        self._drain_scheduled = False
        self._draining = False
        self._batch_left = 0  # messages of the batch being delivered that are still to come
        self._closed = False
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()

    def drain_now(self) -> None:
        """Read and hand over every message already waiting (normally the loop's reader does)."""
        if not self._closed and not self._draining:
            self._drain()

    def drain_all(self, max_rounds: int = 64) -> None:
        """Read and hand over what is waiting now, up to max_rounds × DRAIN_BATCH messages."""
        for _ in range(max_rounds):
            if self._closed or self._draining or not readable(self.socket):
                return
            self._drain()

    def has_input(self) -> bool:
        """True when a message is waiting: later in the batch being delivered, or on the socket."""
        return self._batch_left > 0 or readable(self.socket)

    def send(self, frames: list[Any], peer: bytes = b"") -> None:
        """Send one message to `peer` (ROUTER) or the peer (DEALER).

        The first message of a loop turn leaves at once (no latency added to a lone call); any
        sent after it in the same turn are queued and leave together when the turn ends.
        """
        if self._closed:
            raise RuntimeError("channel is closed")
        if not self._flush_scheduled and not self._draining:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)
            self._emit([peer, *frames] if self._routed else frames)
            if readable(self.socket):
                self._schedule_drain()
            return
        # Inside the reader callback the drain's end is the turn's end: queue, flush there.
        queued = self._outbox.get(peer)
        if queued is None:
            self._outbox[peer] = [frames]
        else:
            queued.append(frames)

    def flush(self) -> None:
        """Hand every queued message to ZeroMQ now. Raises zmq.ZMQError for an unroutable peer
        only through `on_unroutable`; other peers' messages still leave."""
        self._flush_scheduled = False
        if self._closed:
            return
        outbox, self._outbox = self._outbox, {}
        for peer, messages in outbox.items():
            prefix = [peer] if self._routed else []
            if len(messages) == 1:
                self._emit(prefix + messages[0])
            else:
                self._emit_batches(prefix, messages)
        if readable(self.socket):
            self._schedule_drain()

    def _emit_batches(self, prefix: list[bytes], messages: list[list[Any]]) -> None:
        """Send `messages` in order, one-frame ones coalesced into batches within the limits."""
        chunk: list[Any] = []
        size = 0
        for message in messages:
            if len(message) != 1:  # out-of-band buffers: never batched
                self._emit_chunk(prefix, chunk)
                chunk, size = [], 0
                self._emit(prefix + message)
                continue
            nbytes = len(message[0])
            if chunk and (len(chunk) == self._max_batch or size + nbytes > self._limits.max_message_bytes):
                self._emit_chunk(prefix, chunk)
                chunk, size = [], 0
            chunk.append(message[0])
            size += nbytes
        self._emit_chunk(prefix, chunk)

    def _emit_chunk(self, prefix: list[bytes], chunk: list[Any]) -> None:
        if len(chunk) == 1:
            self._emit(prefix + chunk)
        elif chunk:
            self._emit(prefix + [BATCH_MARK] + chunk)

    #: Called with (peer, error) when ZeroMQ refuses to route to a peer; set by the owner.
    on_unroutable: Callable[[bytes, zmq.ZMQError], None] | None = None
    #: Called with (peer, reason) when a received batch breaks the limits and is dropped whole.
    on_dropped: Callable[[bytes, str], None] | None = None

    def _emit(self, frames: list[Any]) -> None:
        if self._backlog:
            self._backlog.append(frames)
            return
        try:
            send_frames(self.socket, frames)
        except zmq.Again:
            self._backlog.append(frames)
            self._start_writing()
        except zmq.ZMQError as exc:
            if self.on_unroutable is None or not self._routed:
                raise
            self.on_unroutable(frames[0], exc)

    def close(self, linger_ms: int = 0) -> None:
        """Send what is queued, stop reading and close the socket; `linger_ms` lets it leave."""
        if self._closed:
            return
        try:
            self.flush()
        except zmq.ZMQError:
            pass
        self._closed = True
        self._loop.remove_reader(self._fd)
        if self._writing:
            self._loop.remove_writer(self._fd)
        self.socket.close(linger=linger_ms)

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        # Receive until zmq.Again rather than asking ZMQ_EVENTS before each message: that ask is a
        # poll() system call (libzmq processes its command pipe unthrottled) and an enum, about
        # 5 µs a message, while the one Again at the end costs about 4 µs a drain. A non-blocking
        # receive that finds nothing processes the command pipe itself, which re-arms the
        # edge-triggered FD as the EVENTS check did.
        self._drain_scheduled = False
        socket = self.socket
        routed = self._routed
        self._draining = True
        try:
            for _ in range(DRAIN_BATCH):
                if self._closed:
                    break
                try:
                    frames = recv_frames(socket, routed)
                except zmq.Again:
                    break
                self._deliver(frames)
            else:
                self._schedule_drain()  # more may be waiting; let other callbacks run first
        finally:
            self._draining = False
        if self._outbox and not self._flush_scheduled:
            self.flush()
        if self._backlog and not self._closed:
            self._flush_backlog()

    def _deliver(self, frames: list[bytes]) -> None:
        head = 1 if self._routed else 0
        if len(frames) > head + 1 and frames[head] == BATCH_MARK:
            prefix, messages = frames[:head], frames[head + 1 :]
            problem = self._limits.check([len(f) for f in frames[head:]])
            if problem is not None:
                if self.on_dropped is not None:
                    self.on_dropped(prefix[0] if prefix else b"", f"batch of {len(messages)} messages: {problem}")
                return
            try:
                for i, frame in enumerate(messages):
                    self._batch_left = len(messages) - i - 1
                    self._on_message(prefix + [frame])
            finally:
                self._batch_left = 0
        else:
            self._on_message(frames)

    def _start_writing(self) -> None:
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._flush_backlog)

    def _flush_backlog(self) -> None:
        while self._backlog and not self._closed:
            try:
                send_frames(self.socket, self._backlog[0])
            except zmq.Again:
                self._start_writing()
                return
            except zmq.ZMQError:
                pass  # unroutable by now (peer gone); the liveness check fails its calls
            self._backlog.popleft()
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        if not self._closed and readable(self.socket):
            self._schedule_drain()
