"""A synchronous ZeroMQ socket driven by an asyncio loop's reader callback.

zmq.asyncio wraps every send and receive in futures; here the loop's reader callback drains the
socket directly and hands each multipart message to one function, which is what makes a round
trip cost little more than raw ZeroMQ. ZeroMQ's FD is edge-triggered, so after every send we
look at ZMQ_EVENTS and drain if input is waiting. It knows nothing of messages or signing.
Not thread-safe: only the loop's thread may touch the socket.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

#: Messages handled per reader callback before yielding to other callbacks (fairness).
DRAIN_BATCH = 256


class Channel:
    """Owns one zmq socket on one event loop: `send` frames, `on_message` receives them."""

    def __init__(
        self,
        socket: zmq.Socket[Any],
        on_message: Callable[[list[bytes]], None],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.socket = socket
        self._on_message = on_message
        self._loop = loop or asyncio.get_running_loop()
        self._fd = socket.getsockopt(zmq.FD)
        self._backlog: deque[list[Any]] = deque()
        self._writing = False
        self._drain_scheduled = False
        self._closed = False
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()

    def send(self, frames: list[Any]) -> None:
        """Queue one multipart message; never blocks. Raises zmq.ZMQError for unroutable peers."""
        if self._closed:
            raise RuntimeError("channel is closed")
        if self._backlog:
            self._backlog.append(frames)
        else:
            try:
                self.socket.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                self._backlog.append(frames)
                self._start_writing()
        if self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._schedule_drain()

    def close(self, linger_ms: int = 0) -> None:
        """Stop reading and close the socket; `linger_ms` lets already-sent frames leave."""
        if self._closed:
            return
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
        self._drain_scheduled = False
        socket = self.socket
        for _ in range(DRAIN_BATCH):
            if self._closed:
                return
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_message(frames)
        else:
            self._schedule_drain()  # more may be waiting; let other callbacks run first
        if self._backlog and not self._closed:
            self._flush()

    def _start_writing(self) -> None:
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._flush)

    def _flush(self) -> None:
        while self._backlog and not self._closed:
            try:
                self.socket.send_multipart(self._backlog[0], zmq.NOBLOCK)
            except zmq.Again:
                self._start_writing()
                return
            except zmq.ZMQError:
                pass  # unroutable by now (peer gone); the liveness check fails its calls
            self._backlog.popleft()
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        if not self._closed and self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._schedule_drain()
