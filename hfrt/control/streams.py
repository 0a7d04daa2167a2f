"""Calls of streaming endpoints, controller side: a CallStream is an async iterator over the values
the daemon yields (Partial messages, in order) whose `result()` is the call's Reply value;
StreamCalls, which the Controller owns, opens them (`Controller.submit_stream`) and routes each
Partial to its stream.

    stream = rollout.generate_turn_stream.stream(0, context, append, max_new_tokens=64)
    async for token in stream:      # each as the daemon sampled it
        ...
    final = await stream.result()   # the Reply; an error raises here (and from the iteration)

Closing a stream early (`await stream.aclose()`, leaving `async with stream`, or cancelling the
task that iterates) cancels the call: the daemon closes the generator before its next step. A
stream call is not retried by the recovery layer (its partials may already have been used). It
is given a way to send a call, the controller's pending calls and a way to restart one's
deadline; it knows nothing of sockets or of what is streamed.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from hfrt.protocols import Partial

if TYPE_CHECKING:
    from hfrt.control.daemons import DaemonInfo
    from hfrt.control.pending import Pending
    from hfrt.control.strays import StrayReplies

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


class SendCall(Protocol):
    """Send one Call to one daemon now (timeout_s: its first deadline; None: none); returns the
    call id and the future of its Reply value."""

    def __call__(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any],
                 timeout_s: float | None) -> tuple[int, asyncio.Future[Any]]: ...


class StreamCalls:
    """The streaming calls the controller has open, by call id, and those that ended lately.

    send: sends one call and gives its id (the controller's call table waits for its Reply).
    pending: the controller's pending call with an id (None: not, or no longer, waited for).
    restart_deadline: restart a pending call's deadline of `timeout` seconds from now.
    stats: the controller's counters (this adds `late_partials`, `dropped_replies`).
    strays: counts and logs a partial for a call that was never ours.
    """

    def __init__(self, send: SendCall, pending: Callable[[int], Pending | None],
                 restart_deadline: Callable[[int, Pending, float], None], stats: dict[str, int],
                 strays: StrayReplies) -> None:
        self._send = send
        self._pending = pending
        self._restart_deadline = restart_deadline
        self._stats = stats
        self._strays = strays
        self._open: dict[int, CallStream] = {}
        self._ended: dict[int, None] = {}  # insertion-ordered set of the latest REMEMBER

    def open(self, info: DaemonInfo, endpoint: str, args: list[Any], kwargs: dict[str, Any],
             timeout_s: float | None) -> CallStream:
        """Send one Call of a streaming endpoint; its partials feed the stream returned.
        `timeout_s` bounds each wait: for the first partial, between two partials, and for the
        reply after the last, so a long stream that keeps producing lives on."""
        call_id, future = self._send(info, endpoint, args, kwargs, timeout_s)
        stream = CallStream(future)
        if not future.done():  # refused before sending (daemon gone, session failed): nothing to route
            self._open[call_id] = stream
            stream.timeout_s = timeout_s
            future.add_done_callback(functools.partial(self._ended_call, call_id))
        return stream

    def _ended_call(self, call_id: int, _: asyncio.Future[Any]) -> None:
        self._open.pop(call_id, None)
        self._ended[call_id] = None
        if len(self._ended) > REMEMBER:
            del self._ended[next(iter(self._ended))]

    @property
    def open_calls(self) -> int:
        """Streams whose call has not ended."""
        return len(self._open)

    def partial(self, ident: bytes, msg: Partial) -> None:
        """A Partial from peer `ident`: to its stream if `ident` is the daemon the call went to
        (its deadline restarts); counted as late when its stream ended lately, as a stray when
        it was never ours, as a dropped reply when another peer sent it."""
        stream = self._open.get(msg.call_id)
        pending = self._pending(msg.call_id)
        if stream is None or pending is None:
            if msg.call_id in self._ended:
                self._stats["late_partials"] = self._stats.get("late_partials", 0) + 1  # in flight when it was given up on
            else:
                self._strays.arrived(ident, msg.call_id, "partial")
            return
        if ident != pending.daemon.route:
            self._stats["dropped_replies"] += 1
            return
        pending.daemon.last_seen = asyncio.get_running_loop().time()
        if stream.timeout_s is not None:  # the deadline counts from this partial
            self._restart_deadline(msg.call_id, pending, stream.timeout_s)
        stream.put(msg.value)
