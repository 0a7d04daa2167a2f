"""Calls of streaming endpoints, controller side: a CallStream is an async iterator over the values
the daemon yields (Partial messages, in order) whose `result()` is the call's Reply value; the
StreamCalls mixin gives the Controller `submit_stream` and routes Partials to their stream.

    stream = rollout.generate_turn_stream.stream(0, context, append, max_new_tokens=64)
    async for token in stream:      # each as the daemon sampled it
        ...
    final = await stream.result()   # the Reply; an error raises here (and from the iteration)

Closing a stream early (`await stream.aclose()`, leaving `async with stream`, or cancelling the
task that iterates) cancels the call: the daemon closes the generator before its next step. A
stream call is not retried by the recovery layer (its partials may already have been used). It
knows the controller's call table and futures; nothing of sockets or of what is streamed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from hfrt.protocols import Partial

if TYPE_CHECKING:
    from hfrt.control.daemons import DaemonInfo

#: call ids of streams given up on that are remembered, so their partials still in flight are counted quietly
REMEMBER = 1024


class CallStream:
    """The partial values of one streaming call, then its final value (see the module docstring)."""

    def __init__(self, future: asyncio.Future[Any] | None = None) -> None:
        self.future: asyncio.Future[Any] = future if future is not None else asyncio.get_running_loop().create_future()
        self._parts: deque[Any] = deque()
        self._wake = asyncio.Event()
        self.received = 0
        self.timeout_s: float | None = None  # the wait each partial restarts (set by submit_stream)
        self.future.add_done_callback(lambda _: self._wake.set())

    def put(self, value: Any) -> None:
        """A Partial arrived (called by the controller, in arrival order)."""
        self._parts.append(value)
        self.received += 1
        self._wake.set()

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> Any:
        while True:
            if self._parts:
                return self._parts.popleft()
            if self.future.done():
                if not self.future.cancelled():
                    self.future.result()  # the call's error, if it failed
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()

    async def result(self) -> Any:
        """The call's Reply value (the generator's return value), once every partial arrived."""
        return await asyncio.shield(self.future)

    async def aclose(self) -> None:
        """Stop the call if it still runs (the daemon stops the generator); idempotent."""
        if not self.future.done():
            self.future.cancel()

    async def __aenter__(self) -> CallStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class StreamCalls:
    """Mixed into the Controller: `submit_stream`, and `_on_partial` for its message dispatch.
    Needs from its host: submit, _calls, _next_id, _stats, _strays, _loop."""

    _calls: dict[int, Any]
    _next_id: int
    default_timeout_s: float | None
    _stats: dict[str, int]
    _strays: Any

    if TYPE_CHECKING:
        def submit(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
                   timeout_s: float | None = None, reply: bool = True) -> asyncio.Future[Any]: ...
        def _expire(self, call_id: int, timeout: float) -> None: ...

    def submit_stream(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any], *,
                      timeout_s: float | None = None) -> CallStream:
        """Send one Call of a streaming endpoint to one daemon now; its partials feed the stream.
        `timeout_s` (else the controller's default) bounds each wait: for the first partial, between
        two partials, and for the reply after the last, so a long stream that keeps producing lives on."""
        streams = self.__dict__.setdefault("_streams", {})
        ended: dict[int, None] = self.__dict__.setdefault("_streams_ended", {})
        call_id = self._next_id  # the id submit() gives this call
        future = self.submit(info, endpoint, args, kwargs, timeout_s=timeout_s)
        stream = CallStream(future)
        if not future.done():
            streams[call_id] = stream
            stream.timeout_s = self.default_timeout_s if timeout_s is None else timeout_s

            def forget(_: asyncio.Future[Any]) -> None:
                streams.pop(call_id, None)
                ended[call_id] = None
                if len(ended) > REMEMBER:
                    del ended[next(iter(ended))]

            future.add_done_callback(forget)
        return stream

    def _on_partial(self, ident: bytes, msg: Partial) -> None:
        stream = self.__dict__.get("_streams", {}).get(msg.call_id)
        pending = self._calls.get(msg.call_id)
        if stream is None or pending is None:
            if msg.call_id in self.__dict__.get("_streams_ended", {}):
                self._stats["late_partials"] = self._stats.get("late_partials", 0) + 1  # in flight when it was given up on
            else:
                self._strays.arrived(ident, msg.call_id, "partial")
            return
        if ident != pending.daemon.route:
            self._stats["dropped_replies"] += 1
            return
        loop = asyncio.get_running_loop()
        pending.daemon.last_seen = loop.time()
        if pending.timer is not None and stream.timeout_s is not None:  # the deadline counts from this partial
            pending.timer.cancel()
            pending.timer = loop.call_later(stream.timeout_s, self._expire, msg.call_id, stream.timeout_s)
        stream.put(msg.value)
